"""KVHierarchy.append_batch is append for many requests in one go: the same tail pages,
direct map, lengths, pool and host bytes as one append per request, through page
crossings, backups (step) and a tail whose pages all wait for their backup; a bad
input is refused before anything changes."""
import pytest
import torch

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from tests.hierarchy_faults import fail_next_backup
from vllm_dhisparse.hierarchy.invariants import check_invariants

SOURCES = [dict(name="a", row_bytes=3, page_size=2, device_pages=40, host_rows=500, hot_cache_rows=3,
                tail_pages=2, max_req_slots=5, max_rows=80),
           dict(name="b", row_bytes=5, page_size=3, device_pages=40, host_rows=500, hot_cache_rows=2,
                tail_pages=1, max_req_slots=5, max_rows=80, plane_bytes=(4, 1))]


def rows(n, width, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)


def world():
    h = KVHierarchy(SOURCES, optional_residency=False)
    truth = {}
    for i, rid in enumerate(["r0", "r1", "r2", "r3"]):
        imported = {s["name"]: rows(3 + 2 * i, s["row_bytes"], 10 * i + j)
                    for j, s in enumerate(SOURCES)}
        assert h.admit(rid, 80, imported)
        truth[rid] = {k: v.clone() for k, v in imported.items()}
    return h, truth


def state(h):
    out = []
    for p in h.sources.values():
        rm = p.residency
        # host rows are compared where they count: check_invariants reads every backed row
        out.append((p.state.page_table.clone(), p.state.seq_lens.clone(), p.pool.storage.clone(),
                    sorted(p.pool._used),
                    {r: (dict(x.tail), list(x.tail_free), [b[0] for b in x.backups])
                     for r, x in rm.requests.items()}))
    return out


def assert_same_state(a, b):
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            if isinstance(u, torch.Tensor):
                assert torch.equal(u, v)
            else:
                assert u == v


@pytest.mark.parametrize("seed", range(6))
def test_batch_equals_one_append_per_request(seed):
    each, truth = world()
    batch, _ = world()
    g = torch.Generator().manual_seed(seed)
    ids = ["r0", "r1", "r2", "r3"]
    for step in range(24):
        for s in SOURCES:
            name, w = s["name"], s["row_bytes"]
            pick = [r for r in ids if torch.rand(1, generator=g).item() < 0.8]
            counts = [int(torch.randint(0, 4, (1,), generator=g)) for _ in pick]
            data = rows(sum(counts), w, 1000 * seed + 10 * step + len(name))
            first = 0
            for r, n in zip(pick, counts):
                each.append(r, name, data[first:first + n])
                truth[r][name] = torch.cat([truth[r][name], data[first:first + n]])
                first += n
            batch.append_batch(name, pick, data, counts)
        assert_same_state(state(each), state(batch))
        check_invariants(batch, truth=truth)
        if step % 3 != 2:  # some steps skip step(): tails fill up, the slow path flushes
            each.step()
            batch.step()
        if step % 4 == 3:  # a request leaves, a new one takes its request slot
            gone = ids.pop(int(torch.randint(0, len(ids), (1,), generator=g)))
            new = f"n{step}"
            # about as long as the one that left: the request slot's last tail page was at that length
            imported = {s["name"]: rows(max(1, truth[gone][s["name"]].shape[0]
                                            - int(torch.randint(0, 3, (1,), generator=g))),
                                        s["row_bytes"], 7 * step + j)
                        for j, s in enumerate(SOURCES)}
            for h in (each, batch):
                h.finish(gone)
                assert h.admit(new, 80, {k: v.clone() for k, v in imported.items()})
            truth.pop(gone)
            truth[new] = imported
            ids.append(new)


def test_bad_input_changes_nothing():
    h, _ = world()
    before = state(h)
    with pytest.raises(ValueError, match="'r1' has 5 rows; appending 76 exceeds its max_rows 80"):
        h.append_batch("a", ["r0", "r1"], rows(77, 3, 0), [1, 76])
    with pytest.raises(ValueError, match="counts"):
        h.append_batch("a", ["r0", "r1"], rows(3, 3, 0), [1, 1])
    with pytest.raises(ValueError, match="do not split evenly"):
        h.append_batch("a", ["r0", "r1"], rows(3, 3, 0))
    with pytest.raises(ValueError, match="do not split evenly over 0 requests"):
        h.append_batch("a", [], rows(2, 3, 0))  # rows for nobody would be dropped
    with pytest.raises(ValueError, match="counts"):  # their int64 sum wraps to 2
        h.append_batch("a", ["r0", "r1", "r2"], rows(2, 3, 0), [2**63 - 1, 2**63 - 1, 4])
    with pytest.raises(ValueError, match="counts"):
        h.append_batch("a", ["r0", "r1"], rows(2, 3, 0), [1.0, 1.0])
    with pytest.raises(ValueError, match="distinct"):
        h.append_batch("a", ["r0", "r0"], rows(2, 3, 0))
    with pytest.raises(KeyError, match="unknown request id 'zz'"):
        h.append_batch("a", ["r0", "zz"], rows(2, 3, 0))
    with pytest.raises(ValueError, match=r"must be a uint8 tensor \[n, 3\]"):
        h.append_batch("a", ["r0"], rows(2, 5, 0))
    assert_same_state(before, state(h))


def test_a_failed_backup_on_the_full_tail_path_fails_that_request_alone():
    """r1's tail is full and its backup fails when the batch needs a page for it: the
    failure comes back for r1 (not appended), the other requests are appended."""
    from vllm_dhisparse.hierarchy.host_store import HostBackupError
    h, truth = world()
    b = h.source("b")
    for r in ("r0", "r1"):  # fill b's single tail page of both to its end
        n = b.spec.page_size - b.state.seq_len(r) % b.spec.page_size
        h.append_batch("b", [r], rows(n, 5, 7))
    fail_next_backup(b.host, "r1")
    lens = {r: b.state.seq_len(r) for r in ("r0", "r1", "r2")}
    failed = h.append_batch("b", ["r0", "r1", "r2"], rows(3, 5, 8))
    assert set(failed) == {"r1"} and isinstance(failed["r1"], HostBackupError)
    assert b.state.seq_len("r1") == lens["r1"]
    assert (b.state.seq_len("r0"), b.state.seq_len("r2")) == (lens["r0"] + 1, lens["r2"] + 1)


def test_a_device_failure_leaves_every_request_as_it_was(monkeypatch):
    """If the device write raises (out of memory, say), no tail page was bound, nothing
    was published, no length moved: the caller can append one request at a time."""
    h, truth = world()
    before = state(h)
    pool = h.source("a").pool

    def boom(locs, data):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(pool, "write", boom)
    with pytest.raises(RuntimeError, match="out of memory"):
        h.append_batch("a", ["r0", "r1", "r2"], rows(9, 3, 5))  # crosses pages for all
    assert_same_state(before, state(h))
    monkeypatch.undo()
    for r, first in (("r0", 0), ("r1", 3), ("r2", 6)):
        h.append(r, "a", rows(9, 3, 5)[first:first + 3])
        truth[r]["a"] = torch.cat([truth[r]["a"], rows(9, 3, 5)[first:first + 3]])
    check_invariants(h, truth=truth)
