import pytest
import torch

from vllm_dhisparse.hierarchy.host_store import HostBackupError, HostStore

from tests.hierarchy_faults import fail_next_backup


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
    h.allocate("b", 4)
    h.allocate("a", 8)
    pending = h.prepare_backup("a", 3, data(3))
    assert not bool(h.backed("a").any())  # issued is not backed
    h.complete_backup(pending)
    assert h.backed("a").nonzero().flatten().tolist() == [3, 4, 5]
    assert torch.equal(h.read("a", torch.tensor([3, 4, 5])), data(3))
    assert torch.equal(h.slice("a", 3, 3), data(3))  # written in place, in the request's extent
    assert not bool(h.backed("b").any()) and not h.slice("b", 0, 4).eq(data(3)[:1]).all(1).any()


def test_backup_from_planes():
    """Rows stored in device planes (576 + 8 bytes in fp8_ds_mla) back up as whole rows."""
    h = store(width=5)
    h.allocate("a", 8)
    rows = data(4, width=5, seed=3)
    h.complete_backup(h.prepare_backup("a", 2, [(0, rows[:, :4].contiguous()),
                                                 (4, rows[:, 4:].contiguous())]))
    assert torch.equal(h.slice("a", 2, 4), rows)


def test_complete_after_free_is_harmless():
    h = store()
    h.allocate("a", 8)
    pending = h.prepare_backup("a", 0, data(1))
    h.free("a")
    h.complete_backup(pending)
    assert pending.done and not h.has("a")


def test_a_failed_backup_marks_nothing_and_the_next_one_runs():
    h = store()
    h.allocate("a", 8)
    fail_next_backup(h, "a")
    with pytest.raises(HostBackupError, match="'a'"):
        h.prepare_backup("a", 0, data(1))
    assert not bool(h.backed("a").any())
    h.complete_backup(h.prepare_backup("a", 0, data(1)))  # next one succeeds
    assert bool(h.backed("a")[0])


@pytest.mark.parametrize("bad,exc,needle", [
    (dict(rows=8, data=data(1)), IndexError, "[8, 9) outside [0, 8)"),
    (dict(rows=-1, data=data(1)), IndexError, "outside [0, 8)"),
    (dict(rows=0, data=data(1, width=4)), ValueError, "uint8 [n, 3]"),
    (dict(rows=0, data=data(1).to(torch.int16)), ValueError, "torch.int16"),
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


def test_host_memory_is_checked_before_allocating():
    from vllm_dhisparse.hierarchy.pinned import check_host_memory
    check_host_memory(2**30, "host_pool_gib", available=2**31)
    with pytest.raises(ValueError, match=r"host_pool_gib = 64: 64.00 GiB .* only 8.00 GiB"):
        check_host_memory(64 * 2**30, "host_pool_gib = 64", available=8 * 2**30)


def test_hierarchy_refuses_a_host_pool_larger_than_ram():
    from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
    from vllm_dhisparse.hierarchy.pinned import available_host_bytes
    avail = available_host_bytes()
    if avail is None:
        pytest.skip("no MemAvailable on this platform")
    # one more 1000-byte row than the machine's RAM: more than is available however much
    # other processes free meanwhile (MemAvailable moves); nothing is allocated
    total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo")
                 if line.startswith("MemTotal:"))
    rows = max(avail, total) // 1000 + 1
    with pytest.raises(ValueError, match="host_pool_gib.*GiB is available"):
        KVHierarchy([dict(name="s", row_bytes=1000, page_size=4, device_pages=4, host_rows=rows,
                          hot_cache_rows=4, tail_pages=1, max_req_slots=1, max_rows=8)])


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("planes", [False, True])
def test_backup_of_rows_still_being_produced_on_cuda(planes):
    """The rows a backup copies are produced by GPU work still queued when the backup
    starts: the copy waits for it, and the rows count as backed only after it landed."""
    from vllm_dhisparse.hierarchy.transfers import CopyStream
    h = HostStore(name="h", row_bytes=584, capacity_rows=4096, pin=True, copies=CopyStream("cuda"))
    assert h.rows.is_pinned()
    want = data(1024, width=584, seed=5)
    for trial in range(4):
        req = f"r{trial}"
        h.allocate(req, 2048)
        rows = torch.zeros(1024, 584, dtype=torch.uint8, device="cuda")
        torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work before the rows exist
        rows.copy_(want.pin_memory(), non_blocking=True)
        src = [(0, rows[:, :576]), (576, rows[:, 576:])] if planes else rows
        pending = h.prepare_backup(req, 512, src)
        assert not bool(h.backed(req).any())
        h.complete_backup(pending)
        assert bool(h.backed(req)[512:1536].all())
        assert torch.equal(h.slice(req, 512, 1024), want), f"trial {trial}: host bytes differ"
        h.free(req)


@pytest.mark.cuda
@cuda
def test_pinned_pool_is_exactly_sized_and_readable_by_kernels():
    from vllm_dhisparse.hierarchy.pinned import host_buffer
    from vllm_dhisparse.triton_kernels import gather_rows
    buf = host_buffer(3 * 2**20 + 584, pin=True)  # not a power of two
    assert buf.is_pinned() and buf.numel() == 3 * 2**20 + 584
    rows = buf[: (buf.numel() // 584) * 584].view(-1, 584)
    rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8))
    dev = torch.zeros(16, 584, dtype=torch.uint8, device="cuda")
    src = torch.arange(100, 116, dtype=torch.int64, device="cuda").view(1, 16)
    dst = torch.arange(16, dtype=torch.int32, device="cuda").view(1, 16)
    gather_rows(rows, dev, src, dst, torch.tensor([16], dtype=torch.int32, device="cuda"))
    assert torch.equal(dev.cpu(), rows[100:116])


def test_registered_region_starts_on_a_huge_page_boundary():
    """Huge pages back only 2 MiB-aligned ranges: the registered part of the mapping
    starts on one (and without the advice, where the mapping starts)."""
    from vllm_dhisparse.hierarchy import pinned
    for huge in (True, False):
        seen = []
        buf = pinned.host_buffer(3 * 4096 + 5, pin=True, huge_pages=huge,
                                 register=lambda p, n: seen.append((p, n)) or 0,
                                 unregister=lambda p: None)
        (ptr, n), = seen
        assert n == 3 * 4096 + 5 and buf.data_ptr() == ptr and buf.numel() == n
        assert (ptr % pinned.HUGE == 0) or not huge
        buf.fill_(3)
        assert int(buf.sum()) == 3 * n


def test_registered_region_unregisters_before_it_unmaps():
    """The host pool's mapping outlives every view of it, and the CUDA registration ends
    before the memory is returned (never after: another mapping could inherit it)."""
    import gc

    from vllm_dhisparse.hierarchy import pinned
    events = []

    def unregister(p):
        events.append(("unregister", p))

    buf = pinned.host_buffer(3 * 4096 + 5, pin=True,
                             register=lambda p, n: events.append(("register", n)) or 0,
                             unregister=unregister)
    munmap = pinned._Region.__del__

    def spy(self):
        if self._unregister is unregister:  # not the regions of earlier tests that gc finds
            events.append(("del",))
        munmap(self)
    pinned._Region.__del__ = spy
    try:
        view = buf[100:200].view(10, 10)
        view.fill_(7)
        del buf
        gc.collect()
        assert events == [("register", 3 * 4096 + 5)] and int(view.sum()) == 700
        del view
        gc.collect()
        assert [e[0] for e in events] == ["register", "del", "unregister"]
    finally:
        pinned._Region.__del__ = munmap
