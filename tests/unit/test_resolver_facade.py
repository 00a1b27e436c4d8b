"""Resolver façade through KVHierarchy.resolve: input validation and exactness (eq. 6, 12)."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_dhisparse.triton_kernels.reference import (COUNTER_DIRECT, COUNTER_FETCHED, COUNTER_HOST,
                                                     COUNTER_HOT, COUNTER_INVALID)
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.invariants import check_invariants

PS, W, B = 3, 5, 4


def rows(n, seed):
    return torch.randint(0, 256, (n, W), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def setup():
    """r_dev: all history on device; r_host: history reclaimed to host (tail holds the last row)."""
    spec = dict(name="s", row_bytes=W, page_size=PS, device_pages=8, host_rows=200, hot_cache_rows=B,
                tail_pages=1, max_req_slots=4, max_rows=30)
    h = KVHierarchy([spec], staging=dict(arenas=1, columns=8))  # required: 2 hot + 1 tail
    truth = {"r_host": {"s": rows(13, 1)}, "r_dev": {"s": rows(7, 2)}}
    assert h.admit("r_host", 30, {"s": truth["r_host"]["s"]})  # 4 optional -> 1 free
    assert h.admit("r_dev", 30, {"s": truth["r_dev"]["s"]})  # Δ = 2: r_host reclaimed; r_dev keeps 2
    assert h.sources["s"].residency.requests["r_host"].optional == {}
    check_invariants(h, truth)
    return h, truth


def sel(*queries):
    return torch.tensor([list(queries)], dtype=torch.int32)  # [1, K, k]


def verify_exact(h, truth, req_ids, selections, locations):
    pool = h.sources["s"].pool
    for n, r in enumerate(req_ids):
        m = selections[n] >= 0
        assert bool((locations[n][~m] == -1).all())
        got = pool.read(locations[n][m].long())
        assert torch.equal(got, truth[r]["s"][selections[n][m].long()]), f"request {r} got wrong bytes"


@pytest.mark.parametrize("bad,exc,needle", [
    (lambda: torch.zeros(1, 1, 2, dtype=torch.int64), ValueError, "int32"),
    (lambda: torch.zeros(1, 2, dtype=torch.int32), ValueError, "(1, 2)"),
    (lambda: torch.zeros(1, 1, 2, dtype=torch.int32, device="meta"), ValueError, "meta"),
    (lambda: sel([0, 13]), IndexError, "selection 13"),
    (lambda: sel([-2, 0]), IndexError, "selection -2"),
    (lambda: torch.zeros(1, 1, B + 1, dtype=torch.int32), ValueError, "B must be >= k"),
    (lambda: torch.zeros(2, 1, 2, dtype=torch.int32), ValueError, "2 rows but 1 request"),
])
def test_bad_input_names_the_value(setup, bad, exc, needle):
    h, _ = setup
    with pytest.raises(exc) as e:
        h.resolve("s", ["r_host"], bad())
    assert needle in str(e.value)


def test_bad_selection_names_its_request_and_bound(setup):
    """Bounds are per request: 10 is fine for r_host (13 rows), not for r_dev (7 rows)."""
    h, _ = setup
    both = torch.tensor([[[10, -1]], [[6, 10]]], dtype=torch.int32)
    with pytest.raises(IndexError) as e:
        h.resolve("s", ["r_host", "r_dev"], both)
    assert str(e.value) == ("selection 10 at [1, 0, 1] (request 'r_dev') is outside [0, 7) rows "
                            "of source 's'; -1 is the only allowed padding")
    low = torch.tensor([[[0, 1], [2, -3]], [[-2, 0], [0, 0]]], dtype=torch.int32)
    with pytest.raises(IndexError, match=r"selection -3 at \[0, 1, 1\] \(request 'r_host'\)"):
        h.resolve("s", ["r_host", "r_dev"], low)
    h.resolve("s", ["r_host", "r_dev"], torch.tensor([[[12, -1]], [[6, -1]]], dtype=torch.int32))


class OpLog(TorchDispatchMode):
    """Records the aten ops run under it (views excluded: they read no data)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops.append((func, [a.numel() for a in args if isinstance(a, torch.Tensor)]))
        return func(*args, **(kwargs or {}))


def test_bounds_check_is_one_pass_and_one_sync(setup):
    """The hook validates once per layer per step: one reduction over the selections
    [N, K, k] and one device->host read, however many requests and queries."""
    h, _ = setup
    s = torch.tensor([[[1, 2, 7, -1], [7, 1, -1, 8]], [[0, 6, 3, -1], [2, 2, 2, 2]]],
                     dtype=torch.int32)
    log = OpLog()
    with log:
        h.source("s").resolver.validate(["r_host", "r_dev"], s)
    full = [f for f, sizes in log.ops if s.numel() in sizes]  # passes over all selections
    syncs = [f for f, _ in log.ops if f is torch.ops.aten._local_scalar_dense.default]
    assert len(full) == 1 and len(syncs) == 1, log.ops


def test_unvalidated_selections_past_the_length_read_nothing(setup):
    """validate=False skips the synchronising bounds check: a selection past the
    request's length (here inside r_dev's own host extent and inside r_host's) is not
    refused but reads nothing, and is counted; the valid ones are exact."""
    h, truth = setup
    s = torch.tensor([[[3, 7, 29, -4]], [[12, 13, 0, -1]]], dtype=torch.int32)
    loc, c = h.resolve("s", ["r_dev", "r_host"], s, validate=False)
    assert loc[0, 0].tolist()[1:] == [-1, -1, -1] and loc[1, 0, 1] == -1
    assert c[:, COUNTER_INVALID].tolist() == [3, 1]
    ok = torch.tensor([[[3, -1, -1, -1]], [[12, -1, 0, -1]]], dtype=torch.int32)
    verify_exact(h, truth, ["r_dev", "r_host"], ok, torch.where(ok >= 0, loc, -1))
    assert h.sources["s"].resolver.totals().invalid_selections == 4
    with pytest.raises(IndexError, match="selection 7"):
        h.resolve("s", ["r_dev"], s[:1])
    check_invariants(h, truth)


def test_unknown_request_and_source(setup):
    h, _ = setup
    with pytest.raises(KeyError, match="'ghost'"):
        h.resolve("s", ["ghost"], sel([0]))
    with pytest.raises(KeyError, match="'t'"):
        h.resolve("t", ["r_host"], sel([0]))


def test_overflow_needs_staging_when_none_reserved():
    h = KVHierarchy([dict(name="s", row_bytes=W, page_size=PS, device_pages=8, host_rows=100,
                          hot_cache_rows=2, tail_pages=1, max_req_slots=2, max_rows=20)])
    assert h.admit("r", 20, {"s": rows(9, 0)})
    with pytest.raises(ValueError, match="staging_rows"):
        h.resolve("s", ["r"], sel([0, 1], [2, 3]))


def test_direct_hot_host_paths_are_exact(setup):
    h, truth = setup
    s = sel([0, 5, 12, -1])  # r_host: rows 0, 5 from host, 12 in the tail
    loc, c = h.resolve("s", ["r_host"], s)
    verify_exact(h, truth, ["r_host"], s, loc)
    assert c[0].tolist() == [1, 0, 2, 2, 0, 0]  # direct, hot, host, fetched, repairs, invalid
    loc, c = h.resolve("s", ["r_host"], s)  # now hot hits, nothing fetched
    verify_exact(h, truth, ["r_host"], s, loc)
    assert c[0].tolist() == [1, 2, 0, 0, 0, 0]
    both = torch.tensor([[[3, 4, 6, 1]], [[0, 6, 3, -1]]], dtype=torch.int32)
    loc, c = h.resolve("s", ["r_dev", "r_host"], both)  # r_dev: pages 0, 1 optional, row 6 tail
    verify_exact(h, truth, ["r_dev", "r_host"], both, loc)
    assert c[0].tolist() == [4, 0, 0, 0, 0, 0] and c[1].tolist() == [0, 1, 2, 2, 0, 0]
    check_invariants(h, truth)


def test_shared_retrieval_fetches_each_row_once(setup):
    h, truth = setup
    s = sel([1, 2, 7, -1], [7, 1, -1, 8], [7, 9, 2, 1])  # K = 3 queries, overlapping selections
    with h.staging_arena("s") as arena:  # K*k = 12 > B = 4: the arena takes the overflow
        loc, c = h.resolve("s", ["r_host"], s, arena=arena)
        verify_exact(h, truth, ["r_host"], s, loc)
    assert int(c[0, COUNTER_HOST]) == 10 and int(c[0, COUNTER_FETCHED]) == 5  # {1, 2, 7, 8, 9}
    for row in (1, 2, 7):  # every query selecting a row gets the same location
        assert len(set(loc[0][s[0] == row].tolist())) == 1
    t = h.stats()["sources"]["s"]["resolver"]
    assert t["verify_host_selections"] == 10 and t["verify_fetched"] == 5
    assert t["bytes_fetched"] == 5 * W
    check_invariants(h, truth)  # the overflow did not enter the hot cache; arena released


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_and_cuda_index_are_one_device():
    """Tables made on "cuda", selections on cuda:0 (what tensors report): one GPU."""
    h = KVHierarchy([dict(name="s", row_bytes=W, page_size=PS, device_pages=8, host_rows=100,
                          hot_cache_rows=4, tail_pages=1, max_req_slots=2, max_rows=20)], device="cuda")
    assert h.admit("r", 20, {"s": rows(9, 0).cuda()})
    loc, c = h.resolve("s", ["r"], torch.tensor([[[0, 5, 8, -1]]], dtype=torch.int32,
                                                device=torch.device("cuda", 0)))
    assert int(c[0, :3].sum()) == 3


def test_the_clock_wraps_and_the_invariants_hold(setup):
    """Any int32 is a stamp: a request whose clock wraps from INT32_MAX keeps resolving
    exactly, evicts its oldest hot slots first, and no invariant calls the wrapped stamps
    'ahead of the clock'."""
    h, truth = setup
    st = h.sources["s"].state
    s = st.req_slot("r_host")
    st.hot_clock[s] = 2**31 - 2
    st.hot_stamp[s] = 2**31 - 2
    for rows_ in ([0, -1, -1, -1], [0, 1, -1, -1], [2, 0, -1, -1]):  # hot slots left unstamped
        loc, _ = h.resolve("s", ["r_host"], sel(rows_))
        verify_exact(h, truth, ["r_host"], sel(rows_), loc)
        check_invariants(h, truth)
    assert int(st.hot_clock[s]) == -2**31 + 1  # three calls: INT32_MAX - 1 -> wrapped
