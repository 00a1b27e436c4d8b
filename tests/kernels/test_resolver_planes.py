"""The resolver facade on the Triton backend with rows in two byte planes (like
DeepSeek-V4's 576 + 8; here 4 + 8 bytes, so the second plane holds two 4-byte words):
one resolve launch copies the misses into both planes.  Same locations and counters as
the reference backend, and the bytes read back are the rows."""
import torch

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.invariants import check_invariants

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: interpreter
SPEC = dict(name="s", row_bytes=12, page_size=2, device_pages=24, host_rows=200, hot_cache_rows=4,
            tail_pages=1, max_req_slots=4, max_rows=40, plane_bytes=(4, 8))


def rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 12), dtype=torch.uint8, generator=g)


def test_two_plane_rows_through_the_triton_backend():
    tri, ref = (KVHierarchy([SPEC], device=DEV, backend="triton"),
                KVHierarchy([SPEC], device=DEV, backend="reference"))
    assert tri.sources["s"].resolver.backend == "triton"
    truth = {}
    for i, n in enumerate([21, 9, 15]):  # later admissions reclaim: rows move to host
        truth[f"r{i}"] = {"s": rows(n, i)}
        for h in (tri, ref):
            assert h.admit(f"r{i}", 40, {"s": truth[f"r{i}"]["s"].clone().to(DEV)})
    ids = list(truth)
    g = torch.Generator().manual_seed(7)
    pool = tri.sources["s"].pool
    for step in range(6):
        sel = torch.stack([torch.randint(0, truth[r]["s"].shape[0], (1, 4), generator=g)
                           for r in ids]).int().to(DEV)
        sel[:, :, -1] = -1
        (loc_t, c_t), (loc_r, c_r) = (h.resolve("s", ids, sel) for h in (tri, ref))
        assert torch.equal(loc_t, loc_r) and torch.equal(c_t, c_r), f"step {step}"
        for i, r in enumerate(ids):
            m = sel[i, 0] >= 0
            assert torch.equal(pool.read(loc_t[i, 0][m].long()).cpu(),
                               truth[r]["s"][sel[i, 0][m].long().cpu()]), f"step {step}, {r}"
        for h in (tri, ref):
            h.step()
    assert tri.sources["s"].resolver.totals().fetched > 0  # misses were copied
    check_invariants(tri, truth)
