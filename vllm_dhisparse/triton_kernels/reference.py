"""Torch reference implementations of the resolver kernels.

These are the specification the Triton kernels (and ``resolve_torch``, the path
that runs where there is no GPU) are tested against.  They loop over
requests (the batch dimension) but are vectorised within a request.

Resolution contract (paper eq. 2, 6, 12), for one KV source:

* ``selections[n, j, i]`` is the i-th selected request-local row of query j of
  batch row n; -1 is padding.  A selection outside ``[-1, L)`` is invalid: it is
  treated as padding (location -1, nothing read) and counted in
  ``counters[n, COUNTER_INVALID]``.  L is ``seq_lens[s]`` (clamped to ``[0, P]``) when
  the request slots' lengths are given, else P = ``hot_slot_of.shape[1]``; with the lengths a
  selection can never reach a row the request has not written, so a caller that
  skips its own bounds check still reads nothing outside the request.
  ``req_slots[n]`` names the request slot of batch row n; -1 marks a padding row (CUDA-graph
  padding): every location is -1, counters are 0 and no state is touched.
* Lookup order per selection: direct map (tail + ready optional history,
  ``page_table``) -> hot cache (``hot_slot_of``) -> host.
* The union of a request's K queries is resolved once (eq. 6): each distinct
  missing row is fetched once, every selecting query gets its location.
* Misses are ordered by position (ascending, i.e. host-address order).
* Recency is a stamp per hot slot.  A call that reads the hot cache (a hit or a
  miss) takes the stamp ``c = hot_clock[s] + 1`` (int32, wrapping), stores it in
  ``hot_clock[s]`` and in ``hot_stamp[s, b]`` of every hot slot it hits or fills.
  Victims: among the hot slots whose stamp differs from ``c`` once this call's hits
  are stamped (hits of this call are protected), the ``n_fill`` with the largest
  age ``(c - stamp) mod 2**32``, ties to the lower hot slot; the i-th distinct miss
  takes the i-th victim in hot-slot order.  Misses beyond the available victims go,
  in the same order, to ``staging_rows[n]`` and do not enter the hot cache.
  Recency therefore has call granularity: deterministic and exact.  Any int32 is
  a valid stamp or clock (a wrapped or corrupt one only ages a hot slot), so neither
  table is ever used as an index and neither needs a check.
* Output ``locations[n, j, i]`` is a device row such that
  ``device_rows[locations] == original row selections[n, j, i]`` (eq. 12)
  once the gather of the returned miss list completed; -1 for padding.

Bounds safety.  Every index read from the three index tables is range-checked
before it is used; an entry out of range degrades to "empty" (the row is
fetched from host, which holds every row the hot cache or an optional page
could hold) and is counted in ``counters[n, COUNTER_REPAIRS]``.  Nothing is
ever read or written outside the request slot's own table rows and rows.  Per batch
row with request slot s, B hot slots, P positions and the source's pool at device rows
``[F, R)`` (F = 0 when the pool has a storage of its own; pools that share one storage
each bound their own tables, so a corrupt entry never names another source's rows or a
staging arena):

* ``req_slots[n]`` outside ``[-1, S)``: a padding row, one repair.
* ``hot_pos[s, b]`` outside ``[-1, P)``: the hot slot is emptied (set to -1), by calls
  with a miss (they read the whole row to choose victims; a bad entry can never make
  a hit, since a hit needs ``hot_pos[s, v]`` to equal a row in ``[0, P)``).
* ``page_table[s, p]`` outside ``{-1} ∪ [F, R - page_size]``: the page is
  treated as not ready in this call (the table is only read here; its owner
  republishes it).  Counted once per selection that reads it.
* ``hot_slot_of[s, pos]`` other than -1 that is not a consistent hit
  (``0 <= v < B`` and ``hot_pos[s, v] == pos``): the row is a miss and the
  entry is reset.  Counted once per non-direct selection that reads it.
* A filled hot slot unlinks its old row only where ``hot_slot_of`` points back.

``hot_loc``, ``staging_rows`` and ``host_base`` are the request's placement,
written once at admission from the allocators, and trusted.  ``R - page_size``
is taken as -1 when the pool has fewer rows than a page.
"""
from __future__ import annotations

import torch

# Columns of the per-row counter tensor returned by the resolver.
(COUNTER_DIRECT, COUNTER_HOT, COUNTER_HOST, COUNTER_FETCHED, COUNTER_REPAIRS,
 COUNTER_INVALID) = range(6)
NUM_COUNTERS = 6


def resolve_reference(
    selections: torch.Tensor,  # [N, K, k] int32, request-local rows, -1 pad
    req_slots: torch.Tensor,  # [N] int32 request slot of each batch row, -1 = padding row
    page_table: torch.Tensor,  # [S, max_pages] int32 device row of page start, -1 = not ready
    page_size: int,
    hot_pos: torch.Tensor,  # [S, B] int32 row held by each hot slot, -1 = empty (updated)
    hot_loc: torch.Tensor,  # [S, B] int32 device row of each hot slot
    hot_stamp: torch.Tensor,  # [S, B] int32 stamp of each hot slot's last use (updated)
    hot_clock: torch.Tensor,  # [S] int32 stamp of the request's last hot-cache call (updated)
    hot_slot_of: torch.Tensor,  # [S, P] int32 row -> hot slot, -1 = absent (updated)
    staging_rows: torch.Tensor,  # [N, C] int32 device rows for overflow misses
    host_base: torch.Tensor,  # [S] int64 host row of each request's row 0
    *,
    num_device_rows: int,  # R: end of the source's device rows (bounds page_table entries)
    first_device_row: int = 0,  # F: first of them (pools sharing one storage)
    seq_lens: torch.Tensor | None = None,  # [S] int32 rows written per request (bounds selections)
):
    """Returns ``(locations, miss_src, miss_dst, miss_count, counters)``.

    locations  [N, K, k] int32   device rows, -1 for padding
    miss_src   [N, K*k]  int64   host rows to copy (first miss_count[n] valid)
    miss_dst   [N, K*k]  int32   device rows they go to
    miss_count [N]       int32
    counters   [N, 6]    int32   direct / hot / host selections, distinct fetched, repairs,
                                 invalid selections
    """
    n_batch, n_queries, top_k = selections.shape
    dev = selections.device
    n_req_slots, hot_cache_rows = hot_pos.shape
    max_pos = hot_slot_of.shape[1]
    max_pages = page_table.shape[1]
    width = n_queries * top_k
    locations = torch.full_like(selections, -1)
    miss_src = torch.zeros(n_batch, width, dtype=torch.int64, device=dev)
    miss_dst = torch.full((n_batch, width), -1, dtype=torch.int32, device=dev)
    miss_count = torch.zeros(n_batch, dtype=torch.int32, device=dev)
    counters = torch.zeros(n_batch, NUM_COUNTERS, dtype=torch.int32, device=dev)
    arange_b = torch.arange(hot_cache_rows, device=dev)

    for n in range(n_batch):
        s = int(req_slots[n])  # request slot
        if not 0 <= s < n_req_slots:  # padding row
            counters[n, COUNTER_REPAIRS] = int(s != -1)
            continue
        sel = selections[n].reshape(-1).long()  # [K*k]
        limit = max_pos if seq_lens is None else min(max(int(seq_lens[s]), 0), max_pos)
        valid = (sel >= 0) & (sel < limit)
        invalid = int(((sel < -1) | (sel >= limit)).sum())
        pos = torch.where(valid, sel, 0)
        loc = torch.full((width,), -1, dtype=torch.int64, device=dev)

        # 1. direct: tail and ready optional-history pages
        page = pos // page_size
        in_table = page < max_pages
        page_base = torch.where(in_table, page_table[s, page.clamp(max=max_pages - 1)].long(), -1)
        pt_bad = valid & ((page_base < -1) | ((page_base >= 0) & (page_base < first_device_row))
                          | (page_base > max(num_device_rows - page_size, -1)))
        direct = valid & (page_base >= 0) & ~pt_bad
        loc[direct] = page_base[direct] + pos[direct] % page_size

        # 2. hot cache: a hit needs the hot slot to point back at the row
        v = hot_slot_of[s, pos].long()
        v_in = (v >= 0) & (v < hot_cache_rows)
        held = hot_pos[s, v.clamp(0, max(hot_cache_rows - 1, 0))].long() if hot_cache_rows else v
        nondirect = valid & ~direct
        hot = nondirect & v_in & (held == pos)
        hso_bad = nondirect & (v != -1) & ~hot
        repairs = int(pt_bad.sum()) + int(hso_bad.sum())
        loc[hot] = hot_loc[s, v[hot]].long()
        host = nondirect & ~hot
        stamp = None
        if bool(hot.any()) or bool(host.any()):  # the call reads the hot cache: new stamp
            stamp = _wrap32(int(hot_clock[s]) + 1)
            hot_clock[s] = stamp
            hot_stamp[s, v[hot]] = stamp

        # 3. distinct misses, ascending position, take the oldest unprotected hot slots (in
        #    hot-slot order); a call with a miss empties out-of-range hot_pos entries
        hot_slot_of[s, pos[host & (v != -1)]] = -1
        missing = torch.unique(pos[host])  # sorted ascending
        n_miss = missing.numel()
        if n_miss:
            hp_bad = (hot_pos[s] < -1) | (hot_pos[s] >= max_pos)
            repairs += int(hp_bad.sum())
            hot_pos[s, hp_bad] = -1
            free = hot_stamp[s] != stamp
            age = (stamp - hot_stamp[s].long()) & 0xFFFFFFFF
            oldest = arange_b[free][torch.sort(age[free], descending=True, stable=True).indices]
            n_hot_fill = min(n_miss, oldest.numel())
            fill_hot_slots = torch.sort(oldest[:n_hot_fill]).values
        else:
            n_hot_fill = 0
            fill_hot_slots = arange_b[:0]
        n_stage = n_miss - n_hot_fill
        if n_stage > staging_rows.shape[1]:
            raise ValueError(
                f"batch row {n}: {n_stage} overflow misses but staging_rows has "
                f"{staging_rows.shape[1]} columns; need >= K*k - B")
        fill_pos = missing[:n_hot_fill]
        old_pos = hot_pos[s, fill_hot_slots].long()
        linked = old_pos >= 0
        linked[linked.clone()] = hot_slot_of[s, old_pos[linked]].long() == fill_hot_slots[linked]
        hot_slot_of[s, old_pos[linked]] = -1
        hot_pos[s, fill_hot_slots] = fill_pos.to(hot_pos.dtype)
        hot_slot_of[s, fill_pos] = fill_hot_slots.to(hot_slot_of.dtype)
        if n_hot_fill:
            hot_stamp[s, fill_hot_slots] = stamp
        dst = torch.cat([hot_loc[s, fill_hot_slots].long(),
                         staging_rows[n, :n_stage].long()])

        # every selection of a missing row gets that row's location
        idx = torch.searchsorted(missing, pos[host])
        loc[host] = dst[idx]
        miss_src[n, :n_miss] = int(host_base[s]) + missing
        miss_dst[n, :n_miss] = dst.to(torch.int32)
        miss_count[n] = n_miss
        counters[n, COUNTER_DIRECT] = int(direct.sum())
        counters[n, COUNTER_HOT] = int(hot.sum())
        counters[n, COUNTER_HOST] = int(host.sum())
        counters[n, COUNTER_FETCHED] = n_miss
        counters[n, COUNTER_REPAIRS] = repairs
        counters[n, COUNTER_INVALID] = invalid
        locations[n] = loc.view(n_queries, top_k).to(locations.dtype)
    return locations, miss_src, miss_dst, miss_count, counters


def _wrap32(x: int) -> int:
    """x as a two's-complement int32."""
    return (x + 2**31) % 2**32 - 2**31


def gather_reference(
    host_rows: torch.Tensor,  # [R_host, W] any dtype, host (pinned) or device
    device_rows: torch.Tensor,  # [R_dev, W] same dtype (updated)
    miss_src: torch.Tensor,  # [N, M] int64 host rows
    miss_dst: torch.Tensor,  # [N, M] int32 device rows
    miss_count: torch.Tensor,  # [N] int32 valid prefix of each batch row
) -> None:
    """Copies ``host_rows[miss_src[n, :c]]`` to ``device_rows[miss_dst[n, :c]]``."""
    width = miss_src.shape[1]
    mask = torch.arange(width, device=miss_src.device)[None, :] < miss_count[:, None].long()
    src = miss_src[mask].to(host_rows.device)
    dst = miss_dst[mask].long().to(device_rows.device)
    if src.numel():
        device_rows[dst] = host_rows[src].to(device_rows.device, non_blocking=False)
