import pytest
import torch

from vllm_dhisparse.hierarchy.host_store import HostBackupError, HostStore


def store(rows=32, width=3):
    return HostStore(name="h", row_bytes=width, capacity_rows=rows, pin=False)


def data(n, width=3, seed=0):
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def test_extents_are_contiguous_and_disjoint():
    h = store()
    a, b = h.allocate("a", 10), h.allocate("b", 12)
    assert (a, b) == (0, 10)
    assert h.length("a") == 10 and h.rows_used == 22 and h.bytes_used == 22 * 3


def test_no_room_returns_none_and_free_coalesces():
    h = store(rows=30)
    for r in "abc":
        h.allocate(r, 10)
    assert not h.can_allocate(1) and h.allocate("d", 1) is None
    h.free("a")
    h.free("b")
    assert h.can_allocate(20) and not h.can_allocate(21)
    assert h.allocate("d", 20) == 0  # the two neighbours merged into one extent


def test_backed_only_after_complete():
    h = store()
    h.allocate("a", 8)
    rows = torch.tensor([1, 3, 5])
    pending = h.prepare_backup("a", rows, data(3))
    assert not bool(h.backed("a").any())  # issued is not backed
    h.complete_backup(pending)
    assert h.backed("a").nonzero().flatten().tolist() == [1, 3, 5]
    assert torch.equal(h.read("a", rows), data(3))


def test_complete_after_free_is_harmless():
    h = store()
    h.allocate("a", 8)
    pending = h.prepare_backup("a", torch.tensor([0]), data(1))
    h.free("a")
    h.complete_backup(pending)
    assert pending.done and not h.has("a")


def test_fault_injection_fails_once_and_marks_nothing():
    h = store()
    h.allocate("a", 8)
    h.fail_next_backup_of.add("a")
    with pytest.raises(HostBackupError, match="'a'"):
        h.prepare_backup("a", torch.tensor([0]), data(1))
    assert not bool(h.backed("a").any())
    h.complete_backup(h.prepare_backup("a", torch.tensor([0]), data(1)))  # next one succeeds
    assert bool(h.backed("a")[0])


@pytest.mark.parametrize("bad,exc,needle", [
    (dict(rows=torch.tensor([8]), data=data(1)), IndexError, "outside [0, 8)"),
    (dict(rows=torch.tensor([0]), data=data(1, width=4)), ValueError, "uint8 [1, 3]"),
    (dict(rows=torch.tensor([0]), data=data(1).to(torch.int16)), ValueError, "torch.int16"),
])
def test_bad_backup_input(bad, exc, needle):
    h = store()
    h.allocate("a", 8)
    with pytest.raises(exc) as e:
        h.prepare_backup("a", bad["rows"], bad["data"])
    assert needle in str(e.value)


def test_bad_requests():
    h = store(rows=16)
    with pytest.raises(ValueError, match="17"):
        h.allocate("a", 17)
    h.allocate("a", 4)
    with pytest.raises(ValueError, match="already"):
        h.allocate("a", 4)
    with pytest.raises(KeyError, match="'zz'"):
        h.backed("zz")
