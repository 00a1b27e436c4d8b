"""The mutable tail of one request/source: newly computed rows until they are host-backed.

Each admitted request reserves ``tail_pages`` device pages per source
(required, never lent).  A tail page is bound to one history page index and is
published in the direct map while it holds rows, so the resolver reads tail
rows directly (paper Figure 2, callout 1).  Rows are append-only.

Life of a tail page:

1. ``append`` binds a free reserved page to history page ``pos // page_size``,
   writes the rows, publishes it, then raises ``seq_len`` (the resolver never
   reads at or past ``seq_len``, so the order keeps readers safe).
2. Once a page is complete, ``step()`` issues its host copy (two-phase
   ``prepare_backups``, on the copy stream), together with every other request's
   pages that completed: one gather and one event for all.  It stays published
   meanwhile: its rows have no complete host copy yet.
3. ``finish_backups`` (a later ``step()``) completes the copies that have
   finished (polled: one still in flight waits for the next step), unpublishes
   the pages (one write for all requests) and returns them to the requests' free
   tail pages.  From then on
   those rows resolve through the hot cache / host (decoded rows follow
   hot-cache rules, paper 3.1).  The partial last page never leaves the tail.

If ``append`` needs a page while all are bound, it backs up synchronously
(``flush``) first; every bound page except the current one is complete then,
so at least one page comes free.

``step()`` visits only the requests in ``backing`` (``advance``): a request enters
when an append completes one of its pages and leaves once none of its copies is in
flight, so a step costs what the tails that changed cost, not one visit per request.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .device_pool import DevicePagePool
from .devices import host_index
from .host_store import HostBackupError, HostStore
from .source_state import SourceState

if TYPE_CHECKING:
    from .request_pages import RequestPages, ResidencyCounters


class TailWriter:
    def __init__(self, source: SourceState, pool: DevicePagePool, host: HostStore,
                 counters: "ResidencyCounters", requests: dict[str, "RequestPages"],
                 run_pages: int):
        self.source = source
        self.pool = pool
        self.host = host
        self.counters = counters
        self.page_size = pool.page_size
        self.run_pages = run_pages  # pages per backup pass of a step
        self._requests = requests  # the residency manager's, by request id
        # per request slot, on the host: max_rows, and the tail page holding the last row
        # (history page, first device row; -1 = none), which append_batch writes into
        # without planning while a request stays inside it
        self._max_rows = np.zeros(source.max_req_slots, dtype=np.int64)
        self._cur_page = np.full(source.max_req_slots, -1, dtype=np.int64)
        self._cur_row = np.zeros(source.max_req_slots, dtype=np.int64)
        # requests with complete tail pages not yet backed up, or copies in flight
        self.backing: dict[str, "RequestPages"] = {}

    def append(self, rec: "RequestPages", rows: torch.Tensor) -> None:
        """Writes ``rows`` ([n, row_bytes] uint8) after the request's current last row."""
        src, ps = self.source, self.page_size
        n = rows.shape[0]
        pos = self._check_room(rec, n)
        self._note_complete(rec, pos, pos + n)
        i = 0
        while i < n:
            page = pos // ps
            dev = rec.tail.get(page)
            new_page = dev is None
            if new_page:
                if not rec.tail_free:
                    self.flush(rec)
                assert rec.tail_free, f"request {rec.req_id!r}: tail flush freed no page"
                dev = rec.tail_free.pop()
            take = min(n - i, ps - pos % ps)
            start = self.pool.first_row(dev) + pos % ps
            self.pool.write_range(start, rows[i:i + take])
            if new_page:  # publish only after the bytes are in place
                rec.tail[page] = dev
                src.publish_page(rec.req_id, page, self.pool.first_row(dev))
            pos += take
            i += take
            src.set_seq_len(rec.req_id, pos)
        if n:
            self._set_current(src.req_slot(rec.req_id), rec)

    def open(self, rec: "RequestPages") -> None:
        """The request has just got its request slot."""
        req_slot = self.source.req_slot(rec.req_id)
        self._max_rows[req_slot] = rec.max_rows
        self._cur_page[req_slot] = -1

    def _set_current(self, req_slot: int, rec: "RequestPages") -> None:
        last = (self.source.seq_len_at(req_slot) - 1) // self.page_size
        dev = rec.tail.get(last)
        self._cur_page[req_slot] = -1 if dev is None else last
        self._cur_row[req_slot] = 0 if dev is None else self.pool.first_row(dev)

    def _note_complete(self, rec: "RequestPages", old_len: int, new_len: int) -> None:
        if new_len // self.page_size > old_len // self.page_size:  # a page completed
            self.backing[rec.req_id] = rec

    def _check_room(self, rec: "RequestPages", n: int) -> int:
        """The request's length, after checking ``n`` more rows fit its max_rows."""
        pos = self.source.seq_len(rec.req_id)
        if pos + n > rec.max_rows:
            raise ValueError(f"source {self.source.name!r}: request {rec.req_id!r} has {pos} "
                             f"rows; appending {n} exceeds its max_rows {rec.max_rows}")
        return pos

    def append_batch(self, req_ids: list[str], rows: torch.Tensor,
                     counts) -> dict[str, Exception]:
        """``append`` for many requests at once: ``counts[i]`` rows of ``rows`` ([T,
        row_bytes] uint8, requests in order) go to ``req_ids[i]`` (counts: [N] ints).  The
        device sees one write of every row, one publish of the new tail pages and one write
        of the lengths, in that order (bytes before they are published, lengths last, as
        ``append``).  Requests whose rows stay inside their current tail page (the
        decode case, a page boundary every ``page_size`` rows) are planned on arrays;
        the others page by page.  A request that needs a tail page while all of its
        pages wait for their backup takes ``append``'s synchronous path after the batch;
        what that path raises is returned per request (the others are appended)."""
        src, ps = self.source, self.page_size
        req_slots = src.req_slot_array(req_ids)  # [N] int64
        cnt = np.asarray(counts, dtype=np.int64).reshape(-1)  # [N]
        lens = src.seq_lens_of(req_slots)  # [N]
        end = lens + cnt
        over = np.flatnonzero(end > self._max_rows[req_slots])
        if over.size:  # all checked before anything changes
            i = int(over[0])
            raise ValueError(f"source {src.name!r}: request {req_ids[i]!r} has {int(lens[i])} "
                             f"rows; appending {int(cnt[i])} exceeds its max_rows "
                             f"{int(self._max_rows[req_slots[i]])}")
        first = np.cumsum(cnt) - cnt  # [N] the request's first row in ``rows``
        page = lens // ps
        # inside the page the request is writing: one device row per row, no binding
        fast = (cnt > 0) & ((end - 1) // ps == page) & (self._cur_page[req_slots] == page)
        dst = np.full(rows.shape[0], -1, dtype=np.int64)  # [T] device row, -1 = not here
        if fast.any():
            f_cnt = cnt[fast]
            within = np.arange(int(f_cnt.sum())) - np.repeat(np.cumsum(f_cnt) - f_cnt, f_cnt)
            dst[np.repeat(first[fast], f_cnt) + within] = \
                np.repeat(self._cur_row[req_slots[fast]] + lens[fast] % ps, f_cnt) + within
        kept = cnt > 0
        slow, bind = [], []
        pub = ([], [], [])
        for i in np.flatnonzero(kept & ~fast):
            rec = self._requests[req_ids[i]]
            pos, n, a = int(lens[i]), int(cnt[i]), int(first[i])
            new_pages = sum(p not in rec.tail for p in range(pos // ps, (pos + n - 1) // ps + 1))
            if new_pages > len(rec.tail_free):
                slow.append((rec, a, n))
                kept[i] = False
                continue
            free = list(rec.tail_free)  # popped as append pops, bound after the device work
            planned = {}
            stop = pos + n
            while pos < stop:
                pg = pos // ps
                dev = rec.tail.get(pg, planned.get(pg))
                if dev is None:
                    dev = planned[pg] = free.pop()
                    bind.append((rec, int(req_slots[i]), pg, dev))
                    for lst, v in zip(pub, (int(req_slots[i]), pg, self.pool.first_row(dev))):
                        lst.append(v)
                take = min(stop - pos, ps - pos % ps)
                row = self.pool.first_row(dev) + pos % ps
                dst[a:a + take] = np.arange(row, row + take)
                a += take
                pos += take
        # device work first: if it raises, no request's pages or length changed (a page
        # published here holds rows at or past its length only, which nothing reads)
        here = dst >= 0
        if here.any():
            data = rows if here.all() else rows[torch.from_numpy(here)]
            self.pool.write(host_index(dst[here], self.pool.device), data)
        src.publish_pages(*pub)
        src.set_seq_lens(req_slots[kept], end[kept])
        for rec, req_slot, pg, dev in bind:
            rec.tail_free.remove(dev)
            rec.tail[pg] = dev
            self._set_current(req_slot, rec)
        for i in np.flatnonzero(kept & (end // ps > page)):  # pages that completed
            self.backing[req_ids[i]] = self._requests[req_ids[i]]
        failed = {}
        for rec, a, n in slow:
            try:
                self.append(rec, rows[a:a + n])
            except Exception as e:  # noqa: BLE001 -- e.g. its backup failed: it alone
                failed[rec.req_id] = e
        return failed

    def advance(self) -> dict[str, str]:
        """``step()``'s part for the tails: for each request in ``backing``, finished copies
        leave the tail and newly completed pages start theirs.  A failed backup is
        returned per request (request -> error); the others proceed."""
        recs = list(self.backing.values())
        unpublished: tuple[list[int], list[int]] = ([], [])
        for rec in recs:
            self.finish_backups(rec, unpublished=unpublished)  # backed pages leave the tail
        self.source.unpublish_pages(*unpublished)  # one write for every request's pages
        errors: dict[str, Exception] = {}
        self._start(recs, errors)  # newly completed pages of every request: one copy pass
        for rec in recs:
            if rec.req_id not in errors and not rec.backups:
                del self.backing[rec.req_id]
        return {rid: str(e) for rid, e in errors.items()}

    def forget(self, req_id: str) -> None:
        """The request was released."""
        self.backing.pop(req_id, None)

    def start_backups(self, rec: "RequestPages") -> int:
        """Issues host copies of the request's complete tail pages not already in flight
        (raises what its backup raised)."""
        errors: dict[str, Exception] = {}
        issued = self._start([rec], errors)
        if errors:
            raise errors[rec.req_id]
        return issued

    def _start(self, recs: list["RequestPages"], errors: dict[str, Exception]) -> int:
        """Host copies of the complete tail pages of ``recs`` not already in flight: one
        gather of their device rows and one pass over the copy stream per
        run (``run_pages`` pages).  A request whose backup fails is in ``errors`` and gets
        no copy; the others are issued."""
        ps = self.page_size
        items, devs = [], []
        for rec in recs:
            complete = self.source.seq_len(rec.req_id) // ps
            in_flight = {p for p, _ in rec.backups}
            new = [(page, dev) for page, dev in sorted(rec.tail.items())
                   if page < complete and page not in in_flight]
            if not new:
                continue
            try:
                dsts = self.host.backup_slices(rec.req_id, [page * ps for page, _ in new], ps)
            except HostBackupError as e:
                errors[rec.req_id] = e
                continue
            for (page, dev), dst in zip(new, dsts):
                items.append((rec, page, dst))
                devs.append(dev)
        for a in range(0, len(items), self.run_pages):
            batch = items[a:a + self.run_pages]
            src = self.pool.page_planes(devs[a:a + self.run_pages])
            pending = self.host.prepare_backups(
                [(rec.req_id, page * ps, dst) for rec, page, dst in batch], src)
            for (rec, page, _), p in zip(batch, pending):
                rec.backups.append((page, p))
        return len(items)

    def finish_backups(self, rec: "RequestPages", wait: bool = False,
                       unpublished: tuple[list[int], list[int]] | None = None) -> None:
        """Completes the issued copies that have finished (all of them with ``wait``); each
        backed page leaves the tail (unpublished, freed).  Copies complete in issue order.
        With ``unpublished`` (request slots, pages) the caller unpublishes the pages, in one write
        for many requests, before anything else touches the tables."""
        req_slot = self.source.req_slot(rec.req_id)
        done = []
        while rec.backups:
            page, pending = rec.backups[0]
            if not wait and not self.host.backup_done(pending):
                break
            self.host.complete_backup(pending)  # rows are backed from here on
            rec.backups.pop(0)
            done.append(page)
            rec.tail_free.append(rec.tail.pop(page))
            self.counters.host_pages_written += 1
        if unpublished is None:
            self.source.unpublish_pages(req_slot, done)
        else:
            unpublished[0].extend([req_slot] * len(done))
            unpublished[1].extend(done)

    def flush(self, rec: "RequestPages") -> None:
        """Synchronous path for a full tail: back up every complete page now."""
        self.finish_backups(rec, wait=True)
        if not rec.tail_free:
            self.start_backups(rec)
            self.finish_backups(rec, wait=True)
