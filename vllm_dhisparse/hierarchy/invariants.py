"""check_invariants: the hierarchy's safety properties, checked from the outside (tests, the
sessions benchmark).

(a) Every row below ``seq_len`` of every admitted request and source is ready
    on device (its page published in the direct map) or has a complete host
    copy (paper 3.1, D_r ⊆ H_r of eq. 6).  With ``truth`` every claimed copy
    must hold the original bytes: device rows of published pages, host rows
    marked backed.
(b) The hot cache is coherent: ``hot_pos`` and ``hot_slot_of`` are inverse, no
    hot slot carries a stamp ahead of its clock, and the device rows at
    ``hot_loc`` hold the original rows they claim (eq. 12 for hot hits).
(c) No pending page is published (ready vs allocated), and the direct map
    publishes exactly the tail and ready optional pages.
(d) Pool accounting: pages in use = Σ required + optional + pending, no page
    owned twice, and M_req + M_opt + M_res <= M (eq. 3).
(e) Staging arenas are held only while a layer runs: none is held between
    operations.  No table points into an arena: (b) and (c) tie hot rows and
    published pages to the request's own pool pages, so releasing an arena
    never needs a copy back.

``truth`` maps ``req_id -> source name -> uint8 [seq_len, row_bytes]``.
Raises AssertionError naming the source, request, row and what is wrong.
"""
from __future__ import annotations

from typing import Mapping

import torch

from .hierarchy import KVHierarchy


def _first(mask: torch.Tensor) -> int:
    return int(mask.nonzero().flatten()[0])


def check_invariants(h: KVHierarchy, truth: Mapping[str, Mapping[str, torch.Tensor]] | None = None) -> None:
    for name, parts in h.sources.items():
        st, pool, host, rm = parts.state, parts.pool, parts.host, parts.residency
        ps, hot_cache_rows = parts.spec.page_size, st.hot_cache_rows
        assert set(rm.requests) == set(h.requests) == set(st.open_requests), (
            f"source {name!r}: admitted sets disagree: residency {sorted(rm.requests)}, "
            f"hierarchy {sorted(h.requests)}, request slots {sorted(st.open_requests)}")
        owned: dict[int, str] = {}
        for req_id, rec in rm.requests.items():
            where = f"source {name!r} request {req_id!r}"
            s = st.req_slot(req_id)
            n = st.seq_len(req_id)
            table = st.page_table[s].cpu()

            # (d) ownership
            for page in rec.owned_pages():
                assert page not in owned, f"{where}: device page {page} also owned by {owned[page]!r}"
                owned[page] = req_id

            # (c) direct map = tail + ready optional, pending never published
            for page, p in rec.pending.items():
                assert int(table[page]) < 0, (
                    f"{where}: pending page (history page {page}, device page {p.device_page}) "
                    f"is published at device row {int(table[page])} before its copy completed")
                assert page not in rec.optional and page not in rec.tail, \
                    f"{where}: history page {page} is pending and also ready"
            expect = {**{p: d for p, d in rec.optional.items()}, **{p: d for p, d in rec.tail.items()}}
            assert not set(rec.optional) & set(rec.tail), \
                f"{where}: history pages {sorted(set(rec.optional) & set(rec.tail))} both optional and tail"
            published = {int(p) for p in (table >= 0).nonzero().flatten()}
            assert published == set(expect), (
                f"{where}: direct map publishes pages {sorted(published)}, expected tail "
                f"{sorted(rec.tail)} + optional {sorted(rec.optional)}")
            for page, dev in expect.items():
                assert int(table[page]) == pool.first_row(dev), (
                    f"{where}: history page {page} published at row {int(table[page])}, "
                    f"owns device page {dev} (row {pool.first_row(dev)})")
            for page in rec.optional:
                assert page < rec.eligible_pages, (
                    f"{where}: optional page {page} is not a complete imported page "
                    f"(only {rec.eligible_pages} are eligible)")

            # (a) every row ready on device or host-backed; every claimed copy exact
            ready = torch.zeros(n, dtype=torch.bool)
            dev_row = torch.full((n,), -1, dtype=torch.int64)
            if n:
                pos = torch.arange(n)
                base = table[pos // ps].long()
                ready = base >= 0
                dev_row = torch.where(ready, base + pos % ps, dev_row)
            backed = host.backed(req_id)[:n]
            lost = ~ready & ~backed
            assert not bool(lost.any()), (
                f"{where}: row {_first(lost)} (of seq_len {n}) is neither ready on device nor "
                f"host-backed")
            t = None
            if truth is not None:
                assert req_id in truth and name in truth[req_id], \
                    f"{where}: admitted but missing from the truth given to check_invariants"
                t = truth[req_id][name]
            if t is not None:
                assert t.shape[0] == n, f"{where}: seq_len {n} but truth has {t.shape[0]} rows"
                if bool(ready.any()):
                    got = pool.read(dev_row[ready]).cpu()
                    bad = (got != t[ready]).any(1)
                    assert not bool(bad.any()), (
                        f"{where}: device copy of row {int(ready.nonzero().flatten()[_first(bad)])} "
                        f"differs from the original")
                if bool(backed.any()):
                    got = host.read(req_id, backed.nonzero().flatten())
                    bad = (got != t[backed]).any(1)
                    assert not bool(bad.any()), (
                        f"{where}: host copy of row {int(backed.nonzero().flatten()[_first(bad)])} "
                        f"is marked backed but differs from the original")

            # (b) hot cache coherence
            hot_pos = st.hot_pos[s].cpu().long()
            slot_of = st.hot_slot_of[s].cpu().long()
            # a stamp is at most the clock (ages mod 2**32 below 2**31: any wrap is fine)
            age = (int(st.hot_clock[s]) - st.hot_stamp[s].cpu().long()) & 0xFFFFFFFF
            ahead = age >= 2**31
            assert not bool(ahead.any()), (
                f"{where}: hot slots {ahead.nonzero().flatten().tolist()} carry stamps ahead "
                f"of the clock {int(st.hot_clock[s])}")
            held = hot_pos >= 0
            assert bool((hot_pos[held] < n).all()), \
                f"{where}: hot cache holds rows {hot_pos[held].tolist()} at/after seq_len {n}"
            for j in held.nonzero().flatten().tolist():
                assert int(slot_of[hot_pos[j]]) == j, (
                    f"{where}: hot slot {j} holds row {int(hot_pos[j])} but hot_slot_of says "
                    f"{int(slot_of[hot_pos[j]])}")
            mapped = (slot_of >= 0).nonzero().flatten()
            for r in mapped.tolist():
                assert int(hot_pos[slot_of[r]]) == r, (
                    f"{where}: hot_slot_of[{r}] = {int(slot_of[r])} but that hot slot holds "
                    f"{int(hot_pos[slot_of[r]])}")
            hot_dev = st.hot_loc[s].cpu().long()
            expect_hot = pool.page_rows(rec.hot)[:hot_cache_rows]
            assert torch.equal(hot_dev, expect_hot), \
                f"{where}: hot_loc {hot_dev.tolist()} are not the request's hot pages {rec.hot}"
            if t is not None and bool(held.any()):
                got = pool.read(hot_dev[held]).cpu()
                bad = (got != t[hot_pos[held]]).any(1)
                assert not bool(bad.any()), (
                    f"{where}: hot slot {int(held.nonzero().flatten()[_first(bad)])} holds stale bytes "
                    f"for row {int(hot_pos[held][_first(bad)])}")

            # host extent is this request's
            assert int(st.host_base[s]) == host.base(req_id), \
                f"{where}: host_base {int(st.host_base[s])} != extent base {host.base(req_id)}"

        # (d) accounting and eq. 3
        in_use = pool.num_pages - pool.num_free
        req, opt, pend = rm.required_pages(), rm.optional_pages(), rm.pending_pages()
        assert in_use == req + opt + pend == len(owned), (
            f"source {name!r}: pool has {in_use} pages in use but requests own {len(owned)} "
            f"(required {req} + optional {opt} + pending {pend})")
        assert set(owned) == pool._used, (
            f"source {name!r}: pool pages in use {sorted(pool._used)} differ from owned {sorted(owned)}")
        assert req + opt + pend + rm.reserve <= pool.num_pages, (
            f"source {name!r}: eq. 3 violated: M_req {req} + M_opt {opt + pend} + M_res "
            f"{rm.reserve} > M {pool.num_pages}")
        free_req_slots = set(range(st.max_req_slots)) - {st.req_slot(r) for r in rm.requests}
        for s in free_req_slots:
            assert bool((st.page_table[s] < 0).all()), \
                f"source {name!r}: closed request slot {s} still publishes pages"
    for arenas in h.staging:
        assert not arenas.live_sources(), (
            f"staging arenas of {arenas.rows.name!r} still held by {arenas.live_sources()} "
            f"between operations")
