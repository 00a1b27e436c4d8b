"""Scripted residency scenarios (paper 3.1): resident-first admission, eq. 3/4 reclaim,
waiting, bounded round-robin repopulation, the tail, release, optional residency off."""
import pytest
import torch

from vllm_dhisparse.triton_kernels.reference import COUNTER_DIRECT, COUNTER_FETCHED, NUM_COUNTERS
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from tests.hierarchy_faults import fail_next_backup
from vllm_dhisparse.hierarchy.invariants import check_invariants

PS, W, B = 2, 3, 3  # page size, row bytes, hot rows (2 pages)


def make(device_pages, tail_pages=1, sources=("s",), **knobs):
    pages = device_pages if isinstance(device_pages, dict) else dict.fromkeys(sources, device_pages)
    specs = [dict(name=n, row_bytes=W, page_size=PS, device_pages=pages[n], host_rows=400,
                  hot_cache_rows=B, tail_pages=tail_pages, max_req_slots=8, max_rows=40) for n in sources]
    return KVHierarchy(specs, **knobs), {}


def rows(n, seed):
    return torch.randint(0, 256, (n, W), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


def admit(h, truth, req, n_imported, source="s"):
    imported = {name: rows(n_imported, hash((req, name)) % 1000) for name in h.sources}
    ok = h.admit(req, 40, imported)
    if ok:
        truth[req] = {name: t.clone() for name, t in imported.items()}
    check_invariants(h, truth)
    return ok


def append(h, truth, req, n, seed, source="s"):
    new = rows(n, seed)
    h.append(req, source, new)
    truth[req][source] = torch.cat([truth[req][source], new])


def rec(h, req, source="s"):
    return h.sources[source].residency.requests[req]


def verify_optional(h, req, pages, source="s"):
    assert sorted(rec(h, req, source).optional) == pages
    table = h.sources[source].state.page_table[h.sources[source].state.req_slot(req)]
    for p in pages:
        assert int(table[p]) >= 0, f"optional page {p} of {req} not published"


def verify_backed_rows(h, req, expect, source="s"):
    backed = h.sources[source].host.backed(req)
    assert backed.nonzero().flatten().tolist() == list(expect)


def verify_resolves(h, truth, req, source="s"):
    """Resolves every row of req (k = B per query) and checks bytes; returns summed counters."""
    n = truth[req][source].shape[0]
    total = torch.zeros(NUM_COUNTERS, dtype=torch.int64)
    pool = h.sources[source].pool
    for start in range(0, n, B):
        sel = torch.arange(start, min(start + B, n), dtype=torch.int32)
        sel = torch.cat([sel, torch.full((B - sel.numel(),), -1, dtype=torch.int32)]).view(1, 1, B)
        loc, counters = h.resolve(source, [req], sel)
        m = sel[0, 0] >= 0
        assert torch.equal(pool.read(loc[0, 0][m].long()), truth[req][source][sel[0, 0][m].long()])
        total += counters[0].long()
    check_invariants(h, truth)
    return total


def snapshot(h):
    out = {}
    for name, p in h.sources.items():
        rm = p.residency
        out[name] = (p.pool.num_free, {r: dict(x.optional) for r, x in rm.requests.items()},
                     {r: p.host.backed(r).clone().tolist() for r in rm.requests},
                     p.state.page_table.clone().tolist(), rm.counters.pages_reclaimed)
    return out


@pytest.mark.parametrize("eager", [False, True])
def test_resident_first_keeps_imported_history_on_device(eager):
    h, truth = make(20, admission_reserve_pages=2, eager_backup=eager)
    assert admit(h, truth, "r0", 11)  # 5 complete pages + 1 boundary row
    verify_optional(h, "r0", [0, 1, 2, 3, 4])
    assert sorted(rec(h, "r0").tail) == [5]  # the partial boundary page is tail
    assert h.host_only_rows("r0") == {"s": 0}
    st = h.stats()["sources"]["s"]
    if eager:
        verify_backed_rows(h, "r0", range(10))
        assert st["host_backups_deferred"] == 0 and st["host_pages_written"] == 5
    else:  # backup deferred: no host copy until a reclaim needs it
        verify_backed_rows(h, "r0", [])
        assert st["host_backups_deferred"] == 5 and st["host_pages_written"] == 0
    assert st["eligible_history_rows"] == 10 and st["ready_optional_rows"] == 10
    counters = verify_resolves(h, truth, "r0")
    assert int(counters[COUNTER_DIRECT]) == 11 and int(counters[COUNTER_FETCHED]) == 0


def test_history_that_does_not_fit_goes_to_host_now():
    h, truth = make(10, admission_reserve_pages=1)
    assert admit(h, truth, "r0", 18)  # 9 complete pages; 10 - 3 required - 1 reserve = 6 fit
    verify_optional(h, "r0", [3, 4, 5, 6, 7, 8])  # the pages nearest the tail stay
    verify_backed_rows(h, "r0", range(6))
    assert h.host_only_rows("r0") == {"s": 6}  # pages 0..2: attention reads them from host
    assert h.sources["s"].pool.num_free == 1  # exactly the reserve (eq. 3 tight)
    verify_resolves(h, truth, "r0")


def pressured(policy):
    """f (no history), r0 8 pages, r1 4 pages (2 fit), r2 ... leaves the pool full."""
    h, truth = make(24, reclaim_policy=policy)
    assert admit(h, truth, "r0", 16)  # 3 required + 8 optional -> 13 free
    assert admit(h, truth, "r1", 8)  # 3 + 4 -> 6 free
    assert admit(h, truth, "r2", 6)  # 3 + 3 -> 0 free
    assert h.sources["s"].pool.num_free == 0
    return h, truth


@pytest.mark.parametrize("policy,active,victims", [
    ("largest_first", None, ["r0"]),  # one request covers Δ = 3: fewest disturbed
    ("oldest_first", None, ["r0"]),
    ("least_recently_active", "r0", ["r1"]),  # r0 decoded recently; r1 idle longest
])
def test_admission_reclaims_whole_requests_eq4(policy, active, victims):
    h, truth = pressured(policy)
    if active:
        h.step()
        append(h, truth, active, 1, seed=7)
    before = {r: dict(rec(h, r).optional) for r in ("r0", "r1", "r2")}
    assert admit(h, truth, "r3", 0)  # Δ = 3 required + 0 reserve - 0 free
    for r in ("r0", "r1", "r2"):
        if r in victims:  # whole request: every optional page gone, every row backed first
            assert rec(h, r).optional == {}
            eligible = rec(h, r).eligible_pages * PS
            assert bool(h.sources["s"].host.backed(r)[:eligible].all())
        else:
            assert rec(h, r).optional == before[r], f"{r} lost pages it should keep"
    st = h.stats()["sources"]["s"]
    assert st["reclaim_events"] == 1 and st["requests_reclaimed"] == len(victims)
    assert st["pages_reclaimed"] == sum(len(before[v]) for v in victims)
    for r in victims:
        verify_resolves(h, truth, r)  # history now through hot cache / host, exact


def test_prefix_of_several_requests_when_one_is_not_enough():
    h, truth = pressured("oldest_first")
    h.finish("r0")  # 11 pages free; r1 holds 4, r2 holds 3
    assert admit(h, truth, "big", 22)  # 3 req + 8 optional kept -> 0 free
    assert admit(h, truth, "x", 0)  # Δ = 3: oldest r1 (4 pages) covers it alone
    assert rec(h, "r1").optional == {} and len(rec(h, "r2").optional) == 3
    h.finish("x")
    h.finish("big")
    check_invariants(h, truth_minus(truth, "x", "big"))


def truth_minus(truth, *gone):
    for g in gone:
        truth.pop(g, None)
    return truth


def test_waits_when_optional_pages_cannot_cover_and_reclaims_nothing():
    h, truth = make(14, tail_pages=2)  # 4 required pages per request
    assert admit(h, truth, "r0", 4)  # 4 + 2 optional -> 8 free
    assert admit(h, truth, "r1", 0)
    assert admit(h, truth, "r2", 0)  # 0 free; only 2 optional pages exist
    before = snapshot(h)
    assert not admit(h, truth, "r3", 0)  # Δ = 4 > 2
    assert snapshot(h) == before and "r3" not in h.requests
    assert h.stats()["admissions_waited"] == 1


def test_admission_is_all_or_nothing_across_sources():
    h, truth = make({"a": 14, "b": 10}, tail_pages=2, sources=("a", "b"))  # 4 required pages
    imported = {"a": rows(8, 1), "b": rows(2, 2)}  # a: 4 optional pages, b: 1
    assert h.admit("r0", 40, imported) and h.admit("r1", 40)
    truth.update(r0={k: v.clone() for k, v in imported.items()},
                 r1={k: rows(0, 0) for k in imported})
    check_invariants(h, truth)  # free: a 2, b 1
    before = snapshot(h)
    # a could cover Δ = 2 by reclaiming r0, b cannot cover Δ = 3: nobody reclaims anything
    assert not h.admit("r2", 40)
    assert snapshot(h) == before and "r2" not in h.requests
    check_invariants(h, truth)


@pytest.mark.parametrize("run_pages, passes", [(4, 1), (1, 4)])
def test_one_admission_backs_up_every_victim_in_shared_copies(run_pages, passes):
    """The victims of one admission are backed up by one pass over the copy stream per
    ``run_pages`` pages in each source (two victims' runs share a pass, or each page has
    its own), each victim's run landing in its own host extent."""
    h, truth = make(15, sources=("s", "t"), run_pages=run_pages)  # 3 required pages each
    for r in ("v0", "v1", "v2"):
        assert admit(h, truth, r, 4)  # 2 optional pages each, deferred backups
    seen = {n: 0 for n in h.sources}
    for name, parts in h.sources.items():
        def counted(items, data, _name=name, _orig=parts.host.prepare_backups):
            seen[_name] += 1
            return _orig(items, data)
        parts.host.prepare_backups = counted
    before = {n: dict(h.stats()["sources"][n]) for n in h.sources}
    assert admit(h, truth, "x", 0)  # Δ = 3 in each source: two victims each
    reclaimed = [r for r in ("v0", "v1", "v2") if not rec(h, r).optional]
    assert len(reclaimed) == 2 and seen == {"s": passes, "t": passes}
    for name in h.sources:
        after = h.stats()["sources"][name]
        assert after["host_pages_written"] - before[name]["host_pages_written"] == 4
        assert after["pages_reclaimed"] - before[name]["pages_reclaimed"] == 4
        assert after["requests_reclaimed"] - before[name]["requests_reclaimed"] == 2
    for r in reclaimed:
        for name in h.sources:
            verify_backed_rows(h, r, range(4), source=name)
            assert torch.equal(h.sources[name].host.read(r, torch.arange(4)), truth[r][name])
            verify_resolves(h, truth, r, source=name)


def test_victim_pages_go_only_after_every_backup_of_the_admission_completed():
    """Copies are asynchronous on CUDA: a victim's pages may be unpublished and freed only
    once the backups issued for them have completed (here: events that complete only when
    waited for, checked at every unpublish and free)."""
    from vllm_dhisparse.hierarchy.transfers import Transfer

    class Event:  # completes only when synchronised
        def __init__(self):
            self.waited = False

        def query(self):
            return self.waited

        def synchronize(self):
            self.waited = True

    h, truth = make(15, sources=("s", "t"), run_pages=1)
    for r in ("v0", "v1", "v2"):
        assert admit(h, truth, r, 4)
    events, order = {n: [] for n in h.sources}, []
    for name, parts in h.sources.items():
        def issue(items, data, _orig=parts.host.prepare_backups, _events=events[name]):
            out = _orig(items, data)
            event = Event()
            _events.append(event)
            for pending in out:
                pending.transfer = Transfer(event)
            return out

        def check(what, fn, _events=events[name]):  # the source's own copies
            def wrapped(*a, **k):
                order.append((what, all(e.waited for e in _events)))
                return fn(*a, **k)
            return wrapped
        parts.host.prepare_backups = issue
        parts.state.unpublish_pages = check("unpublish", parts.state.unpublish_pages)
        parts.pool.free = check("free", parts.pool.free)
    assert admit(h, truth, "x", 0)
    assert [len(e) for e in events.values()] == [4, 4]
    assert all(e.waited for es in events.values() for e in es)
    assert {w for w, _ in order} == {"unpublish", "free"}
    assert all(done for _, done in order), order


def test_a_victim_whose_backup_fails_in_a_later_source_fails_alone():
    """Source s has issued its victims' backups when source t cannot back up one of the
    same victims: s's reclaims complete, that victim alone fails, the admission goes on."""
    h, truth = make(15, sources=("s", "t"))
    for r in ("v0", "v1", "v2"):
        assert admit(h, truth, r, 4)
    fail_next_backup(h.sources["t"].host, "v0")
    assert admit_failing_victim(h, truth, "x")
    assert list(h.take_failures()) == ["v0"] and "v0" not in h.requests
    for r in ("v1", "v2"):
        for name in h.sources:
            verify_resolves(h, truth, r, source=name)


def test_backup_failure_during_reclaim_fails_only_the_victim():
    """The victim whose deferred backup fails is released and reported
    (``take_failures``); the admission that needed its pages proceeds."""
    h, truth = pressured("largest_first")
    fail_next_backup(h.sources["s"].host, "r0")
    assert admit_failing_victim(h, truth, "r3")
    failures = h.take_failures()
    assert list(failures) == ["r0"] and "'r0'" in failures["r0"]
    assert "r0" not in h.requests and "r3" in h.requests
    assert h.take_failures() == {}


def admit_failing_victim(h, truth, req):
    ok = h.admit(req, 40)
    for gone in [r for r in truth if r not in h.requests]:
        truth.pop(gone)
    if ok:
        truth[req] = {name: rows(0, 0) for name in h.sources}
    check_invariants(h, truth)
    return ok


def test_reclaim_backs_up_scattered_pages_in_bounded_runs():
    """Reclaim copies device-only pages in runs of consecutive history pages (one host
    copy each, at most run_pages long), gathering rows from scattered device
    pages, and skips pages that already have a host copy."""
    from vllm_dhisparse.hierarchy.residency import _runs
    assert _runs([0, 1, 2, 4, 5, 9], 2) == [[0, 1], [2], [4, 5], [9]]
    assert _runs([], 4) == []
    h, truth = make(20, run_pages=2)
    for i in range(5):  # pages 3i .. 3i+2 each
        assert admit(h, truth, f"x{i}", 0)
    for i in (1, 3):
        h.finish(f"x{i}")
        truth.pop(f"x{i}")
    assert admit(h, truth, "r0", 14)  # required 3-5; 7 pages kept at 9-11 and 15-18
    opt = rec(h, "r0").optional
    assert [opt[p] for p in sorted(opt)] == [9, 10, 11, 15, 16, 17, 18]
    verify_backed_rows(h, "r0", [])  # deferred
    host = h.sources["s"].host
    host.complete_backup(host.prepare_backup("r0", 4 * PS, truth["r0"]["s"][4 * PS:5 * PS]))
    written = h.stats()["sources"]["s"]["host_pages_written"]
    assert h.sources["s"].residency.reclaim("r0") == 7
    assert h.stats()["sources"]["s"]["host_pages_written"] - written == 6  # page 4 had a copy
    verify_backed_rows(h, "r0", range(14))
    check_invariants(h, truth)
    verify_resolves(h, truth, "r0")  # every row now through hot cache / host, exact


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA copy stream")
def test_reclaim_gathers_stay_alive_until_their_copy_ran():
    """Scattered device pages of two planes are gathered on the compute stream and joined
    on the copy stream; with the copy stream busy (earlier backups), a gathered buffer
    freed early would be handed to the next run's gather before the join read it."""
    ps, n = 64, 200  # history pages
    spec = dict(name="c", row_bytes=584, page_size=ps, plane_bytes=(576, 8),
                device_pages=2 * n + 8, host_rows=(n + 4) * ps, hot_cache_rows=ps, tail_pages=1,
                max_req_slots=2, max_rows=(n + 2) * ps)
    h = KVHierarchy([spec], device="cuda", run_pages=2)
    parts = h.sources["c"]
    held = parts.pool.allocate(parts.pool.num_free)
    parts.pool.free(held[::2])  # every other page free: the optional pages scatter
    truth = torch.randint(0, 256, (n * ps, 584), dtype=torch.uint8, device="cuda")
    assert h.admit("r0", (n + 2) * ps, {"c": truth})
    assert len(parts.residency.requests["r0"].optional) == n
    big = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    pinned = torch.empty(2 << 30, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(parts.host.copies.stream):  # the copy stream runs late
        pinned.copy_(big, non_blocking=True)
    parts.residency.reclaim("r0")
    got = parts.host.read("r0", torch.arange(n * ps)).cuda()
    bad = (got != truth).any(1).view(n, ps).any(1)
    assert int(bad.sum()) == 0, f"{int(bad.sum())} pages backed up with another run's rows"


def test_repopulation_is_bounded_and_round_robin():
    h, truth = make(15, repopulate_pages_per_step=2)
    assert admit(h, truth, "f", 0)  # 12 free
    assert admit(h, truth, "r0", 8)  # 4 kept -> 5 free
    assert admit(h, truth, "r1", 8)  # 2 of 4 kept -> 0 free
    assert admit(h, truth, "r2", 8)  # Δ = 3: r0 (4 pages) reclaimed; r2 keeps 1 of 4
    assert [len(rec(h, r).optional) for r in ("r0", "r1", "r2")] == [0, 2, 1]
    h.finish("f")
    truth.pop("f")
    assert h.sources["s"].pool.num_free == 3
    h.step()  # issues 2 copies: r0 then r1 (round robin), pending and unpublished
    pend = {r: sorted(rec(h, r).pending) for r in ("r0", "r1", "r2")}
    assert pend == {"r0": [3], "r1": [1], "r2": []}
    assert h.stats()["sources"]["s"]["pending_pages"] == 2
    check_invariants(h, truth)  # (c): no pending page is published
    counters = verify_resolves(h, truth, "r0")  # pending rows served through hot/host
    assert int(counters[COUNTER_DIRECT]) == 0
    h.step()  # publishes both; room for 1 above reserve -> r2 is next in the round
    assert sorted(rec(h, "r0").optional) == [3] and sorted(rec(h, "r1").optional) == [1, 2, 3]
    assert sorted(rec(h, "r2").pending) == [2]
    h.step()
    st = h.stats()["sources"]["s"]
    assert st["pages_repopulated"] == 3 and st["free_pages"] == 0 and st["pending_pages"] == 0
    check_invariants(h, truth)
    for r in ("r0", "r1", "r2"):
        verify_resolves(h, truth, r)


def repopulates_r0(h, truth):
    """r0's reclaimed page 3 is issued by the next step, ready after another, and read back."""
    h.step()
    assert sorted(rec(h, "r0").pending) == [3]
    h.step()
    assert sorted(rec(h, "r0").optional) == [3]
    check_invariants(h, truth)
    verify_resolves(h, truth, "r0")


def test_a_reclaimed_request_is_repopulated_again():
    """step() remembers requests with nothing to repopulate; a reclaim must make their
    dropped pages eligible again."""
    h, truth = make(15, repopulate_pages_per_step=2)
    assert admit(h, truth, "f", 0)
    assert admit(h, truth, "r0", 8)  # all 4 pages kept: nothing to repopulate
    h.step()
    assert rec(h, "r0").pending == {}
    assert admit(h, truth, "r1", 8)
    assert admit(h, truth, "r2", 8)  # reclaims r0
    assert len(rec(h, "r0").optional) == 0
    h.finish("f")
    truth.pop("f")
    repopulates_r0(h, truth)


def test_a_repopulation_copy_that_raises_gives_its_pages_back():
    """A batched repopulation copy that fails leaves no device page allocated to nobody,
    and the pages it would have copied are issued again by the next step."""
    h, truth = make(15, repopulate_pages_per_step=2)
    assert admit(h, truth, "f", 0)
    assert admit(h, truth, "r0", 8)
    assert admit(h, truth, "r1", 8)
    assert admit(h, truth, "r2", 8)  # reclaims r0
    h.finish("f")
    truth.pop("f")
    parts = h.sources["s"]
    free = parts.pool.num_free
    copies = parts.host.copies
    real = copies.pages_to_device

    def broken(*args, **kwargs):
        raise RuntimeError("copy refused")

    copies.pages_to_device = broken
    with pytest.raises(RuntimeError, match="copy refused"):
        h.step()
    copies.pages_to_device = real
    assert parts.pool.num_free == free
    assert rec(h, "r0").pending == {}
    check_invariants(h, truth)
    repopulates_r0(h, truth)


def test_a_readmitted_request_resolves_through_its_new_request_slot():
    """Resolving the same batch again reuses its request-slot tensor; a request slot that
    closed and opened in between must not leave a stale one (a would read c's rows)."""
    h, truth = make(20)
    ids = ["a", "b"]
    assert admit(h, truth, "a", 4) and admit(h, truth, "b", 4)
    sel = torch.arange(3, dtype=torch.int32).repeat(2, 1, 1)  # [2, 1, 3]
    pool = h.sources["s"].pool

    def check():
        loc, _ = h.resolve("s", ids, sel)
        for i, r in enumerate(ids):
            assert torch.equal(pool.read(loc[i, 0].long()), truth[r]["s"][:3])

    check()
    h.finish("a")
    truth.pop("a")
    assert admit(h, truth, "c", 4)  # takes a's request slot
    assert admit(h, truth, "a", 5)
    check()
    check_invariants(h, truth)


def test_tail_backup_then_release_and_full_tail_syncs():
    h, truth = make(12, tail_pages=2)
    assert admit(h, truth, "r0", 3)  # page 0 optional, row 2 in tail page 1
    append(h, truth, "r0", 1, seed=1)  # page 1 complete
    assert sorted(rec(h, "r0").tail) == [1]
    h.step()  # backup of page 1 issued, page stays published meanwhile
    assert [p for p, _ in rec(h, "r0").backups] == [1] and 1 in rec(h, "r0").tail
    check_invariants(h, truth)
    h.step()  # copy completed: page 1 leaves the tail, rows now host-backed
    assert rec(h, "r0").tail == {} and len(rec(h, "r0").tail_free) == 2
    verify_backed_rows(h, "r0", [2, 3])
    append(h, truth, "r0", 7, seed=2)  # 3.5 pages into a 2-page tail: synchronous backups
    check_invariants(h, truth)
    assert sorted(rec(h, "r0").tail) == [4, 5]
    verify_backed_rows(h, "r0", range(2, 8))
    verify_resolves(h, truth, "r0")
    with pytest.raises(ValueError, match="max_rows 40"):
        h.append("r0", "s", rows(40, 0))


def test_tail_pages_of_one_step_back_up_in_one_pass():
    """Pages that completed in one step, in several requests, are copied in one pass over
    the copy stream (one transfer for all) and leave the tail together, exact."""
    h, truth = make(30, tail_pages=2)
    for r in ("r0", "r1", "r2"):
        assert admit(h, truth, r, 3)  # page 0 optional, row 2 in tail page 1
    append(h, truth, "r0", 1, seed=1)  # page 1 complete
    append(h, truth, "r1", 3, seed=2)  # pages 1 and 2 complete (rows 2-5)
    h.step()
    issued = [p for r in ("r0", "r1") for _, p in rec(h, r).backups]
    assert [p.first // PS for p in issued] == [1, 1, 2]
    assert all(p.transfer is issued[0].transfer for p in issued)  # one pass, one event
    assert rec(h, "r2").backups == []
    check_invariants(h, truth)
    h.step()
    assert rec(h, "r0").tail == {} and rec(h, "r1").tail == {} and len(rec(h, "r2").tail) == 1
    verify_backed_rows(h, "r0", [2, 3])
    verify_backed_rows(h, "r1", [2, 3, 4, 5])
    for r in ("r0", "r1", "r2"):
        verify_resolves(h, truth, r)


def test_a_failed_tail_backup_does_not_hold_back_the_others():
    """The request whose backup fails comes first in the step's pass; the requests after
    it are still issued in that step."""
    h, truth = make(30, tail_pages=2)
    for r in ("bad", "r1", "r2"):
        assert admit(h, truth, r, 3)
    fail_next_backup(h.sources["s"].host, "bad")
    for i, r in enumerate(("bad", "r1", "r2")):
        append(h, truth, r, 1, seed=10 + i)  # page 1 complete in each
    h.step()
    assert list(h.take_failures()) == ["bad"] and "bad" not in h.requests
    for r in ("r1", "r2"):
        assert [p.first for _, p in rec(h, r).backups] == [2], r
    truth.pop("bad")
    check_invariants(h, truth)
    h.step()
    for r in ("r1", "r2"):
        verify_backed_rows(h, r, [2, 3])
        verify_resolves(h, truth, r)


@pytest.mark.parametrize("how", ["finish", "preempt"])
def test_release_returns_everything(how):
    h, truth = make(20, repopulate_pages_per_step=4)
    for i in range(3):
        assert admit(h, truth, f"r{i}", 9)
    for i in range(3):
        append(h, truth, f"r{i}", 3, seed=i)
    h.step()
    for i in range(3):
        getattr(h, how)(f"r{i}")
    p = h.sources["s"]
    assert p.pool.num_free == 20 and p.host.rows_used == 0 and h.requests == {}
    assert bool((p.state.page_table < 0).all()) and p.state.open_requests == []
    check_invariants(h, {})
    with pytest.raises(KeyError, match="'r0'"):
        h.finish("r0")
    assert admit(h, truth_minus(truth, "r0", "r1", "r2"), "r0", 5)  # the id is reusable


def test_optional_residency_off():
    h, truth = make(30, optional_residency=False, repopulate_pages_per_step=8)
    assert admit(h, truth, "r0", 9)
    assert rec(h, "r0").optional == {} and sorted(rec(h, "r0").tail) == [4]
    verify_backed_rows(h, "r0", range(8))
    for _ in range(3):
        h.step()
    st = h.stats()["sources"]["s"]
    assert st["ready_optional_rows"] == 0 and st["pending_pages"] == 0 and st["pages_repopulated"] == 0
    verify_resolves(h, truth, "r0")


def test_config_errors_name_the_value():
    with pytest.raises(ValueError, match="hot_cache_rows=0"):
        KVHierarchy([dict(name="s", row_bytes=3, page_size=2, device_pages=8, host_rows=40,
                          hot_cache_rows=0, tail_pages=1, max_req_slots=2, max_rows=20)])
    with pytest.raises(ValueError, match="reserve 6"):
        make(8, admission_reserve_pages=6)
    with pytest.raises(ValueError, match="largest_first"):
        make(8, reclaim_policy="fifo")
    with pytest.raises(ValueError, match="valid keys"):
        make(8, reserve=1)
    h, truth = make(8)
    with pytest.raises(ValueError, match="max_rows=41"):
        h.admit("r", 41)
    with pytest.raises(ValueError, match="uint8"):
        h.admit("r", 10, {"s": torch.zeros(3, W, dtype=torch.int8)})
    with pytest.raises(ValueError, match=r"\[n, 3\]"):
        h.admit("r", 10, {"s": torch.zeros(3, W + 1, dtype=torch.uint8)})
    with pytest.raises(ValueError, match="exceed max_rows=2"):
        h.admit("r", 2, {"s": torch.zeros(3, W, dtype=torch.uint8)})
    with pytest.raises(KeyError, match="'nope'"):
        h.admit("r", 10, {"nope": torch.zeros(3, W, dtype=torch.uint8)})
    with pytest.raises(KeyError, match="'ghost'"):
        h.append("ghost", "s", rows(1, 0))
