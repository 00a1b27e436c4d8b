"""The resolver where there is no GPU: ``resolve_reference``'s contract, hits batched.

The reference resolves batch rows one after another, some forty small torch ops per row,
so a decode step pays that per request and sparse layer even when every selection is a
direct row or a hot-cache hit (the common case once a request's history is resident).
Here every batch row is classified in one vectorised pass; a row with no host miss and
nothing to repair is finished in that pass (locations, its recency stamp, counters),
padding rows too, and only the other rows go through ``resolve_reference`` unchanged.
Batch rows name distinct request slots and touch only their own slot's tables, so the
split gives the reference's outputs and state exactly
(``tests/kernels/test_resolve_torch.py``) for every call that returns; a call with a
repeated slot, which the contract does not allow, is left to the reference whole.  When
the reference raises for one of its rows (staging too small), the hit rows are left
untouched, where the reference alone would have resolved the rows before it.
"""
from __future__ import annotations

import torch

from .reference import (COUNTER_DIRECT, COUNTER_HOT, COUNTER_INVALID, COUNTER_REPAIRS,
                        NUM_COUNTERS, resolve_reference)


def resolve_torch(
    selections: torch.Tensor,  # [N, K, k] int32, request-local rows, -1 pad
    req_slots: torch.Tensor,  # [N] int32 request slot of each batch row, -1 = padding row
    page_table: torch.Tensor,  # [S, max_pages] int32
    page_size: int,
    hot_pos: torch.Tensor,  # [S, B] int32 (updated)
    hot_loc: torch.Tensor,  # [S, B] int32
    hot_stamp: torch.Tensor,  # [S, B] int32 (updated)
    hot_clock: torch.Tensor,  # [S] int32 (updated)
    hot_slot_of: torch.Tensor,  # [S, P] int32 (updated)
    staging_rows: torch.Tensor,  # [N, C] int32
    host_base: torch.Tensor,  # [S] int64
    *,
    num_device_rows: int,
    first_device_row: int = 0,
    seq_lens: torch.Tensor | None = None,  # [S] int32
):
    """Same arguments and results as :func:`resolve_reference`."""
    tables = (page_table, page_size, hot_pos, hot_loc, hot_stamp, hot_clock, hot_slot_of)
    bounds = dict(num_device_rows=num_device_rows, first_device_row=first_device_row,
                  seq_lens=seq_lens)
    n_batch, n_queries, top_k = selections.shape
    n_req_slots, hot_cache_rows = hot_pos.shape
    width = n_queries * top_k
    req_slot = req_slots.long()  # [N]
    real = (req_slot >= 0) & (req_slot < n_req_slots)
    max_pos, max_pages = hot_slot_of.shape[1], page_table.shape[1]
    n_real = int(real.sum())
    if 0 in (n_real, width, hot_cache_rows, max_pos, max_pages) \
            or (n_real > 1 and torch.unique(req_slot[real]).numel() != n_real):
        return resolve_reference(selections, req_slots, *tables, staging_rows, host_base,
                                 **bounds)
    s = torch.where(real, req_slot, 0)[:, None]  # [N, 1] a padding row reads request slot 0,
    # then drops it
    sel = selections.reshape(n_batch, width).long()  # [N, K*k]
    # [N, 1] rows each request has written, or P
    limit = max_pos if seq_lens is None else seq_lens[s].long().clamp(0, max_pos)
    valid = (sel >= 0) & (sel < limit)  # [N, K*k]
    invalid = ((sel < -1) | (sel >= limit)).sum(1)  # [N]
    pos = torch.where(valid, sel, 0)  # [N, K*k] selected row, 0 where not valid

    page = pos // page_size
    # [N, K*k] device row of the selected row's page start, -1: not ready
    page_base = torch.where(page < max_pages,
                            page_table[s, page.clamp(max=max_pages - 1)].long(), -1)
    pt_bad = valid & ((page_base < -1) | ((page_base >= 0) & (page_base < first_device_row))
                      | (page_base > max(num_device_rows - page_size, -1)))
    direct = valid & (page_base >= 0) & ~pt_bad
    v = hot_slot_of[s, pos].long()  # [N, K*k] hot slot of each selected row, -1: none
    v_clamped = v.clamp(0, hot_cache_rows - 1)
    nondirect = valid & ~direct
    hot = nondirect & (v >= 0) & (v < hot_cache_rows) & (hot_pos[s, v_clamped].long() == pos)
    hso_bad = nondirect & (v != -1) & ~hot
    host = nondirect & ~hot
    slow = real & (host | pt_bad | hso_bad).any(1)  # [N] rows the reference resolves
    done = real & ~slow  # [N] rows finished here: every valid selection direct or hot

    loc = torch.where(direct, page_base + pos % page_size, -1)  # [N, K*k] device rows
    loc = torch.where(hot, hot_loc[s, v_clamped].long(), loc)
    loc = torch.where(done[:, None], loc, -1)
    locations = loc.view(n_batch, n_queries, top_k).to(selections.dtype)
    miss_src = torch.zeros(n_batch, width, dtype=torch.int64, device=selections.device)
    miss_dst = torch.full((n_batch, width), -1, dtype=torch.int32, device=selections.device)
    miss_count = torch.zeros(n_batch, dtype=torch.int32, device=selections.device)
    counters = torch.zeros(n_batch, NUM_COUNTERS, dtype=torch.int32, device=selections.device)
    counters[:, COUNTER_DIRECT] = torch.where(done, direct.sum(1), 0).to(torch.int32)
    counters[:, COUNTER_HOT] = torch.where(done, hot.sum(1), 0).to(torch.int32)
    counters[:, COUNTER_INVALID] = torch.where(done, invalid, 0).to(torch.int32)
    counters[:, COUNTER_REPAIRS] = (~real & (req_slot != -1)).to(torch.int32)

    if bool(slow.any()):
        sub = slow.nonzero().flatten()
        out = resolve_reference(selections[sub], req_slots[sub], *tables, staging_rows[sub],
                                host_base, **bounds)
        for full, part in zip((locations, miss_src, miss_dst, miss_count, counters), out):
            full[sub] = part
    # a call that reads the hot cache takes the request's next stamp (int32, wrapping);
    # after the reference's rows: a call that raises leaves the hit rows' stamps as they were
    stamped = done & hot.any(1)  # [N]
    if bool(stamped.any()):
        rows = req_slot[stamped]
        stamp = (hot_clock[rows].long() + 1 + 2**31) % 2**32 - 2**31  # [n]
        hot_clock[rows] = stamp.to(hot_clock.dtype)
        r, c = hot[stamped].nonzero(as_tuple=True)  # the hits of the stamped rows
        hot_stamp[rows[r], v[stamped][r, c]] = stamp[r].to(hot_stamp.dtype)

    return locations, miss_src, miss_dst, miss_count, counters
