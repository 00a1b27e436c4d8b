"""Torch reference implementations of the resolver kernels.

These are the specification the Triton kernels are tested against and the
path that runs where there is no GPU (vLLM's CPU backend, CI).  They loop over
requests (the batch dimension) but are vectorised within a request.

Resolution contract (paper eq. 2, 6, 12), for one KV source:

* ``selections[n, j, i]`` is the i-th selected request-local row of query j of
  batch row n (-1 = padding).  ``slot_ids[n]`` names the request slot.
* Lookup order per selection: direct map (tail + ready optional history,
  ``page_table``) -> hot cache (``hot_slot_of``) -> host.
* The union of a request's K queries is resolved once (eq. 6): each distinct
  missing row is fetched once, every selecting query gets its location.
* Misses are ordered by position (ascending, i.e. host-address order).  The
  i-th distinct miss takes the i-th least-recent *untouched* hot slot in
  ``lru_order`` (hot hits of this call are protected).  Misses beyond the
  available victims go, in the same order, to ``staging_rows[n]`` and do not
  enter the hot cache.
* LRU update is a stable partition of ``lru_order``: untouched slots keep their
  order at the front, touched slots (hits and fills of this call) follow in
  their previous order.  Recency therefore has call granularity, with ties
  broken by previous recency: deterministic and exact.
* Output ``locations[n, j, i]`` is a device row such that
  ``device_rows[locations] == original row selections[n, j, i]`` (eq. 12)
  once the gather of the returned miss list completed; -1 for padding.
"""
from __future__ import annotations

import torch

# Columns of the per-row counter tensor returned by the resolver.
COUNTER_DIRECT, COUNTER_HOT, COUNTER_HOST, COUNTER_FETCHED = range(4)
NUM_COUNTERS = 4


def resolve_reference(
    selections: torch.Tensor,  # [N, K, k] int32, request-local rows, -1 pad
    slot_ids: torch.Tensor,  # [N] int32 request slot of each batch row
    page_table: torch.Tensor,  # [S, max_pages] int32 device row of page start, -1 = not ready
    page_size: int,
    hot_pos: torch.Tensor,  # [S, B] int32 row held by each hot slot, -1 = empty (updated)
    hot_rows: torch.Tensor,  # [S, B] int32 device row of each hot slot
    lru_order: torch.Tensor,  # [S, B] int32 hot slots, least recent first (updated)
    hot_slot_of: torch.Tensor,  # [S, P] int32 row -> hot slot, -1 = absent (updated)
    staging_rows: torch.Tensor,  # [N, C] int32 device rows for overflow misses
    host_base: torch.Tensor,  # [S] int64 host row of each slot's row 0
):
    """Returns ``(locations, miss_src, miss_dst, miss_count, counters)``.

    locations  [N, K, k] int32   device rows, -1 for padding
    miss_src   [N, K*k]  int64   host rows to copy (first miss_count[n] valid)
    miss_dst   [N, K*k]  int32   device rows they go to
    miss_count [N]       int32
    counters   [N, 4]    int32   direct / hot / host selections, distinct fetched
    """
    n_batch, n_queries, top_k = selections.shape
    dev = selections.device
    budget = hot_pos.shape[1]
    width = n_queries * top_k
    locations = torch.full_like(selections, -1)
    miss_src = torch.zeros(n_batch, width, dtype=torch.int64, device=dev)
    miss_dst = torch.full((n_batch, width), -1, dtype=torch.int32, device=dev)
    miss_count = torch.zeros(n_batch, dtype=torch.int32, device=dev)
    counters = torch.zeros(n_batch, NUM_COUNTERS, dtype=torch.int32, device=dev)

    for n in range(n_batch):
        slot = int(slot_ids[n])
        sel = selections[n].reshape(-1).long()  # [K*k]
        valid = sel >= 0
        pos = sel.clamp(min=0)
        loc = torch.full((width,), -1, dtype=torch.int64, device=dev)

        # 1. direct: tail and ready optional-history pages
        page_base = page_table[slot, pos // page_size].long()
        direct = valid & (page_base >= 0)
        loc[direct] = page_base[direct] + pos[direct] % page_size

        # 2. hot cache
        hot_slot = hot_slot_of[slot, pos].long()
        hot = valid & ~direct & (hot_slot >= 0)
        loc[hot] = hot_rows[slot, hot_slot[hot]].long()
        touched = torch.zeros(budget, dtype=torch.bool, device=dev)
        touched[hot_slot[hot]] = True

        # 3. distinct misses, ascending position, take untouched LRU victims
        host = valid & ~direct & ~hot
        missing = torch.unique(pos[host])  # sorted ascending
        order = lru_order[slot].long()
        victims = order[~touched[order]]
        n_hot_fill = min(missing.numel(), victims.numel())
        n_stage = missing.numel() - n_hot_fill
        if n_stage > staging_rows.shape[1]:
            raise ValueError(
                f"batch row {n}: {n_stage} overflow misses but staging_rows has "
                f"{staging_rows.shape[1]} columns; need >= K*k - B")
        fill_slots = victims[:n_hot_fill]
        fill_pos = missing[:n_hot_fill]
        old_pos = hot_pos[slot, fill_slots].long()
        hot_slot_of[slot, old_pos[old_pos >= 0]] = -1
        hot_pos[slot, fill_slots] = fill_pos.to(hot_pos.dtype)
        hot_slot_of[slot, fill_pos] = fill_slots.to(hot_slot_of.dtype)
        touched[fill_slots] = True
        dst = torch.cat([hot_rows[slot, fill_slots].long(),
                         staging_rows[n, :n_stage].long()])
        lru_order[slot] = torch.cat([order[~touched[order]], order[touched[order]]]).to(lru_order.dtype)

        # every selection of a missing row gets that row's location
        idx = torch.searchsorted(missing, pos[host])
        loc[host] = dst[idx]
        n_miss = missing.numel()
        miss_src[n, :n_miss] = int(host_base[slot]) + missing
        miss_dst[n, :n_miss] = dst.to(torch.int32)
        miss_count[n] = n_miss
        counters[n, COUNTER_DIRECT] = int(direct.sum())
        counters[n, COUNTER_HOT] = int(hot.sum())
        counters[n, COUNTER_HOST] = int(host.sum())
        counters[n, COUNTER_FETCHED] = n_miss
        locations[n] = loc.view(n_queries, top_k).to(locations.dtype)
    return locations, miss_src, miss_dst, miss_count, counters


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
