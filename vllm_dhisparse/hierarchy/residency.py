"""Load-adaptive residency of one KV source (paper 3.1): required, optional and pending pages.

Page states, per admitted request (every pool page in use is in exactly one):

* required — hot cache (B rows), tail (``tail_pages``).  Reserved at
  admission, never lent, freed at completion.  Verification staging is not
  per request: layers hold a shared ``staging_arena`` while they run.
* optional — a *complete page of imported history* kept on device, published
  in the direct map (ready).  Reclaimable.  Its host backup may be deferred.
* pending  — allocated for repopulation, host->device copy in flight, NOT
  published: the resolver serves those rows through hot cache / host until
  ``complete_populations`` publishes them (ready vs allocated, paper 3.1).

With M the pool's pages and M_res the admission reserve we keep

    M_req + M_opt + M_res <= M            (eq. 3; M_opt counts pending pages)

Admission needs Δ = required + reserve - free pages; when Δ > 0 it reclaims
the whole optional history of the first q requests of the reclaim order that
cover Δ (eq. 4), backing their device-only rows up first, or waits (reclaims
nothing) when all optional pages together cannot cover Δ.

Every row below ``seq_len`` is at all times ready on device (tail / optional
page) or host-backed: pages are unpublished only after their backup completed.
On CUDA the copies run on the host store's copy stream (``transfers.py``),
which first waits for the compute stream: a backup reads rows only after the
work that produced them, and a repopulation rewrites a freed page only after
the work that last read it.  Repopulated pages are published once their copy
is seen complete (polled, never waited for, between steps).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .device_pool import DevicePagePool
from .host_store import HostBackupError, HostStore
from .reclaim_policies import get_reclaim_policy, select_victims
from .request_pages import PendingPage, RequestPages, ResidencyCounters
from .sizing import hot_cache_pages, required_pages
from .source_state import SourceState
from .tail import TailWriter
from .transfers import Transfer


@dataclass
class ReclaimBatch:
    """Reclaims whose backups are in flight (``begin_reclaims`` -> ``finish_reclaims``)."""
    requests: list[RequestPages]
    backups: list  # [PendingBackup], one per run of consecutive pages, in issue order

    def wait(self) -> None:
        """Until every copy has finished (the pages stay in place)."""
        for pending in self.backups:
            pending.transfer.wait()


@dataclass
class AdmissionPlan:
    deficit: int  # Δ; <= 0 means no reclaim needed
    victims: list[str]  # eq. 4 prefix of the reclaim order


class ResidencyManager:
    def __init__(self, source: SourceState, pool: DevicePagePool, host: HostStore, *,
                 tail_pages: int, reserve_pages: int = 0,
                 policy: str = "largest_first", optional_residency: bool = True,
                 eager_backup: bool = False, last_active: dict[str, int] | None = None,
                 run_pages: int):
        """``last_active``: request -> last step it produced rows (the reclaim order reads
        it); a hierarchy shares one among its sources.  ``run_pages``: the most pages one
        copy of many pages moves, here and in the tail (``ResidencyConfig.run_pages``)."""
        ps = pool.page_size
        self.source, self.pool, self.host = source, pool, host
        self.page_size = ps
        self.hot_pages = hot_cache_pages(source.hot_cache_rows, ps)
        self.tail_pages = tail_pages
        self.required_per_request = required_pages(source.hot_cache_rows, ps, tail_pages)
        self.reserve = reserve_pages
        if self.required_per_request + reserve_pages > pool.num_pages:
            raise ValueError(
                f"source {source.name!r}: one request needs {self.required_per_request} required pages "
                f"(hot {self.hot_pages} + tail {tail_pages}) plus "
                f"reserve {reserve_pages}, but the pool has {pool.num_pages}; allowed "
                f"required + reserve <= device_pages")
        self.policy = get_reclaim_policy(policy)
        self.optional_residency = optional_residency
        self.eager_backup = eager_backup
        self.requests: dict[str, RequestPages] = {}
        self.last_active = {} if last_active is None else last_active
        self.counters = ResidencyCounters()
        self.run_pages = run_pages
        self.tail = TailWriter(source, pool, host, self.counters, self.requests, run_pages)
        self._admissions = 0
        self._cursor = 0  # round-robin position of repopulation, persists across steps
        # step() visits these, not every request: requests with copies in flight, and
        # requests known to have no page to repopulate (until a reclaim changes that)
        self._populating: dict[str, RequestPages] = {}
        self._settled: set[str] = set()
        # request -> its eligible pages not issued yet, lowest first (popped highest
        # first: recent history is the likeliest to be selected).  Listed on the
        # request's first turn after admission or a reclaim, the only events that make
        # pages eligible, and kept across steps: a step visits many requests for a few
        # pages each
        self._eligible_left: dict[str, list[int]] = {}

    # -- accounting (eq. 3) ---------------------------------------------------------
    def required_pages(self) -> int:
        return sum(r.required_pages for r in self.requests.values())

    def optional_pages(self) -> int:
        return sum(len(r.optional) for r in self.requests.values())

    def pending_pages(self) -> int:
        return sum(len(r.pending) for r in self.requests.values())

    def request(self, req_id: str) -> RequestPages:
        if req_id not in self.requests:
            raise KeyError(f"source {self.source.name!r}: unknown request id {req_id!r}")
        return self.requests[req_id]

    # -- admission ------------------------------------------------------------------
    def plan_admission(self, max_rows: int) -> AdmissionPlan | None:
        """What admitting a request would reclaim (eq. 4), or None = wait.  Changes nothing."""
        if len(self.source.open_requests) >= self.source.max_req_slots:
            return None
        if not self.host.can_allocate(max_rows):
            return None
        deficit = self.required_per_request + self.reserve - self.pool.num_free  # Δ
        if deficit <= 0:
            return AdmissionPlan(deficit, [])
        last = self.last_active.get
        # only holders of optional pages can cover Δ; an admission lists them every time,
        # as plain tuples in ReclaimCandidate's field order (a NamedTuple each cost more)
        candidates = [(r.req_id, r.admitted, last(r.req_id, 0), a) for r in self.requests.values()
                      if (a := r.held_optional)]
        victims = select_victims(self.policy, candidates, deficit)
        return None if victims is None else AdmissionPlan(deficit, victims)

    def reclaim(self, req_id: str) -> int:
        """Returns all optional and pending pages of ``req_id`` to the pool (backup first)."""
        return self.finish_reclaims(self.begin_reclaims([req_id]))

    def begin_reclaims(self, req_ids: list[str]) -> ReclaimBatch:
        """Issues the host backups of the device-only rows of ``req_ids`` (the eq. 4
        victims of one admission): one gather and one pass over the copy stream per
        ``run_pages`` pages of all of them, one event each.  Every request's host
        destinations are taken first, so a request whose backup cannot start raises
        ``HostBackupError`` (its ``req_id`` set) before anything is issued.  Nothing
        is freed or unpublished until ``finish_reclaims``."""
        ps = self.page_size
        recs = [self.request(r) for r in req_ids]
        runs = []  # (request, consecutive history pages, host destination)
        for rec in recs:
            try:
                runs += [(rec, run, dst) for run in _runs(self._unbacked(rec), self.run_pages)
                         for dst in self.host.backup_slices(rec.req_id, [run[0] * ps],
                                                            len(run) * ps)]
            except HostBackupError as e:
                e.req_id = e.req_id or rec.req_id
                raise
        backups, chunk, size = [], [], 0
        try:
            for i, (rec, run, dst) in enumerate(runs):  # chunks of whole runs, <= run_pages
                chunk.append((rec, run, dst))
                size += len(run)
                if i + 1 < len(runs) and size + len(runs[i + 1][1]) <= self.run_pages:
                    continue
                src = self.pool.page_planes([r.optional[p] for r, run_, _ in chunk for p in run_])
                backups += self.host.prepare_backups(
                    [(r.req_id, run_[0] * ps, d) for r, run_, d in chunk], src)
                chunk, size = [], 0
        except BaseException:  # the caller may free the extents: no copy may still write them
            for pending in backups:
                pending.transfer.wait()
            raise
        return ReclaimBatch(recs, backups)

    def finish_reclaims(self, batch: ReclaimBatch) -> int:
        """Completes ``begin_reclaims``: waits for its backups (the copy stream runs them in
        issue order), then unpublishes the requests' optional pages in one write --
        later lookups go to hot cache / host, which has the rows -- and frees them with
        their pending pages.  Returns the pages freed."""
        for pending in batch.backups:
            self.host.complete_backup(pending)
            self.counters.host_pages_written += pending.count // self.page_size
        req_slots, pages, freed = [], [], []
        for rec in batch.requests:
            self._settled.discard(rec.req_id)  # its dropped pages are eligible again
            self._eligible_left.pop(rec.req_id, None)
            req_slots += [self.source.req_slot(rec.req_id)] * len(rec.optional)
            pages += list(rec.optional)
        self.source.unpublish_pages(req_slots, pages)
        for rec in batch.requests:
            self._wait_populations(rec)  # pending pages are host-backed already; just drop them
            got = list(rec.optional.values()) + [p.device_page for p in rec.pending.values()]
            rec.optional.clear()
            rec.pending.clear()
            self._populating.pop(rec.req_id, None)
            self.pool.free(got)
            self.counters.requests_reclaimed += 1
            self.counters.pages_reclaimed += len(got)
            freed += got
        return len(freed)

    def _complete_pages(self, rec: RequestPages) -> np.ndarray:
        """Which complete imported pages have a host copy.  # [eligible_pages] bool
        (numpy: repopulation lists pages of many requests per step, and small torch ops
        on the host cost several times more)"""
        full, ps = rec.eligible_pages, self.page_size
        return self.host.backed(rec.req_id).numpy()[:full * ps].reshape(full, ps).all(1)

    def _unbacked(self, rec: RequestPages) -> list[int]:
        """Optional pages without a host copy (deferred backups), ascending."""
        if not rec.optional:
            return []
        pages = np.array(sorted(rec.optional), dtype=np.int64)
        return pages[~self._complete_pages(rec)[pages]].tolist()

    def admit(self, req_id: str, max_rows: int, imported: torch.Tensor | None,
              host_writes: list) -> RequestPages:
        """Reserves required pages, opens the request slot and places imported history.

        Call after ``plan_admission`` returned a plan and its victims were reclaimed.
        The host copies of imported rows are only issued, appended to ``host_writes``;
        the caller completes them (``complete_host_writes``) before the request is used,
        or waits for them before it is released: many sources' copies share one wait.
        """
        pages = self.pool.allocate(self.required_per_request)
        assert pages is not None and self.pool.num_free >= self.reserve, \
            f"source {self.source.name!r}: admission of {req_id!r} without a plan covering Δ"
        host_base = self.host.allocate(req_id, max_rows)
        assert host_base is not None, f"host store {self.host.name!r}: extent vanished after plan"
        hot = pages[:self.hot_pages]
        tail = pages[self.hot_pages:]
        n = 0 if imported is None else imported.shape[0]
        hot_loc = self.pool.page_rows(hot)[:self.source.hot_cache_rows]
        self.source.open_req_slot(req_id, hot_loc, host_base)
        rec = RequestPages(req_id, self._admissions, max_rows, n // self.page_size,
                           hot, tail[::-1])
        self._admissions += 1
        self.requests[req_id] = rec
        self.tail.open(rec)
        if n:
            self._place_imported(rec, imported, host_writes)
        return rec

    def _place_imported(self, rec: RequestPages, imported: torch.Tensor,
                        host_writes: list) -> None:
        """Resident-first admission (paper 3.1)."""
        ps, full = self.page_size, rec.eligible_pages
        keep = 0
        if self.optional_residency:  # only room above required + reserve is lent
            keep = max(0, min(full, self.pool.num_free - self.reserve))
        # Keep the pages nearest the tail: recent history is the likeliest to be selected.
        first_kept = full - keep
        dev_pages = self.pool.allocate(keep)
        if keep:  # a write per run of kept pages, one publish
            for a in range(0, keep, self.run_pages):
                chunk = dev_pages[a:a + self.run_pages]
                first = (first_kept + a) * ps
                self.pool.write(self.pool.page_rows(chunk), imported[first:first + len(chunk) * ps])
            kept = list(range(first_kept, full))
            rec.optional.update(zip(kept, dev_pages))
            self.source.publish_pages([self.source.req_slot(rec.req_id)] * keep, kept,
                                      [self.pool.first_row(d) for d in dev_pages])
        if self.eager_backup:
            self._write_host(rec, imported, first_kept * ps, full * ps, host_writes)
        else:  # deferred: done only if this request is reclaimed
            self.counters.host_backups_deferred += keep
        self._write_host(rec, imported, 0, first_kept * ps, host_writes)  # did not fit
        self.source.set_seq_len(rec.req_id, full * ps)
        if imported.shape[0] > full * ps:  # the partial boundary page goes to the tail
            self.tail.append(rec, imported[full * ps:])

    def _write_host(self, rec: RequestPages, data: torch.Tensor, start: int, end: int,
                    writes: list) -> None:
        if end > start:
            writes.append(self.host.prepare_backup(rec.req_id, start, data[start:end]))

    def complete_host_writes(self, writes: list) -> None:
        """Waits for issued host copies of imported rows; their rows count as backed."""
        for pending in writes:
            self.host.complete_backup(pending)
            self.counters.host_pages_written += pending.count // self.page_size

    # -- repopulation -----------------------------------------------------------------
    def _eligible(self, rec: RequestPages) -> list[int]:
        """Complete imported pages that are host-backed and not on device, highest first
        (recent history is the likeliest to be selected)."""
        if rec.eligible_pages == 0 or rec.held_optional >= rec.eligible_pages:
            return []
        ok = self._complete_pages(rec)
        taken = list(rec.optional) + list(rec.pending)
        if taken:
            ok[np.array(taken, dtype=np.int64)] = False
        return np.flatnonzero(ok)[::-1].tolist()

    def repopulate(self, max_pages: int) -> int:
        """Issues up to ``max_pages`` page copies, one page per request per turn, round-robin
        from a cursor that persists across calls (a small bound still reaches every
        request).  Pages stay pending, unpublished, until ``complete_populations``."""
        if not self.optional_residency or not self.requests:
            return 0
        order = list(self.requests)
        limit = min(max_pages, self.pool.num_free - self.reserve)
        issued = idle = 0
        chosen: list[tuple[RequestPages, int, int]] = []  # (request, history page, device page)
        while issued < limit and idle < len(order):
            i = self._cursor % len(order)
            self._cursor = i + 1
            rec = self.requests[order[i]]
            page = None
            if rec.req_id not in self._settled:
                pages = self._eligible_left.get(rec.req_id)
                if pages is None:
                    pages = self._eligible_left[rec.req_id] = self._eligible(rec)[::-1]
                page = pages.pop() if pages else None
            if page is None:
                self._settled.add(rec.req_id)
                self._eligible_left.pop(rec.req_id, None)
                idle += 1
                continue
            idle = 0
            chosen.append((rec, page, self.pool.allocate(1)[0]))
            issued += 1
        if chosen:  # one copy for every page of the call
            ps = self.page_size
            src = [self.host.row_of(rec.req_id, page * ps, ps) for rec, page, _ in chosen]
            dst = [self.pool.first_row(dev) for _, _, dev in chosen]
            try:
                transfer = self.host.copies.pages_to_device(self.host.rows, self.pool.planes,
                                                            src, dst, ps)
            except BaseException:  # nothing was issued: the pages go back, and are listed again
                self.pool.free([dev for _, _, dev in chosen])
                for rec, _, _ in chosen:
                    self._eligible_left.pop(rec.req_id, None)
                    self._settled.discard(rec.req_id)
                raise
            for rec, page, dev in chosen:
                rec.pending[page] = PendingPage(dev, transfer)
                self._populating[rec.req_id] = rec
        return issued

    def _wait_populations(self, rec: RequestPages) -> None:
        for p in rec.pending.values():
            p.transfer.wait()

    def complete_populations(self) -> int:
        """Publishes pending pages whose copy has finished (polled: a copy still in flight
        stays pending, its rows served by hot cache / host meanwhile)."""
        req_slots, pages, rows = [], [], []
        done: dict[int, bool] = {}  # a call's pages share one transfer: query it once

        def finished(t: Transfer) -> bool:
            if id(t) not in done:
                done[id(t)] = t.done()
            return done[id(t)]

        for rec in list(self._populating.values()):
            req_slot = self.source.req_slot(rec.req_id)
            for page in sorted(page for page, p in rec.pending.items() if finished(p.transfer)):
                p = rec.pending.pop(page)
                rec.optional[page] = p.device_page
                req_slots.append(req_slot)
                pages.append(page)
                rows.append(self.pool.first_row(p.device_page))
            if not rec.pending:
                del self._populating[rec.req_id]
        self.source.publish_pages(req_slots, pages, rows)  # one write for every page
        self.counters.pages_repopulated += len(pages)
        return len(pages)

    # -- release ----------------------------------------------------------------------
    def release(self, req_id: str) -> None:
        """Completion / preemption: device pages, request slot and host extent all go back."""
        rec = self.request(req_id)
        for _, pending in rec.backups:  # copies still reading tail pages must finish first
            pending.transfer.wait()
        self._wait_populations(rec)
        del self.requests[req_id]
        self._populating.pop(req_id, None)
        self._settled.discard(req_id)
        self._eligible_left.pop(req_id, None)
        self.tail.forget(req_id)
        self.pool.free(rec.owned_pages())
        self.source.close_req_slot(req_id)
        self.host.free(req_id)


def _runs(pages: list[int], most: int) -> list[list[int]]:
    """Ascending ``pages`` cut into runs of consecutive pages, each at most ``most`` long
    (one host copy each: the host rows of consecutive history pages are contiguous)."""
    runs: list[list[int]] = []
    for p in pages:
        if runs and p == runs[-1][-1] + 1 and len(runs[-1]) < most:
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs
