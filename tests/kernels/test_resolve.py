"""Triton ``resolve`` against ``resolve_reference``: every output, every state tensor,
bit for bit, over call sequences; then the bytes at every returned location
(after ``gather_rows``) against the ground-truth rows.

Without a GPU the kernel runs in Triton's interpreter (conftest), so shapes stay small.
"""
import importlib

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_dhisparse.triton_kernels import resolve
from vllm_dhisparse.triton_kernels.reference import (COUNTER_DIRECT, COUNTER_FETCHED, COUNTER_HOST,
                                                     COUNTER_HOT, COUNTER_INVALID, NUM_COUNTERS)

from resolve_world import DEVICE, STATE_NAMES, World, assert_same, draw_world  # noqa: E402


def test_cold_cache_all_miss():
    w = World(hot_cache_rows=32, width=16)
    sel = w.selections([1, 2], 2, 8, pad=0.0, dup=0.0)
    locations, _, _, miss_count, counters = w.call(sel, [1, 2])
    assert (counters[:, COUNTER_HOST] == 16).all() and (counters[:, COUNTER_HOT] == 0).all()
    assert torch.equal(counters[:, COUNTER_FETCHED], miss_count)


def test_all_hit_after_warmup():
    w = World(hot_cache_rows=16, width=8)
    sel = w.selections([0, 3], 2, 4, pad=0.0)
    w.call(sel, [0, 3], context="warm-up")
    _, _, _, miss_count, counters = w.call(sel.flip(-1), [0, 3], context="all hit")
    assert (miss_count == 0).all()
    assert torch.equal(counters[:, COUNTER_HOT], (sel >= 0).flatten(1).sum(1).int())


def test_duplicates_within_and_across_queries():
    w = World(hot_cache_rows=16, width=12, positions=40)
    sel = w.selections([2, 1], 3, 4, dup=0.7, hi=10)
    _, _, _, miss_count, counters = w.call(sel, [2, 1])
    assert (counters[:, COUNTER_HOST] > miss_count).any(), "test needs shared misses"


def test_padding_including_whole_query_and_whole_row():
    w = World(hot_cache_rows=8, width=12, batch=3)
    sel = w.selections([0, 1, 2], 3, 4, pad=0.4, pad_query=True)
    sel[2] = -1
    locations, _, _, miss_count, counters = w.call(sel, [0, 1, 2])
    assert int(miss_count[2]) == 0 and (counters[2] == 0).all()
    assert (locations[2] == -1).all()


def test_union_larger_than_hot_cache_overflows_to_staging():
    w = World(hot_cache_rows=4, width=16, positions=64, staging_extra=3)
    sel = w.selections([0, 1], 2, 8, pad=0.0, dup=0.0)
    _, _, miss_dst, miss_count, _ = w.call(sel, [0, 1])
    assert (miss_count > 4).all()
    for n in range(2):
        assert torch.equal(miss_dst[n, 4:int(miss_count[n])],
                           w.staging_rows[n, :int(miss_count[n]) - 4])


def test_zero_budget_everything_stages():
    w = World(hot_cache_rows=0, width=8)
    w.call(w.selections([0, 1], 2, 4), [0, 1])
    w.call(w.selections([0, 1], 2, 4), [0, 1])


def test_budget_equals_top_k():
    w = World(hot_cache_rows=8, width=16, positions=32, staging_extra=0)
    for step in range(3):
        w.call(w.selections([3, 0], 2, 8, dup=0.1), [3, 0], context=f"step {step}")


def test_request_shorter_than_top_k():
    w = World(hot_cache_rows=16, width=16, positions=48, lengths=[5, 48, 3, 48])
    for step in range(2):
        sel = w.selections([0, 2], 2, 8, pad=0.0)
        sel[0, :, 5:] = -1
        sel[1, :, 3:] = -1
        sel[0, :, :5] = torch.arange(5, dtype=torch.int32)
        w.call(sel, [0, 2], context=f"step {step}")


def test_sequence_lru_evolves():
    """Many calls on the same state: hits protect hot slots, fills evict the least recent."""
    w = World(hot_cache_rows=12, width=8, positions=40, req_slots=3, batch=2)
    for step in range(8):
        req_slots = [[0, 1], [1, 2], [2, 0]][step % 3]
        sel = w.selections(req_slots, 2, 4, hi=20 if step % 2 else None)
        w.call(sel, req_slots, context=f"step {step}")


def test_mixed_direct_hot_host_with_growing_direct_coverage():
    w = World(hot_cache_rows=10, width=12, positions=48, page_size=4, req_slots=3, batch=3)
    w.make_direct(0, [11])  # tail page
    w.make_direct(1, [0, 5, 11])
    w.warm(2, [3, 7, 8, 20, 41])
    counts = torch.zeros(NUM_COUNTERS, dtype=torch.int64)
    for step in range(5):
        sel = w.selections([2, 0, 1], 3, 4)
        _, _, _, _, counters = w.call(sel, [2, 0, 1], context=f"step {step}")
        counts += counters.sum(0).cpu()
        w.make_direct(step % 3, [step, step + 6])  # optional history becomes ready
    assert (counts[[COUNTER_DIRECT, COUNTER_HOT, COUNTER_HOST]] > 0).all(), counts


@pytest.mark.parametrize("row_bytes", [1, 37, 584, 656])
def test_row_widths(row_bytes):
    w = World(hot_cache_rows=6, width=8, row_bytes=row_bytes, positions=24)
    w.make_direct(1, [5])
    for step in range(2):
        w.call(w.selections([1, 0], 2, 4), [1, 0], context=f"step {step}")


def test_batch_slots_are_a_permutation():
    w = World(req_slots=5, hot_cache_rows=6, width=8, batch=5, positions=30)
    w.make_direct(3, [7])
    for step, perm in enumerate(([4, 2, 0, 3, 1], [0, 1, 2, 3, 4], [1, 3, 4, 0, 2])):
        w.call(w.selections(perm, 2, 4), perm, context=f"step {step}")


def test_subset_of_slots_leaves_others_untouched():
    w = World(req_slots=4, hot_cache_rows=6, width=8, batch=1)
    w.warm(2, [1, 2, 3])
    before = [t.clone() for t in w.state()]
    w.call(w.selections([0], 2, 4), [0])
    for name, a, b in zip(STATE_NAMES, w.state(), before):
        assert_same(name + " of other request slots", a[1:], b[1:])


def test_empty_batch_and_empty_queries():
    w = World(batch=1)
    out = w.call(torch.empty(0, 2, 4, dtype=torch.int32, device=DEVICE), [], check_bytes=False)
    assert all(t.shape[0] == 0 for t in out)
    w.call(torch.empty(1, 0, 4, dtype=torch.int32, device=DEVICE), [1], check_bytes=False)


@pytest.mark.parametrize("seed", range(6))
def test_random_sequences(seed):
    g = torch.Generator().manual_seed(100 + seed)
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g))  # noqa: E731
    queries, top_k, n_req_slots = r(1, 3), r(1, 9), r(2, 5)
    batch = r(1, n_req_slots)
    w = World(req_slots=n_req_slots, hot_cache_rows=r(0, 14), positions=r(8, 60), page_size=r(1, 8),
              row_bytes=r(1, 24), batch=batch, width=queries * top_k, staging_extra=r(0, 2),
              seed=seed)
    for s in range(n_req_slots):
        n_pages = w.page_table.shape[1]
        w.make_direct(s, torch.randperm(n_pages, generator=g)[:r(0, n_pages // 2)].tolist())
    for step in range(3):
        req_slots = torch.randperm(n_req_slots, generator=g)[:batch].tolist()
        sel = w.selections(req_slots, queries, top_k, pad=0.3 * (step == 1), dup=0.3)
        w.call(sel, req_slots, context=f"seed {seed} step {step}")


def test_misses_in_ascending_position_order():
    """Distinct misses are numbered by position (host-address order), whatever the
    selection order; later duplicates share the rank."""
    w = World(hot_cache_rows=8, width=8, positions=40, batch=1)
    sel = torch.tensor([[[30, 5, -1, 17], [5, 2, 30, 39]]], dtype=torch.int32, device=DEVICE)
    _, miss_src, _, miss_count, _ = w.call(sel, [0])
    base = int(w.host_base[0])
    assert int(miss_count[0]) == 5
    assert (miss_src[0, :5] - base).tolist() == [2, 5, 17, 30, 39]


@pytest.mark.parametrize("n_distinct,queries,sort_mid", [(200, 2, 0), (300, 2, 0),
                                                       (300, 4, 512), (600, 4, 512)])
def test_miss_sort_buckets(n_distinct, queries, sort_mid, monkeypatch):
    """The distinct-miss sort takes 256 keys when the count allows, then the middle size
    (``_SORT_MID``) when it is between 256 and next_pow2(K*k) and holds them, else
    next_pow2(K*k) (the 2048-key bucket needs K*k > 2048: covered on CUDA by
    benchmarks/gpu_correctness.py's K=8, k=2048 configurations)."""
    resolve_module = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    monkeypatch.setattr(resolve_module, "_SORT_MID", sort_mid)
    width = queries * 256
    w = World(hot_cache_rows=64, width=width, positions=1000, batch=1, req_slots=1, page_size=64)
    g = torch.Generator().manual_seed(n_distinct)
    rows = torch.randperm(1000, generator=g)[:n_distinct]
    sel = rows[torch.randint(0, n_distinct, (width,), generator=g)]
    sel[:n_distinct] = rows  # every row at least once
    sel = sel[torch.randperm(width, generator=g)].view(1, queries, 256).int().to(DEVICE)
    w.call(sel, [0], check_bytes=False)


def test_one_block_and_chunked_lru_paths(monkeypatch):
    """B above the one-block limit: phase 3 walks the stamps in chunks (victim ranks
    and ties carried across chunks)."""
    resolve_module = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    monkeypatch.setattr(resolve_module, "_ONE_BLOCK_B", 2)
    monkeypatch.setattr(resolve_module, "_BLOCK_B", 4)
    monkeypatch.setattr(resolve_module, "_BLOCK_W", 4)
    w = World(hot_cache_rows=10, width=12, positions=40, req_slots=3, batch=2)
    w.make_direct(2, [3])
    w.warm(0, [1, 2, 3, 4])
    for step in range(3):
        w.call(w.selections([2, 0], 3, 4, dup=0.3), [2, 0], context=f"step {step}")


@pytest.mark.parametrize("copy", [True, False])
def test_resolve_copies_its_misses(copy):
    """host_rows/device_rows given: fused copy (or the gather launch) = gather_rows."""
    w = World(hot_cache_rows=10, width=12, positions=40, req_slots=3, batch=2, row_bytes=40)
    w.make_direct(2, [3])
    w.warm(0, [1, 2, 3, 4])
    for step in range(3):
        w.call(w.selections([2, 0], 3, 4, dup=0.3), [2, 0], context=f"step {step}", copy=copy)


def _layout(resolve_module, layout, monkeypatch):
    """Forces the kernel's path on small shapes: one block, B walked in chunks by a
    one-wave launch, or more programs than SMs."""
    if layout == "chunked":
        monkeypatch.setattr(resolve_module, "_ONE_BLOCK_B", 2)
        monkeypatch.setattr(resolve_module, "_BLOCK_B", 4)
    elif layout == "many_programs":
        monkeypatch.setattr(resolve_module, "_sm_count", lambda dev: 1)
        monkeypatch.setattr(resolve_module, "_MANY_BLOCK_B", 4)
        monkeypatch.setattr(resolve_module, "_MANY_BLOCK_W", 4)


@pytest.mark.parametrize("layout", ["one_block", "chunked", "many_programs"])
@pytest.mark.parametrize("early, step", [(0, 8), (4, 8), (16, 4), (2048, 4096)])
def test_fused_copy_reads_early_words(layout, early, step, monkeypatch):
    """Every path reads the first ``early`` words of its misses from host before the
    victim select and stores them after it, the rest in steps: the same bytes as
    gather_rows whether the early words cover none, part or all of the misses, with
    misses that fill hot slots and misses that overflow to staging rows."""
    resolve_module = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    monkeypatch.setattr(resolve_module, "_EARLY_ELEMS", early)
    monkeypatch.setattr(resolve_module, "_EARLY_ELEMS_CHUNKED", early)
    monkeypatch.setattr(resolve_module, "_COPY_ELEMS", step)
    monkeypatch.setattr(resolve_module, "_COPY_ELEMS_CHUNKED", step)
    _layout(resolve_module, layout, monkeypatch)
    w = World(hot_cache_rows=6, width=16, positions=64, req_slots=3, batch=2, row_bytes=24, staging_extra=2)
    w.warm(0, [1, 2, 3])
    for i in range(3):
        w.call(w.selections([0, 2], 2, 8, dup=0.2), [0, 2], context=f"step {i}", copy=True)


@pytest.mark.parametrize("layout, early, fused", [("one_block", 4, True), ("one_block", 2048, True),
                                                  ("many_programs", 0, True),
                                                  ("many_programs", 4, True),
                                                  ("one_block", 0, False)])
def test_rows_in_two_byte_planes(layout, early, fused, monkeypatch):
    """Rows stored as two byte planes (as DeepSeek-V4's 576 + 8): the resolve launch
    copies into both (fused, early words included) or gathers each plane; the planes
    read together equal the host rows."""
    resolve_module = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    monkeypatch.setattr(resolve_module, "_EARLY_ELEMS", early)
    monkeypatch.setattr(resolve_module, "_EARLY_ELEMS_CHUNKED", early)
    monkeypatch.setattr(resolve_module, "_COPY_ELEMS", 8)
    monkeypatch.setattr(resolve_module, "_COPY_ELEMS_CHUNKED", 8)
    _layout(resolve_module, layout, monkeypatch)
    w = World(hot_cache_rows=6, width=12, positions=40, req_slots=3, batch=2, row_bytes=24, staging_extra=2)
    storage = torch.zeros(w.n_dev_rows * 24, dtype=torch.uint8, device=DEVICE)
    # 12 + 12 bytes: 4-byte words, three in each plane
    planes = [storage[:w.n_dev_rows * 12].view(-1, 12), storage[w.n_dev_rows * 12:].view(-1, 12)]
    w.warm(0, [1, 2, 3])
    for p, (a, b) in zip(planes, [(0, 12), (12, 24)]):
        p.copy_(w.device_rows[:, a:b])
    for step in range(3):
        sel = w.selections([0, 2], 2, 6, dup=0.2)
        st = [t.clone() for t in w.state()]
        got = resolve(sel, torch.tensor([0, 2], dtype=torch.int32, device=DEVICE), w.page_table,
                      w.page_size, w.hot_pos, w.hot_loc, w.hot_stamp, w.hot_clock,
                      w.hot_slot_of, w.staging_rows, w.host_base, host_rows=w.host_rows,
                      device_rows=planes, fused_copy=fused)
        for t, old in zip(w.state(), st):  # replay the call on World's own rows as the oracle
            t.copy_(old)
        want = w.call(sel, [0, 2], copy=True, context=f"step {step}")
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert torch.equal(torch.cat(planes, 1), w.device_rows), f"step {step}"


@pytest.mark.parametrize("many", [False, True])
def test_selections_past_the_length_read_nothing(many, monkeypatch):
    """With the requests' lengths, a selection at or past its request's length (or below -1)
    is padding: location -1, no host read, no hot-cache change, counted as invalid; the
    same calls without the lengths resolve them (they are inside P).  A corrupt length
    only moves the bound within [0, P]."""
    resolve_module = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    _layout(resolve_module, "many_programs" if many else "one_block", monkeypatch)
    w = World(hot_cache_rows=6, width=12, positions=40, req_slots=3, batch=2, lengths=[40, 17, 9])
    w.make_direct(1, [0])
    w.warm(2, [1, 2])
    sel = w.selections([1, 2], 2, 6, pad=0.1, dup=0.2)
    sel[0, 0, 0] = -5
    sel[0, 1, :3] = torch.tensor([17, 39, 16], dtype=torch.int32)  # 16 is the last written
    sel[1, 1, :3] = torch.tensor([9, 30, 12], dtype=torch.int32)
    got = w.call(sel, [1, 2], lens=True, copy=True)
    counters = got[4]
    for n, (s, length) in enumerate([(1, 17), (2, 9)]):
        bad = (sel[n] < -1) | (sel[n] >= length)
        assert int(counters[n, COUNTER_INVALID]) == int(bad.sum()) > 0
        assert bool((got[0][n][bad] == -1).all())
    w.seq_lens[1] = -3  # corrupt: nothing of request slot 1 is readable
    w.seq_lens[2] = 1000  # corrupt: the bound stays P
    again = w.call(sel, [1, 2], lens=True, copy=True)
    assert int(again[4][0, COUNTER_INVALID]) == int((sel[0] != -1).sum())
    assert int(again[4][1, COUNTER_INVALID]) == int((sel[1] < -1).sum())


def test_many_programs_path(monkeypatch):
    """More programs than SMs: chunked B and W (two CTAs per SM), fused copy."""
    resolve_module = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    _layout(resolve_module, "many_programs", monkeypatch)
    w = World(hot_cache_rows=10, width=12, positions=40, req_slots=3, batch=2)
    w.make_direct(2, [3])
    w.warm(0, [1, 2, 3, 4])
    for step in range(3):
        w.call(w.selections([2, 0], 3, 4, dup=0.3), [2, 0], context=f"step {step}", copy=True)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hypothesis_adversarial(data):
    """Small universes where collisions between hits, misses and padding are frequent."""
    w, queries, top_k = draw_world(data, req_slots=2)
    positions = w.P
    w.make_direct(1, data.draw(st.lists(st.integers(0, w.page_table.shape[1] - 1), max_size=2)))
    for step in range(data.draw(st.integers(1, 3), label="calls")):
        rows = data.draw(st.lists(st.integers(-1, positions - 1), min_size=2 * queries * top_k,
                                  max_size=2 * queries * top_k), label=f"selections {step}")
        sel = torch.tensor(rows, dtype=torch.int32, device=DEVICE).view(2, queries, top_k)
        req_slots = data.draw(st.permutations([0, 1]), label=f"request slots {step}")
        w.call(sel, req_slots, context=f"step {step}")


# --- bad input -------------------------------------------------------------------------

def _good_args(w, n=2, queries=2, top_k=4):
    sel = w.selections(list(range(n)), queries, top_k)
    return dict(selections=sel, req_slots=torch.arange(n, dtype=torch.int32, device=DEVICE),
                page_table=w.page_table, page_size=w.page_size, hot_pos=w.hot_pos,
                hot_loc=w.hot_loc, hot_stamp=w.hot_stamp, hot_clock=w.hot_clock,
                hot_slot_of=w.hot_slot_of,
                staging_rows=w.staging_rows, host_base=w.host_base, num_device_rows=w.n_dev_rows)


@pytest.mark.parametrize("name,bad,needle", [
    ("selections", lambda a: a["selections"].long(), "int32"),
    ("selections", lambda a: a["selections"][0], r"\[N, K, k\]"),
    ("selections", lambda a: a["selections"].transpose(1, 2), "contiguous"),
    ("req_slots", lambda a: a["req_slots"].long(), "int32"),
    ("req_slots", lambda a: a["req_slots"][:1], r"shape \[2\]"),
    ("page_table", lambda a: a["page_table"].long(), "int32"),
    ("page_table", lambda a: a["page_table"][:1], "shape"),
    ("page_size", lambda a: 0, "positive int"),
    ("page_size", lambda a: 4.0, "positive int"),
    ("hot_pos", lambda a: a["hot_pos"].float(), "int32"),
    ("hot_loc", lambda a: a["hot_loc"][:, :-1], "shape"),
    ("hot_stamp", lambda a: a["hot_stamp"].to(torch.int16), "int32"),
    ("hot_clock", lambda a: a["hot_clock"][:, None], "shape"),
    ("hot_slot_of", lambda a: a["hot_slot_of"][:-1], "shape"),
    ("hot_slot_of", lambda a: a["hot_slot_of"].t(), "shape|contiguous"),
    ("staging_rows", lambda a: a["staging_rows"][:, :3], ">= K\\*k - B"),
    ("staging_rows", lambda a: a["staging_rows"][:1], ">= N = 2 rows"),
    ("host_base", lambda a: a["host_base"].int(), "int64"),
    ("host_base", lambda a: a["host_base"].to("meta"), "device|meta"),
    ("hot_pos", lambda a: a["hot_pos"].to("meta"), "device|meta"),
])
def test_bad_input_names_the_argument(name, bad, needle):
    w = World(hot_cache_rows=4, width=8, staging_extra=0)
    args = _good_args(w)
    args[name] = bad(args)
    with pytest.raises(ValueError, match=needle) as e:
        resolve(**args)
    assert name in str(e.value)


def test_cpu_tensors_need_interpreter(monkeypatch):
    w = World(hot_cache_rows=4, width=8)
    args = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in _good_args(w).items()}
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="selections.*CUDA"):
        resolve(**args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_mismatched_devices_cuda():
    w = World(hot_cache_rows=4, width=8)
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in _good_args(w).items()}
    args["hot_stamp"] = args["hot_stamp"].cpu()
    with pytest.raises(ValueError, match="hot_stamp"):
        resolve(**args)


def test_many_programs_warm_slots(monkeypatch):
    """More programs than SMs, hot rows warmed first: chunked victim pass with hits."""
    resolve_module = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    _layout(resolve_module, "many_programs", monkeypatch)
    w = World(hot_cache_rows=10, width=12, positions=40, req_slots=3, batch=2)
    w.warm(1, [5, 6, 7])
    for step in range(3):
        w.call(w.selections([1, 0], 3, 4, dup=0.3), [1, 0], context=f"step {step}", copy=True)


@pytest.mark.parametrize("many", [False, True])
def test_distinct_misses_get_locations_from_their_owner(many, monkeypatch):
    """No missing row selected twice: phase 4 is skipped, each owner gets its hot row
    (fills) or staging row (overflow: 20 distinct misses, 6 free hot slots) directly."""
    resolve_module = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    if many:
        monkeypatch.setattr(resolve_module, "_sm_count", lambda dev: 1)
    w = World(hot_cache_rows=8, width=24, positions=200, req_slots=2, batch=2, page_size=8)
    w.warm(0, [3, 4])
    w.make_direct(1, [0])
    g = torch.Generator().manual_seed(3)
    sel = torch.stack([torch.cat([torch.tensor([3, 4]), 10 + torch.randperm(150, generator=g)[:22]]),
                       torch.cat([torch.arange(4), 20 + torch.randperm(150, generator=g)[:20]])])
    sel = sel[:, torch.randperm(24, generator=g)].view(2, 2, 12).int().to(DEVICE)
    w.call(sel, [0, 1], copy=True)
    w.call(sel.flip(0), [1, 0], copy=False)


def _wrap32(x):
    return (x + 2**31) % 2**32 - 2**31


# ages (c - stamp) of the 12 hot slots, c = this call's stamp: one to four radix passes,
# ties at 301 and 2**24 + 6, the two largest ages a wrapped clock can express
AGES = [2, 2, 4, 301, 301, 70001, 2**24 + 6, 2**24 + 6, 2**31, 2**32 - 1, 8, 3]


@pytest.mark.parametrize("layout", ["one_block", "chunked", "many_programs"])
@pytest.mark.parametrize("clock", [25, 2**31 - 1, -2**31], ids=["clock25", "wraps", "int32_min"])
@pytest.mark.parametrize("misses,hit,victims", [
    (3, False, [6, 8, 9]),  # the tie at 2**24 + 6 goes to the lower hot slot
    (5, False, [5, 6, 7, 8, 9]),
    (6, False, [3, 5, 6, 7, 8, 9]),
    (3, True, [6, 7, 8]),  # hot slot 9 (the oldest) is hit by the same call: protected
    (12, False, list(range(12))),  # every hot slot
])
def test_victims_are_the_oldest_slots_in_slot_order(layout, clock, misses, hit, victims,
                                                    monkeypatch):
    """The spec's victim rule, spelled out (the reference) and matched by the kernel:
    the n_fill largest ages (c - stamp) mod 2**32 among hot slots the call does not hit,
    ties to the lower hot slot, the i-th miss (ascending row) to the i-th victim in
    hot-slot order; every hot slot used is stamped c, the clock becomes c (wrapping)."""
    mod = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    _layout(mod, layout, monkeypatch)
    w = World(hot_cache_rows=12, width=16, positions=60, req_slots=2, batch=2, staging_extra=4)
    w.warm(0, list(range(12)))  # hot slot b holds row b
    c = _wrap32(clock + 1)
    w.hot_clock[0] = clock
    w.hot_stamp[0] = torch.tensor([_wrap32(c - a) for a in AGES], dtype=torch.int32)
    rows = list(range(40, 40 + misses)) + ([9] if hit else [])
    sel = torch.full((2, 1, 16), -1, dtype=torch.int32)
    sel[0, 0, :len(rows)] = torch.tensor(rows[::-1], dtype=torch.int32)
    idle_clock = int(w.hot_clock[1])
    out = w.call(sel.to(DEVICE), [0, 1])
    assert w.hot_pos[0, victims].tolist() == list(range(40, 40 + misses))
    assert int(out[4][0, COUNTER_FETCHED]) == misses
    used = victims + ([9] if hit else [])
    assert set(w.hot_stamp[0].eq(c).nonzero().flatten().tolist()) == set(used)
    assert int(w.hot_clock[0]) == c
    assert int(w.hot_clock[1]) == idle_clock  # an all-padding row takes no stamp
