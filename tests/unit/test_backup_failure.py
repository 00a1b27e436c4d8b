"""The core: a failed host backup affects only the request that owns it."""
import pytest
import torch

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.host_store import HostBackupError
from tests.hierarchy_faults import fail_next_backup
from vllm_dhisparse.hierarchy.invariants import check_invariants

SOURCES = [
    dict(name="a", row_bytes=3, page_size=2, device_pages=40, host_rows=200, hot_cache_rows=3,
         tail_pages=1, max_req_slots=4, max_rows=40),
    dict(name="b", row_bytes=5, page_size=3, device_pages=40, host_rows=200, hot_cache_rows=4,
         tail_pages=2, max_req_slots=4, max_rows=40, plane_bytes=(4, 1)),
]


def rows(n, width, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)


def imported(n, seed):
    return {"a": rows(n, 3, seed), "b": rows(n, 5, seed + 1)}


def test_admission_backup_failure_rolls_back_every_source():
    h = KVHierarchy(SOURCES, eager_backup=True)
    free = {n: p.pool.num_free for n, p in h.sources.items()}
    fail_next_backup(h.source("b").host, "x")
    with pytest.raises(HostBackupError) as e:
        h.admit("x", 30, imported(12, 0))
    assert e.value.req_id == "x"
    assert "x" not in h.requests
    for n, p in h.sources.items():
        assert p.pool.num_free == free[n] and not p.host.has("x") and "x" not in p.residency.requests
    assert h.admit("y", 30, imported(12, 5))  # the hierarchy still admits others
    check_invariants(h)


def test_tail_backup_failure_releases_only_its_request():
    h = KVHierarchy(SOURCES)
    assert h.admit("ok", 30, imported(6, 0)) and h.admit("bad", 30, imported(6, 2))
    fail_next_backup(h.source("a").host, "bad")
    for step in range(4):  # fill tail pages until they complete and get backed up
        for rid in list(h.requests):
            h.append(rid, "a", rows(2, 3, step))
            h.append(rid, "b", rows(3, 5, step))
        h.step()
    failures = h.take_failures()
    assert list(failures) == ["bad"] and "injected" in failures["bad"]
    assert "bad" not in h.requests and "ok" in h.requests
    assert h.take_failures() == {}
    check_invariants(h)


def test_victim_backup_failure_fails_the_victim_not_the_admission():
    small = [dict(s, device_pages=14) for s in SOURCES]
    h = KVHierarchy(small)  # deferred backup: optional pages have no host copy yet
    assert h.admit("v", 30, imported(12, 0))
    assert h.source("a").residency.optional_pages() > 0
    fail_next_backup(h.source("a").host, "v")
    assert h.admit("n1", 30, imported(4, 3)) and h.admit("n2", 30, imported(4, 4))
    failures = h.take_failures()
    assert list(failures) == ["v"] and "v" not in h.requests, failures
    assert "n1" in h.requests and "n2" in h.requests
    check_invariants(h)
