"""WorkerSide on CPU without a model: two sparse sources in two KV cache groups, fed
scripted step metadata and vLLM-like paged caches; the routed layers' calls go through
the step's context as the attention layer makes them.

* the stats collector's resolver / admission counters are ``summary()``'s totals;
* the batch row -> request map (block of the newest token) is built once per step and
  group, and follows the request's blocks from one step to the next;
* requests with different numbers of verification queries share one resolve call.
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="WorkerSide logs through vLLM's logger")

from vllm_dhisparse.config import DHiSparseConfig  # noqa: E402
from vllm_dhisparse.integration.layers import routing as R  # noqa: E402
from vllm_dhisparse.integration.layers import step_context  # noqa: E402
from vllm_dhisparse.integration.worker import worker_side as WS  # noqa: E402
from vllm_dhisparse.integration.worker.decode_policy import CudaDecode  # noqa: E402
from vllm_dhisparse.integration.metadata import DHiSparseMetadata, RequestStep  # noqa: E402
from vllm_dhisparse.integration.layers.model_probe import SparseLayer  # noqa: E402
from vllm_dhisparse.integration.metrics.stats import METRICS, StatsCollector  # noqa: E402

from tests.fault_injection import faulty_worker_side  # noqa: E402
from vllm_dhisparse.hierarchy.invariants import check_invariants  # noqa: E402

# 16 and 8 tokens per vLLM block
LAYERS = [SparseLayer("l0", compress_ratio=4, top_k=4, row_bytes=6, rows_per_block=4, group=0,
                      plane_bytes=(4, 2)),
          SparseLayer("l1", compress_ratio=4, top_k=4, row_bytes=6, rows_per_block=2, group=1,
                      plane_bytes=(5, 1))]
NUM_BLOCKS = 40
fresh_newest_blocks = R.newest_blocks  # unpatched, for a map built from scratch

# "a" completes its 40-token prefill in step 0 (admitted after that forward), then decodes 2
# queries per step (a new block in each group at step 2); "b" is in prefill in step 1 and
# completes it in step 2.  Block tables as vLLM hands them: rows a, b.
PREFILL = DHiSparseMetadata(step=0, requests=[
    RequestStep("a", 0, 40, prompt_len=40, block_ids=([10, 11, 12], [20, 21, 22, 23, 24, 25]),
                replace_blocks=True, max_tokens=40, completes_prefill=True)])
STEPS = [
    dict(meta=DHiSparseMetadata(step=1, requests=[
        RequestStep("a", 40, 2, prompt_len=40, block_ids=([], []), replace_blocks=False,
                    max_tokens=40),
        RequestStep("b", 0, 16, prompt_len=30, block_ids=([13, 14], [26, 27, 28, 29]),
                    replace_blocks=True, max_tokens=10)]),
         tables=([[10, 11, 12, 0], [13, 14, 0, 0]],
                 [[20, 21, 22, 23, 24, 25, 0], [26, 27, 28, 29, 0, 0, 0]]),
         seq_lens=[42, 16], token_rows=[0, 0] + [1] * 16),
    dict(meta=DHiSparseMetadata(step=2, requests=[
        RequestStep("a", 48, 2, prompt_len=40, block_ids=([15], [30]), replace_blocks=False,
                    max_tokens=40),
        RequestStep("b", 16, 14, prompt_len=30, block_ids=([], []), replace_blocks=False,
                    max_tokens=10, completes_prefill=True)]),
         tables=([[10, 11, 12, 15], [13, 14, 0, 0]],
                 [[20, 21, 22, 23, 24, 25, 30], [26, 27, 28, 29, 0, 0, 0]]),
         seq_lens=[50, 30], token_rows=[0, 0] + [1] * 14),
]
# per step: each token of "a" selects request-local rows; rows >= committed are this step's
TOPK = [[[0, 3, 9, 10], [5, 9, 10, -1]], [[1, 3, 11, 12], [12, 0, 6, -1]]]


def make_worker(max_spec_queries: int = 2, faults: dict | None = None) -> WS.WorkerSide:
    cfg = DHiSparseConfig(hot_cache_rows=4, host_pool_gib=0.001, tail_pages=1,
                          optional_residency=False, device_window_tokens=0)
    kw = dict(max_model_len=128, max_num_seqs=2, max_spec_queries=max_spec_queries,
              device=torch.device("cpu"))
    w = faulty_worker_side(cfg, LAYERS, faults=faults, **kw) if faults else \
        WS.WorkerSide(cfg, LAYERS, **kw)
    g = torch.Generator().manual_seed(0)
    w.register_kv_caches({
        layer.name: torch.randint(0, 256, (NUM_BLOCKS, layer.rows_per_block * layer.row_bytes),
                                  dtype=torch.uint8, generator=g)
        for layer in LAYERS})
    w.begin_step(PREFILL)
    w.end_step()
    assert w.requests["a"].admitted
    return w


def plan_of(w: WS.WorkerSide, step: int, layer: SparseLayer, seq_lens=None, token_rows=None):
    """The hook's question for ``layer`` in ``step``: vLLM's block table, seq_lens, rows."""
    s = STEPS[step]
    return ctx(w).plan(layer, torch.tensor(s["tables"][layer.group], dtype=torch.int32),
                       torch.tensor(seq_lens or s["seq_lens"], dtype=torch.int32),
                       torch.tensor(token_rows or s["token_rows"]))


def ctx(w: WS.WorkerSide) -> step_context.StepContext:
    """The context the routed layers read: bound by begin_step, the worker's own."""
    bound = step_context.current()
    assert bound is not None and bound is w.context
    return bound


def run_step(w: WS.WorkerSide, step: int, resolves: int = 2) -> None:
    """One scheduled step: bind, the hook's calls for every layer, then end the step."""
    w.begin_step(STEPS[step]["meta"])
    for layer in LAYERS:
        plan = plan_of(w, step, layer)
        assert plan.rows_req == ["a", None] and plan.req_ids == ["a"], (step, layer.name, plan)
        for _ in range(resolves):  # the second call hits the hot cache
            with ctx(w).staging_arena(layer) as arena:
                ctx(w).resolve(layer, plan, torch.tensor(TOPK[step], dtype=torch.int32), arena)
    w.end_step()
    assert step_context.current() is None


def verify_rows_to_requests(w: WS.WorkerSide, step: int, layer: SparseLayer) -> list[str | None]:
    """The hook's answer, checked against a map built now from the requests' state."""
    s = STEPS[step]
    got = plan_of(w, step, layer).rows_req
    tokens_per_block = layer.rows_per_block * layer.compress_ratio
    fresh = fresh_newest_blocks(w.requests.values(), layer.group, tokens_per_block)
    want = [fresh.get(row[(n - 1) // tokens_per_block]) for row, n in zip(s["tables"][layer.group],
                                                                         s["seq_lens"])]
    assert got == want, (step, layer.name, got, want)
    return got


# -- item: one place sums the resolver counters over sources ---------------------------------
def test_collector_totals_equal_summary_totals():
    w = make_worker()
    for step in range(len(STEPS)):
        run_step(w, step)
    per_source = [w.hierarchy.source(layer.name).resolver.totals() for layer in LAYERS]
    for t in per_source:  # every counter is exercised in every source
        assert t.calls and t.direct and t.hot and t.host and t.fetched and t.verify_fetched, t
    assert w.served.fresh_selections > 0
    expected = dict(
        selected_rows_direct=w.served.fresh_selections + sum(t.direct for t in per_source),
        selected_rows_hot=sum(t.hot for t in per_source),
        selected_rows_host=sum(t.host for t in per_source),
        rows_fetched=sum(t.fetched for t in per_source),
        host_to_device_bytes=sum(t.bytes_fetched for t in per_source),
        verify_host_selections=sum(t.verify_host_selections for t in per_source),
        verify_rows_fetched=sum(t.verify_fetched for t in per_source),
        resolve_calls=sum(t.calls for t in per_source),
        state_repairs=sum(t.state_repairs for t in per_source),
        admissions=2, admissions_waited=0)  # "b" after its last prefill chunk
    summary = w.summary()
    counters, gauges = StatsCollector.cumulative(summary)
    assert {k: counters[k] for k in expected} == expected
    t = summary["totals"]  # counted apart by the routed layers, must agree with the census
    assert counters["selected_rows"] == t["selected"] == t["direct"] + t["hot"] + t["host"]
    assert gauges["admitted_requests"] == 2


def test_collector_reads_summary(monkeypatch):
    """The collector does not re-sum: whatever summary() reports is what it exports."""
    w = make_worker()
    run_step(w, 0)
    summary = w.summary

    def shifted():
        s = summary()
        s["totals"] = {k: v + 1000 for k, v in s["totals"].items()}
        return s
    totals = summary()["totals"]
    monkeypatch.setattr(w, "summary", shifted)
    counters = StatsCollector(min_interval_s=0).collect(w).data["counters"]  # first: from 0
    from_totals = {m.key: m.path[1] for m in METRICS if m.kind == "counter"
                   and m.path[0] == "totals"}
    assert len(from_totals) >= 10
    assert {k: counters[k] for k in from_totals} == \
        {k: totals[t] + 1000 for k, t in from_totals.items()}


# -- item: the newest-block map is cached per step -------------------------------------------
def test_newest_block_map_built_once_per_step_and_follows_new_blocks(monkeypatch):
    w = make_worker()
    built = []
    monkeypatch.setattr(R, "newest_blocks", lambda requests, *key:
                        built.append(key) or fresh_newest_blocks(requests, *key))
    for step in range(len(STEPS)):
        w.begin_step(STEPS[step]["meta"])
        for _ in range(3):  # several layers of one group ask in one step
            for layer in LAYERS:
                # step 2: "a"'s newest token moved to blocks 15 / 30; a map kept from
                # step 1 would answer None for it
                assert verify_rows_to_requests(w, step, layer) == ["a", None]
        w.end_step()
    assert built == [(0, 16), (1, 8)] * len(STEPS)


# -- failure isolation and request identity ----------------------------------------------------
@pytest.mark.parametrize("point", ["append", "resolve"])
def test_a_failure_in_per_request_work_fails_that_request_alone(point):
    w = make_worker(faults={point: ("a",)})  # "a" admitted (admission is not a fault here)
    s = STEPS[0]
    w.begin_step(s["meta"])
    for layer in LAYERS:
        plan = plan_of(w, 0, layer)
        if point == "resolve" and plan.any_routed:  # later groups no longer route "a"
            with ctx(w).staging_arena(layer) as arena:
                locs = ctx(w).resolve(layer, plan, torch.tensor(TOPK[0], dtype=torch.int32),
                                      arena)
            assert bool((locs == -1).all())  # the failed request reads no row
    w.end_step()
    assert w.take_failed() == {"a": f"RuntimeError: injected {point} failure"}
    assert "a" not in w.hierarchy.requests and not w.requests["a"].admitted
    w.begin_step(STEPS[1]["meta"])  # the engine goes on: "b" completes its prefill
    w.end_step()
    assert w.requests["b"].admitted and w.summary()["totals"]["failed"] == 1


def test_admission_failure_fails_that_request_alone():
    w = make_worker(faults={"admit": ("b",)})
    for step in range(len(STEPS)):
        run_step(w, step)
    assert set(w.take_failed()) == {"b"} and w.requests["a"].admitted
    assert list(w.hierarchy.requests) == ["a"]


def test_a_batch_row_that_does_not_match_its_request_is_refused():
    w = make_worker()
    w.begin_step(STEPS[0]["meta"])
    # "a" has 42 tokens after this step and 2 of them in the batch
    with pytest.raises(RuntimeError, match="does not match"):
        plan_of(w, 0, LAYERS[0], seq_lens=[43, 16])
    with pytest.raises(RuntimeError, match="does not match"):
        plan_of(w, 0, LAYERS[0], token_rows=[0, 0, 0] + [1] * 16)
    plan = plan_of(w, 0, LAYERS[0])
    assert plan.rows_req == ["a", None] and plan.token_idx.tolist() == [0, 1]
    assert plan.tok_j.tolist() == [0, 1] and not plan.all_routed


def test_a_failing_batched_resolve_is_attributed_to_its_request(monkeypatch):
    """Whatever raises inside the batched resolve: retried one request at a time, the
    request whose resolve raises fails alone and reads no row."""
    w = make_worker()
    original = w.hierarchy.resolve

    def resolve(source, req_ids, selections, *args, **kwargs):
        if "a" in req_ids:
            raise IndexError("bad selection")
        return original(source, req_ids, selections, *args, **kwargs)
    monkeypatch.setattr(w.hierarchy, "resolve", resolve)
    w.begin_step(STEPS[0]["meta"])
    plan = plan_of(w, 0, LAYERS[0])
    with ctx(w).staging_arena(LAYERS[0]) as arena:
        locs = ctx(w).resolve(LAYERS[0], plan, torch.tensor(TOPK[0], dtype=torch.int32), arena)
    assert bool((locs == -1).all())
    assert w.take_failed() == {"a": "IndexError: bad selection"}
    assert "a" not in w.hierarchy.requests


# -- variable K_r in one step ------------------------------------------------------------------
# after STEPS: "a" (50 tokens) verifies an anchor and two drafts, "b" (30 tokens) decodes one
# token; rows >= 12 of "a" and >= 7 of "b" are this step's (computed, not committed)
VARIABLE_K = dict(
    meta=DHiSparseMetadata(step=3, requests=[
        RequestStep("a", 50, 3, prompt_len=40, block_ids=([], []), replace_blocks=False,
                    max_tokens=40),
        RequestStep("b", 30, 1, prompt_len=30, block_ids=([], []), replace_blocks=False,
                    max_tokens=10)]),
    tables=([[10, 11, 12, 15], [13, 14, 0, 0]],
            [[20, 21, 22, 23, 24, 25, 30], [26, 27, 28, 29, 0, 0, 0]]),
    seq_lens=[53, 31], token_rows=[0, 0, 0, 1])
VARIABLE_TOPK = [[2, 4, 9, 11], [2, 4, 11, -1], [4, 12, 2, -1],  # "a": K_r = 3
                 [0, 2, 6, 7]]  # "b": K_r = 1


def test_requests_with_different_query_counts_share_one_resolve():
    """K_r = 3 next to K_r = 1 in one batch (DSpark's confidence scheduling varies it per
    request): one resolve call per layer for both, the short request's missing queries
    are padding; every selection of every query reads its request's own row (committed
    rows through the hierarchy, this step's rows through staging), and a row that
    several of "a"'s queries select is fetched from host once."""
    w = make_worker(max_spec_queries=3)
    for step in range(len(STEPS)):
        run_step(w, step)
    assert w.requests["b"].admitted
    s = VARIABLE_K
    w.begin_step(s["meta"])
    calls = []
    original = w.hierarchy.resolve

    def resolve(source, req_ids, selections, *args, **kwargs):
        calls.append((source, list(req_ids), tuple(selections.shape)))
        return original(source, req_ids, selections, *args, **kwargs)
    w.hierarchy.resolve = resolve
    before = w.summary()["totals"]
    topk = torch.tensor(VARIABLE_TOPK, dtype=torch.int32)
    for layer in LAYERS:
        plan = ctx(w).plan(layer, torch.tensor(s["tables"][layer.group], dtype=torch.int32),
                           torch.tensor(s["seq_lens"], dtype=torch.int32),
                           torch.tensor(s["token_rows"]))
        assert plan.req_ids == ["a", "b"] and plan.num_queries == 3
        assert plan.tok_j.tolist() == [0, 1, 2, 0]
        pool = w.hierarchy.source(layer.name).pool
        with ctx(w).staging_arena(layer) as arena:  # attention reads while the layer holds it
            locs = ctx(w).resolve(layer, plan, topk, arena)
            for t, req in enumerate(["a", "a", "a", "b"]):
                sel = topk[t][topk[t] >= 0]
                got = pool.read(locs[t][topk[t] >= 0])
                want = w.vllm_cache.rows(layer, w.requests[req].block_ids[layer.group], sel)
                assert torch.equal(got, want), (layer.name, req, t)
    assert [c[1:] for c in calls] == [(["a", "b"], (2, 3, 4))] * len(LAYERS)
    after = w.summary()["totals"]
    # "a"'s queries select the host rows 2 and 4 three times each: fetched once
    fetched = after["fetched"] - before["fetched"]
    host = after["host"] - before["host"]
    assert host - fetched == 2 * 2 * len(LAYERS), (host, fetched)  # 2 rows x 2 repeats
    w.end_step()


# -- committed rows: one append_batch per source ------------------------------------------------
def test_committed_rows_are_appended_in_one_batch_per_source(monkeypatch):
    """After STEPS both requests commit rows in one step ("a" 48 -> 56 tokens, "b" 30 ->
    34): one append_batch per source carries both, and the hierarchy's lengths follow."""
    w = make_worker()
    for step in range(len(STEPS)):
        run_step(w, step)
    calls = []
    original = w.hierarchy.append_batch

    def append_batch(source, req_ids, rows, counts=None):
        calls.append((source, list(req_ids), counts))
        return original(source, req_ids, rows, counts)
    monkeypatch.setattr(w.hierarchy, "append_batch", append_batch)
    w.begin_step(DHiSparseMetadata(step=3, requests=[
        RequestStep("a", 56, 1, prompt_len=40, block_ids=([], [31]), replace_blocks=False,
                    max_tokens=40),
        RequestStep("b", 34, 1, prompt_len=30, block_ids=([16], [32]), replace_blocks=False,
                    max_tokens=10)]))
    assert calls == [("l0", ["a", "b"], [2, 1]), ("l1", ["a", "b"], [2, 1])]
    for name in ("l0", "l1"):
        st = w.hierarchy.source(name).state
        assert (st.seq_len("a"), st.seq_len("b")) == (14, 8)
        assert (w.requests["a"].rows[name], w.requests["b"].rows[name]) == (14, 8)
    w.end_step()


@pytest.mark.parametrize("how", ["returned", "raised"])
def test_a_request_whose_append_fails_fails_alone(monkeypatch, how):
    """A failure on the synchronous path of a full tail comes back for its request (the
    others were appended); an exception of the whole call (nothing changed) is retried
    one request at a time.  Either way only that request fails."""
    from vllm_dhisparse.hierarchy.host_store import HostBackupError
    w = make_worker()
    original = w.hierarchy.append_batch
    single = w.hierarchy.append

    def append_batch(source, req_ids, rows, counts=None):
        if how == "raised":
            raise ValueError("one of them is bad")
        failed = original(source, req_ids, rows, counts)
        return {**failed, "a": HostBackupError("backup of a failed")} if "a" in req_ids else failed

    def append(req_id, source, rows):
        if req_id == "a":
            raise HostBackupError("backup of a failed")
        return single(req_id, source, rows)
    monkeypatch.setattr(w.hierarchy, "append_batch", append_batch)
    monkeypatch.setattr(w.hierarchy, "append", append)
    for step in range(len(STEPS)):
        w.begin_step(STEPS[step]["meta"])
        w.end_step()
    assert set(w.take_failed()) == {"a"}
    assert w.requests["b"].admitted and "a" not in w.hierarchy.requests


# -- verification: rows of the step stay out of the hierarchy until accepted -------------------
def prefilled_for_speculation():
    """A worker after STEPS with 1 + 3 queries a step, its hierarchy, and "a"'s committed
    rows per source."""
    w = make_worker(max_spec_queries=4)
    for step in range(len(STEPS)):
        run_step(w, step)
    h = w.hierarchy

    def lengths():
        return [h.source(layer.name).state.seq_len("a") for layer in LAYERS]
    return w, h, lengths


def test_rejected_drafts_never_enter_the_hierarchy_and_accepted_rows_commit_next_step():
    """"a" verifies an anchor and three drafts (tokens 50..53: rows 12 and 13 computed in
    the step, read through the staging arena).  Nothing of the step is appended; vLLM
    accepts one draft (52 tokens computed), so the next step commits row 12 (tokens
    48..51, anchor and accepted draft) read from vLLM's cache, and row 13, which holds a
    rejected draft, stays out until vLLM recomputes its tokens."""
    w, h, lengths = prefilled_for_speculation()
    verify = DHiSparseMetadata(step=3, requests=[
        RequestStep("a", 50, 4, prompt_len=40, block_ids=([], []), replace_blocks=False,
                    max_tokens=40, num_spec_tokens=3)])
    w.begin_step(verify)
    assert lengths() == [12, 12]
    tables = [torch.tensor([[10, 11, 12, 15]], dtype=torch.int32),
              torch.tensor([[20, 21, 22, 23, 24, 25, 30]], dtype=torch.int32)]
    topk = torch.tensor([[0, 12, 13, -1]] * 4, dtype=torch.int32)  # this step's rows 12, 13
    for layer in LAYERS:
        plan = ctx(w).plan(layer, tables[layer.group], torch.tensor([54], dtype=torch.int32),
                           torch.tensor([0, 0, 0, 0]))
        with ctx(w).staging_arena(layer) as arena:
            locs = ctx(w).resolve(layer, plan, topk, arena)
            arena_rows = set(arena.arenas.table[arena.index].flatten().tolist())
            assert set(locs[:, 1:3].flatten().tolist()) <= arena_rows  # read from the arena
    w.end_step()
    assert lengths() == [12, 12]  # nothing computed in the verify step was appended
    w.begin_step(DHiSparseMetadata(step=4, requests=[
        RequestStep("a", 52, 1, prompt_len=40, block_ids=([], []), replace_blocks=False,
                    max_tokens=40)]))
    assert lengths() == [13, 13]  # row 12 committed; row 13 (rejected drafts) not
    truth = {"a": {layer.name: w.vllm_cache.rows(layer, w.requests["a"].block_ids[layer.group],
                                                 torch.arange(13)) for layer in LAYERS}}
    truth["b"] = {layer.name: w.vllm_cache.rows(layer, w.requests["b"].block_ids[layer.group],
                                                torch.arange(h.source(layer.name).state.seq_len("b")))
                  for layer in LAYERS}
    check_invariants(h, truth)  # the hierarchy's rows are vLLM's rows of accepted tokens
    w.end_step()


def test_drafts_an_async_scheduler_counts_before_their_verification_are_not_committed():
    """vLLM's asynchronous scheduler schedules the next step before the verify step's output
    arrives: it counts all three drafts (54 tokens computed) and says three are unverified.
    If vLLM then rejects them all, token 51 of row 12 is a rejected draft, so only rows
    0..11 may be committed; once the output has arrived, the next step's anchor (at 51)
    completes row 12, which commits then."""
    w, h, lengths = prefilled_for_speculation()

    def step(n, computed, scheduled, spec=0, unverified=0):
        w.begin_step(DHiSparseMetadata(step=n, requests=[
            RequestStep("a", computed, scheduled, prompt_len=40, block_ids=([], []),
                        replace_blocks=False, max_tokens=40, num_spec_tokens=spec,
                        num_unverified_tokens=unverified)]))
    step(3, 50, 4, spec=3)
    w.end_step()
    step(4, 54, 4, spec=3, unverified=3)
    assert lengths() == [12, 12]
    w.end_step()
    # step 3's output arrived (all rejected: 51) while step 4 (anchor at 51 + 3 drafts)
    # is in flight: 55 counted, 3 unverified
    step(5, 55, 4, spec=3, unverified=3)
    assert lengths() == [13, 13]
    truth = {rid: {layer.name: w.vllm_cache.rows(
        layer, w.requests[rid].block_ids[layer.group],
        torch.arange(h.source(layer.name).state.seq_len(rid))) for layer in LAYERS}
        for rid in ("a", "b")}
    check_invariants(h, truth)  # the hierarchy's rows are vLLM's rows of verified tokens
    w.end_step()


# -- item: on CUDA, a step vLLM classes as a decode is served from the hierarchy -------------
class TableRecorder:
    """Stands in for the routed decode's tables (decode_binding.py): what the worker
    asks it to route, before each forward."""

    def __init__(self):
        self.calls = []
        self.lost = set()  # requests the next take_counters names
        self.selected = self.fresh = 0  # what the device counted in the next forward

    def write_tables(self, decoding):
        self.calls.append({req.req_id: tokens for req, tokens in decoding})

    def take_counters(self):
        lost, self.lost = self.lost, set()
        got = dict(selected=self.selected, fresh_selections=self.fresh,
                   fresh_rows_lost=len(lost), unrouted_tokens=0, lost_requests=lost)
        self.selected = self.fresh = 0
        return got


@pytest.mark.parametrize("routed", [False, True], ids=["cpu", "cuda"])
def test_short_chunks_and_prefix_hits_are_admitted_before_the_forward_on_cuda(routed):
    """vLLM's V4 attention serves a step of <= 1 + speculative tokens as a decode; the
    routed FlashMLA decode reads c4a rows only of admitted requests, so on CUDA such a
    step admits the request first: a full prefix hit ("c": 29 of 30 tokens cached) and a
    one-token chunk in the middle of a prompt ("d"), which then goes on with a long
    chunk (a prefill: upstream) and commits its rows.  On CPU both wait for their
    prefill to complete."""
    w = make_worker()
    rec = TableRecorder()
    if routed:
        w.decode = CudaDecode(rec)
    w.begin_step(DHiSparseMetadata(step=1, finished={"a"}, requests=[
        RequestStep("c", 29, 1, prompt_len=30, block_ids=([13, 14], [26, 27, 28, 29]),
                    replace_blocks=True, max_tokens=10, completes_prefill=True),
        RequestStep("d", 0, 1, prompt_len=40, block_ids=([15, 16, 17], [30, 31, 32, 33, 34]),
                    replace_blocks=True, max_tokens=10)]))
    c, d = w.requests["c"], w.requests["d"]
    assert (c.admitted, d.admitted) == (routed, routed)
    if routed:
        assert rec.calls == [{"c": 30, "d": 1}]
        assert c.rows == {"l0": 7, "l1": 7} and d.rows == {"l0": 0, "l1": 0}
    w.end_step()
    assert c.admitted and d.admitted == routed  # c's prefill completed: admitted either way
    w.begin_step(DHiSparseMetadata(step=2, requests=[
        RequestStep("c", 30, 1, prompt_len=30, block_ids=([], []), replace_blocks=False,
                    max_tokens=10),
        RequestStep("d", 1, 30, prompt_len=40, block_ids=([], []), replace_blocks=False,
                    max_tokens=10)]))
    assert not d.failed, d.failed  # a long chunk after an early admission is a prefill
    if routed:
        assert rec.calls[-1] == {"c": 31}  # d's 30 tokens are not a decode
    w.end_step()
    w.begin_step(DHiSparseMetadata(step=3, requests=[
        RequestStep("d", 31, 9, prompt_len=40, block_ids=([], []), replace_blocks=False,
                    max_tokens=10, completes_prefill=True)]))
    assert d.admitted == routed and d.rows.get("l0", 0) == (7 if routed else 0)
    w.end_step()
    assert d.admitted and not w.take_failed()
    check_invariants(w.hierarchy)


def test_a_request_whose_step_rows_were_lost_fails_alone():
    w = make_worker()
    w.decode = CudaDecode(rec := TableRecorder())
    w.begin_step(STEPS[0]["meta"])
    rec.lost = {"a"}  # the routed decode could not stage a's rows of this step
    w.end_step()
    assert set(w.take_failed()) == {"a"} and "a" not in w.hierarchy.requests
    w.begin_step(STEPS[1]["meta"])  # the engine goes on: "b" completes its prefill
    w.end_step()
    assert w.requests["b"].admitted and not w.take_failed()


def test_on_cuda_a_decode_step_without_room_fails_that_request_alone():
    """Two request slots: "a" holds one, the prefix hit "c" takes the other, the short
    chunk "d" finds none: on CUDA it is failed before the forward and never routed."""
    w = make_worker()
    w.decode = CudaDecode(rec := TableRecorder())
    w.begin_step(DHiSparseMetadata(step=1, requests=[
        RequestStep("a", 40, 1, prompt_len=40, block_ids=([], []), replace_blocks=False,
                    max_tokens=40),
        RequestStep("c", 29, 1, prompt_len=30, block_ids=([13, 14], [26, 27, 28, 29]),
                    replace_blocks=True, max_tokens=10, completes_prefill=True),
        RequestStep("d", 0, 1, prompt_len=40, block_ids=([15, 16, 17], [30, 31, 32, 33, 34]),
                    replace_blocks=True, max_tokens=10)]))
    assert rec.calls == [{"a": 41, "c": 30}]
    assert w.requests["a"].admitted and w.requests["c"].admitted
    assert "no room in the hierarchy" in (w.requests["d"].failed or "")
    w.end_step()
    assert set(w.take_failed()) == {"d"}
    check_invariants(w.hierarchy)


def test_on_cuda_the_census_counts_what_the_graph_captured_decode_selected():
    """The routed FlashMLA decode counts its selections on the device (no Python runs in a
    replayed graph); after the forward they reach the totals the metrics read."""
    w = make_worker()
    w.decode = CudaDecode(rec := TableRecorder())
    before = w.summary()["totals"]
    w.begin_step(STEPS[0]["meta"])
    rec.selected, rec.fresh = 40, 3
    w.end_step()
    after = w.summary()["totals"]
    assert after["selected"] - before["selected"] == 40
    assert after["direct"] - before["direct"] == 3


def test_location_faults_reach_the_routed_decode_on_cuda():
    """The needle benchmark's control on the GPU: the fault injector's scramble moves every
    location the routed FlashMLA decode computes (padding stays -1), nothing else."""
    from types import SimpleNamespace
    from tests.fault_injection import FaultyWorkerSide
    got = torch.tensor([[0, 5, 7, -1], [3, -1, -1, -1]], dtype=torch.int32)
    lens = torch.tensor([3, 1], dtype=torch.int32)
    routed = SimpleNamespace(locations=lambda *a: (got.clone(), lens))
    w = faulty_worker_side(DHiSparseConfig(hot_cache_rows=4, host_pool_gib=0.001),
                           LAYERS, faults={"scramble": ("",)}, max_model_len=128,
                           max_num_seqs=2, max_spec_queries=1, device=torch.device("cpu"))
    assert isinstance(w, FaultyWorkerSide)
    w.decode = SimpleNamespace(binding=SimpleNamespace(routed={"l0": routed}))
    w.register_kv_caches({layer.name: torch.zeros(NUM_BLOCKS, layer.rows_per_block
                                                   * layer.row_bytes, dtype=torch.uint8)
                          for layer in LAYERS})
    locs, out_lens = routed.locations()
    valid = got >= 0
    assert torch.equal(out_lens, lens) and torch.equal(locs[~valid], got[~valid])
    assert torch.equal(locs[valid], (got[valid] + 4) % 8)  # half the used rows away


def test_the_counters_go_out_when_the_engine_goes_idle():
    """On CUDA collections are spaced by stats_interval_s, and only a step carries one: the
    step vLLM runs only to report the last finished requests collects whatever the
    interval held back (else a burst's last second reaches /metrics with the next
    request); a step that still serves requests waits for the interval."""
    w = make_worker()
    w.stats_collector = StatsCollector(min_interval_s=3600)
    assert w.get_kv_connector_stats() is not None  # the first collection
    run_step(w, 0)
    assert w.get_kv_connector_stats() is None  # within the interval
    selected = w.summary()["totals"]["selected"]
    w.begin_step(DHiSparseMetadata(step=2, requests=[STEPS[1]["meta"].requests[1]],
                                   finished={"a"}))  # "b" still runs: no flush
    w.end_step()
    assert w.get_kv_connector_stats() is None
    w.begin_step(DHiSparseMetadata(step=3, requests=[], finished={"b"}))
    w.end_step()
    stats = w.get_kv_connector_stats()
    assert stats is not None and stats.data["counters"]["selected_rows"] == selected > 0
    assert stats.data["gauges"]["admitted_requests"] == 0
    assert w.get_kv_connector_stats() is None  # back to the interval
