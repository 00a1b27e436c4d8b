"""The scheduler half of host prefix hits (host_prefix/index.py): which boundary a request
leaves, which later prompt hits it, and the entries' lifetime within the byte budget."""
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_dhisparse.integration.host_prefix.index import PrefixIndex, window_positions  # noqa: E402

HB = 4  # tokens per block hash (the GCD of the groups' block sizes)


def spec(block_size, page, window=None):
    return SimpleNamespace(block_size=block_size, page_size_bytes=page, sliding_window=window,
                           extra_retained_tokens=0)


def kv_config():
    """The demo model's groups: full 256-token blocks, 4/8-token compressor states and
    64-token SWA windows, the c4a group."""
    groups = [([spec(256, 100)] * 3), [spec(4, 10, 8)] * 2, [spec(64, 50, 128)], [spec(256, 400)],
              [spec(8, 30, 128)]]
    return SimpleNamespace(hash_block_size=HB, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=specs[0], layer_names=[f"g{g}.l{i}" for i in range(len(specs))])
        for g, specs in enumerate(groups)])


def request(rid, tokens):
    """A request whose block hashes identify its token prefix (as vLLM's chained ones)."""
    hashes = [tuple(tokens[:(i + 1) * HB]) for i in range(len(tokens) // HB)]
    return SimpleNamespace(request_id=rid, num_tokens=len(tokens), block_hashes=hashes)


def test_window_positions_follow_vllm_sliding_window_skipping():
    assert window_positions(spec(256, 1), 2816) == range(0, 11)
    # skipped(2816) = 2816 - 128 + 1 = 2689 -> block 42 of 64 tokens: blocks 42, 43
    assert window_positions(spec(64, 1, 128), 2816) == range(42, 44)
    assert window_positions(spec(4, 1, 8), 2816) == range(702, 704)
    assert window_positions(spec(8, 1, 128), 256) == range(16, 32)


def test_ended_request_leaves_its_boundary_and_a_later_prompt_hits_it():
    idx = PrefixIndex(10**9, kv_config(), True)
    turn1 = list(range(3000))
    r0 = request("r0", turn1)
    idx.on_step("r0", 2820)  # its latest step started at 2820 computed tokens
    assert idx.on_ended(r0)  # a capture: vLLM keeps its blocks until the worker copied them
    captures, loads, evictions = idx.take()
    assert [(c.req_id, c.num_tokens) for c in captures] == [("r0", 2816)]
    r1 = request("r1", turn1 + list(range(5000, 5300)))
    assert idx.lookup(r1, 512) == 0  # not hit before the worker reports the capture done
    idx.confirm({captures[0].entry_id})
    assert idx.bytes == idx.nbytes(2816) == 3 * 11 * 100 + 2 * 2 * 10 + 2 * 50 + 11 * 400 + 16 * 30
    # the next turn: the whole first turn and more; a local hit of 512 tokens
    assert idx.lookup(r1, 512) == 2816 - 512
    assert idx.wants_load("r1")
    assert idx.after_alloc(r1, ([1], [2]), 2816 - 512)
    _, loads, _ = idx.take()
    assert [(ld.req_id, ld.entry_id, ld.first_token, ld.num_tokens) for ld in loads] == \
        [("r1", captures[0].entry_id, 512, 2816)]
    # a prompt that diverges before the boundary, or is not longer than it, misses
    assert idx.lookup(request("r2", turn1[:2000] + [9] * 1000), 0) == 0
    assert idx.lookup(request("r3", turn1[:2816]), 0) == 0
    # a local hit covering the entry: nothing external
    assert idx.lookup(r1, 2816) == 0


def test_same_prefix_is_captured_once_and_short_requests_not_at_all():
    idx = PrefixIndex(10**9, kv_config(), True)
    toks = list(range(600))
    for rid in ("a", "b"):
        idx.on_step(rid, 590)
        idx.on_ended(request(rid, toks))
    idx.on_step("c", 200)  # below one boundary
    idx.on_ended(request("c", list(range(300))))
    idx.on_ended(request("never-scheduled", toks))
    captures, _, _ = idx.take()
    assert [(c.req_id, c.num_tokens) for c in captures] == [("a", 512)]


def test_least_recently_used_entries_go_first_within_the_budget():
    size = PrefixIndex(1, kv_config(), True).nbytes(512)
    idx = PrefixIndex(2 * size, kv_config(), True)
    reqs = {rid: request(rid, [k] * 600) for k, rid in enumerate("abc")}
    for rid in "ab":
        idx.on_step(rid, 520)
        idx.on_ended(reqs[rid])
    idx.confirm(c.entry_id for c in idx.take()[0])
    # a hit on "a" makes "b" the least recently used
    assert idx.lookup(request("a2", [0] * 700), 0) == 512
    idx.after_alloc(request("a2", [0] * 700), ([],), 512)
    idx.take()
    idx.on_step("c", 520)
    idx.on_ended(reqs["c"])
    captures, _, evictions = idx.take()
    assert [c.req_id for c in captures] == ["c"] and len(evictions) == 1
    idx.confirm({captures[0].entry_id})
    assert idx.lookup(request("b2", [1] * 700), 0) == 0
    assert idx.lookup(request("a3", [0] * 700), 0) == 512
    assert idx.bytes == 2 * size
    # an entry larger than the whole budget is never planned
    idx.on_step("big", 2900)
    idx.on_ended(request("big", [7] * 3000))
    assert idx.take()[0] == []


def test_lost_captures_are_forgotten_and_reset_frees_everything():
    idx = PrefixIndex(10**9, kv_config(), True)
    for k, rid in enumerate("ab"):
        idx.on_step(rid, 600)
        idx.on_ended(request(rid, [k] * 700))
    a, b = idx.take()[0]
    idx.confirm({a.entry_id, b.entry_id})
    idx.forget({a.entry_id})  # its capture or a load of it failed
    assert idx.lookup(request("x", [0] * 800), 0) == 0
    assert idx.lookup(request("y", [1] * 800), 0) == 512
    idx.reset()
    assert idx.take()[2] == [b.entry_id] and idx.bytes == 0
    assert idx.lookup(request("z", [1] * 800), 0) == 0


def test_preempted_request_is_captured_and_its_resume_hits():
    idx = PrefixIndex(10**9, kv_config(), True)
    toks = list(range(1100))
    r = request("r", toks)
    idx.on_step("r", 1030)
    idx.on_ended(r)  # preempted: vLLM resumes it with 0 computed tokens
    captures = idx.take()[0]
    assert [c.num_tokens for c in captures] == [1024]
    idx.confirm({captures[0].entry_id})
    assert idx.lookup(r, 0) == 1024


@pytest.mark.parametrize("runner_v2", [True, False], ids=["runner_v2", "runner_v1"])
def test_a_preempted_capture_carries_the_blocks_vllm_rewrites_before_the_forward(runner_v2):
    """Model runner V2 only: V1 calls handle_preemptions before it writes a block."""
    from vllm_dhisparse.integration.engine_core.scheduler_side import SchedulerSide
    side = SchedulerSide(8192, prefix=PrefixIndex(10**9, kv_config(), True),
                         rewrites_before_preemptions=runner_v2)
    r = request("r", list(range(1100)))
    r.num_prompt_tokens, r.sampling_params = 1100, SimpleNamespace(max_tokens=16)
    side.on_new_request(r)
    cached = SimpleNamespace(req_ids=["r"], num_computed_tokens=[0], new_block_ids=[([1],)],
                             resumed_req_ids=set())

    def out(preempted=(), zero=None, copies=None):
        return SimpleNamespace(
            scheduled_spec_decode_tokens={}, scheduled_new_reqs=[],
            scheduled_cached_reqs=cached if not preempted else SimpleNamespace(
                req_ids=[], num_computed_tokens=[], new_block_ids=[], resumed_req_ids=set()),
            num_scheduled_tokens={"r": 1030} if not preempted else {},
            preempted_req_ids=set(preempted), finished_req_ids=set(),
            new_block_ids_to_zero=zero, kv_cache_block_copies=copies)
    assert side.build_connector_meta(out(zero=[7])).rewritten_blocks == frozenset()
    copy = SimpleNamespace(src_block_id=3, dst_block_id=9)
    meta = side.build_connector_meta(out(preempted=["r"], zero=[7, 8], copies=[copy]))
    assert [c.req_id for c in meta.prefix_captures] == ["r"]
    assert meta.rewritten_blocks == ({7, 8, 9} if runner_v2 else frozenset())


def test_disabled_index_plans_nothing():
    idx = PrefixIndex(0, kv_config(), True)
    idx.on_step("a", 600)
    idx.on_ended(request("a", [0] * 700))
    assert idx.take() == ([], [], []) and idx.lookup(request("b", [0] * 800), 0) == 0
