"""Fused resolver: direct map -> hot cache (exact LRU) -> miss list -> locations.

One launch, one program (CTA) per batch row, as in SGLang's
``load_cache_to_device_buffer_kernel``.  Semantics, outputs and in-place state
updates are bit-identical to ``reference.resolve_reference`` (the spec).

Phases of one program (batch row n, request slot s), separated by CTA barriers:

  0. zero ``touched[B]`` (scratch)
  1. per selection, chunked over K*k:  direct page? -> loc;  else hot_slot_of
     hit (O(1) inverse map) -> loc = hot_rows[slot], touched[slot] = 1;
     else host: key[j] = pos.  Counters are summed on the way.
  2. sort (pos, j) packed into one key (int32 when P * K*k < 2**31, else
     int64) over the whole K*k block; adjacent compare marks the
     first of each distinct position, cumsum gives its rank r (ascending
     position = host-address order); miss_src[r] = host_base + pos and
     key[j] = r for every selecting j.
  3. pass A over lru_order: number of untouched slots -> n_fill, n_untouched'.
     pass B: running cumsum of untouched flags gives each untouched slot its
     victim rank r; r < U fills rank r; the stable partition position of every
     slot is computed in the same pass (new order into scratch); fills clear
     hot_slot_of[old position].
  4. per rank r: fills set hot_pos / hot_slot_of and miss_dst = hot_rows[victim];
     overflow ranks take staging_rows[n, r - n_fill]; ranks >= U get 0 / -1.
  5. new lru_order copied back; host selections get loc = miss_dst[key[j]].

Requests in a batch must have distinct slots (the programs update per-slot state
without synchronisation).  Selections are padding when negative and must
otherwise be < P = hot_slot_of.shape[1]; larger positions never touch memory out
of bounds, but their result is undefined (the reference raises IndexError).
"""
from __future__ import annotations

import contextlib
import numbers
import os

import torch
import triton
import triton.language as tl

from vllm_dhisparse.triton_kernels.reference import NUM_COUNTERS

_INT32_MAX = 2**31 - 1
_NARROW_KEY_LIMIT = _INT32_MAX - 1  # int32 sort keys while P * W_PAD stays below the sentinel
_BLOCK_W = 1024  # selections per chunk in phases 1, 4, 5
_BLOCK_B = 1024  # hot slots per chunk in phases 0, 3, 5


@triton.jit
def _resolve_kernel(
    sel_ptr, sel_stride,  # [N, W] int32 (selections viewed as [N, K*k])
    slot_ids_ptr,  # [N] int32
    page_table_ptr, page_table_stride, max_pages,  # [S, max_pages] int32
    hot_pos_ptr, hot_pos_stride,  # [S, B] int32 (updated)
    hot_rows_ptr, hot_rows_stride,  # [S, B] int32
    lru_ptr, lru_stride,  # [S, B] int32 (updated)
    hot_slot_of_ptr, hot_slot_of_stride, max_pos,  # [S, P] int32 (updated)
    staging_ptr, staging_stride,  # [N, C] int32
    host_base_ptr,  # [S] int64
    loc_ptr,  # [N, W] int32 out
    miss_src_ptr,  # [N, W] int64 out
    miss_dst_ptr,  # [N, W] int32 out
    miss_count_ptr,  # [N] int32 out
    counters_ptr,  # [N, 4] int32 out
    scratch_ptr, scratch_stride,  # [N, 2B + 2W_PAD] int32: touched | new order | key | sorted pos
    W, B,
    PAGE_SIZE: tl.constexpr, W_PAD: tl.constexpr, LOG_W: tl.constexpr, WIDE_KEYS: tl.constexpr,
    BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ids_ptr + n).to(tl.int64)
    SENTINEL: tl.constexpr = 2147483647
    touched_ptr = scratch_ptr + n * scratch_stride  # [B]
    order_ptr = touched_ptr + B  # [B] new lru order
    key_ptr = order_ptr + B  # [W_PAD] host pos (phase 1) then rank (phase 2)
    spos_ptr = key_ptr + W_PAD  # [W_PAD] sorted pos (phase 2) then victim slot (phase 3)
    sel_row = sel_ptr + n * sel_stride
    loc_row = loc_ptr + n * W
    miss_src_row = miss_src_ptr + n * W
    miss_dst_row = miss_dst_ptr + n * W
    pt_row = page_table_ptr + slot * page_table_stride
    hot_pos_row = hot_pos_ptr + slot * hot_pos_stride
    hot_rows_row = hot_rows_ptr + slot * hot_rows_stride
    lru_row = lru_ptr + slot * lru_stride
    hso_row = hot_slot_of_ptr + slot * hot_slot_of_stride
    offs_w = tl.arange(0, BLOCK_W)
    offs_b = tl.arange(0, BLOCK_B)

    # 0. touched[b] = 0
    for b0 in range(0, B, BLOCK_B):
        b = b0 + offs_b
        tl.store(touched_ptr + b, tl.zeros([BLOCK_B], tl.int32), mask=b < B)
    tl.debug_barrier()

    # 1. direct -> hot -> host classification
    n_direct = 0
    n_hot = 0
    n_host = 0
    for w0 in range(0, W, BLOCK_W):
        j = w0 + offs_w
        m = j < W
        sel = tl.load(sel_row + j, mask=m, other=-1)
        valid = sel >= 0
        pos = tl.maximum(sel, 0)
        page = pos // PAGE_SIZE
        page_base = tl.load(pt_row + page, mask=valid & (page < max_pages), other=-1)
        direct = valid & (page_base >= 0)
        maybe_hot = valid & ~direct & (pos < max_pos)
        hot_slot = tl.load(hso_row + pos, mask=maybe_hot, other=-1)
        hot = maybe_hot & (hot_slot >= 0)
        hot_row = tl.load(hot_rows_row + hot_slot, mask=hot, other=-1)
        host = valid & ~direct & ~hot
        loc = tl.where(direct, page_base + pos % PAGE_SIZE, tl.where(hot, hot_row, -1))
        tl.store(loc_row + j, loc, mask=m)
        tl.store(touched_ptr + hot_slot, tl.full([BLOCK_W], 1, tl.int32), mask=hot)
        tl.store(key_ptr + j, tl.where(host, pos, SENTINEL), mask=m)
        n_direct += tl.sum(direct.to(tl.int32))
        n_hot += tl.sum(hot.to(tl.int32))
        n_host += tl.sum(host.to(tl.int32))
    tl.debug_barrier()

    # 2. distinct misses in ascending position: sort (pos, j) keys, rank by cumsum
    jj = tl.arange(0, W_PAD)
    kpos = tl.load(key_ptr + jj, mask=jj < W, other=SENTINEL)
    if WIDE_KEYS:  # pos << 32 | j
        packed = tl.where(kpos != SENTINEL, (kpos.to(tl.int64) << 32) | jj.to(tl.int64),
                          9223372036854775807)
        packed = tl.sort(packed)
        spos = (packed >> 32).to(tl.int32)
        src_j = (packed & 0x7FFFFFFF).to(tl.int32)
    else:  # pos << LOG_W | j fits int32 because P * W_PAD < 2**31 (launcher)
        packed = tl.where(kpos != SENTINEL, (kpos << LOG_W) | jj, SENTINEL)
        packed = tl.sort(packed)
        spos = tl.where(packed != SENTINEL, packed >> LOG_W, SENTINEL)
        src_j = packed & (W_PAD - 1)
    tl.store(spos_ptr + jj, spos)
    tl.debug_barrier()
    prev = tl.load(spos_ptr + jj - 1, mask=jj > 0, other=-1)
    is_miss = spos != SENTINEL
    first = is_miss & (spos != prev)
    rank = tl.cumsum(first.to(tl.int32), 0) - 1
    n_miss = tl.sum(first.to(tl.int32))
    base = tl.load(host_base_ptr + slot)
    tl.debug_barrier()  # every thread has read spos before phase 3 reuses it
    tl.store(key_ptr + src_j, rank, mask=is_miss)
    tl.store(miss_src_row + rank, base + spos.to(tl.int64), mask=first)

    # 3A. untouched (victim) count
    n_untouched = 0
    for b0 in range(0, B, BLOCK_B):
        b = b0 + offs_b
        mb = b < B
        slot_b = tl.load(lru_row + b, mask=mb, other=0)
        t = tl.load(touched_ptr + slot_b, mask=mb, other=1)
        n_untouched += tl.sum((t == 0).to(tl.int32))
    n_fill = tl.minimum(n_miss, n_untouched)
    n_left = n_untouched - n_fill  # untouched after the fills: front of new order

    # 3B. victims (i-th untouched in LRU order <- i-th miss) + stable partition
    run = 0
    for b0 in range(0, B, BLOCK_B):
        b = b0 + offs_b
        mb = b < B
        slot_b = tl.load(lru_row + b, mask=mb, other=0)
        t = tl.load(touched_ptr + slot_b, mask=mb, other=1)
        u = (t == 0).to(tl.int32)
        r = run + tl.cumsum(u, 0) - u  # untouched strictly before b
        fill = mb & (u == 1) & (r < n_miss)
        left = mb & (u == 1) & (r >= n_miss)
        left_before = tl.maximum(r - n_miss, 0)
        new_at = tl.where(left, r - n_miss, n_left + b - left_before)
        tl.store(order_ptr + new_at, slot_b, mask=mb)
        old = tl.load(hot_pos_row + slot_b, mask=fill, other=-1)
        tl.store(hso_row + old, tl.full([BLOCK_B], -1, tl.int32),
                 mask=fill & (old >= 0) & (old < max_pos))
        tl.store(spos_ptr + r, slot_b, mask=fill)
        run += tl.sum(u)
    tl.debug_barrier()

    # 4. fills enter the hot cache; miss destinations (hot row or staging row)
    staging_row = staging_ptr + n * staging_stride
    for w0 in range(0, W, BLOCK_W):
        r = w0 + offs_w
        mr = r < W
        is_fill = r < n_fill
        victim = tl.load(spos_ptr + r, mask=is_fill, other=0)
        pos = (tl.load(miss_src_row + r, mask=is_fill, other=0) - base).to(tl.int32)
        tl.store(hot_pos_row + victim, pos, mask=is_fill)
        tl.store(hso_row + pos, victim, mask=is_fill & (pos >= 0) & (pos < max_pos))
        hot_row = tl.load(hot_rows_row + victim, mask=is_fill, other=-1)
        is_stage = (r >= n_fill) & (r < n_miss)
        stage_row = tl.load(staging_row + (r - n_fill), mask=is_stage, other=-1)
        tl.store(miss_dst_row + r, tl.where(is_fill, hot_row, stage_row), mask=mr)
        tl.store(miss_src_row + r, tl.zeros([BLOCK_W], tl.int64), mask=mr & (r >= n_miss))
    tl.debug_barrier()

    # 5. LRU order back; host selections read their row's destination
    for b0 in range(0, B, BLOCK_B):
        b = b0 + offs_b
        mb = b < B
        tl.store(lru_row + b, tl.load(order_ptr + b, mask=mb), mask=mb)
    for w0 in range(0, W, BLOCK_W):
        j = w0 + offs_w
        m = j < W
        k = tl.load(key_ptr + j, mask=m, other=SENTINEL)
        host = m & (k != SENTINEL)
        loc = tl.load(miss_dst_row + k, mask=host, other=-1)
        tl.store(loc_row + j, loc, mask=host)

    tl.store(miss_count_ptr + n, n_miss)
    counters_row = counters_ptr + n * 4
    tl.store(counters_row + 0, n_direct)
    tl.store(counters_row + 1, n_hot)
    tl.store(counters_row + 2, n_host)
    tl.store(counters_row + 3, n_miss)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _check(name: str, t, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    """``shape`` entries: int = exact size, None = any."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}")
    want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
    if t.dim() != len(shape) or any(s is not None and s != a for s, a in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; all tensors must be on {device} "
                         f"(the device of selections)")
    if t.dim() and t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, "
                         f"got strides {t.stride()}")


def _check_device(device: torch.device) -> None:
    if device.type == "cuda":
        return
    if device.type == "cpu" and _interpreting():
        return
    raise ValueError(f"selections is on {device}: the Triton resolver needs CUDA tensors "
                     f"(or CPU tensors with TRITON_INTERPRET=1); use resolve_reference on CPU")


def resolve(selections, slot_ids, page_table, page_size, hot_pos, hot_rows, lru_order,
            hot_slot_of, staging_rows, host_base):
    """Triton ``resolve_reference``: same arguments, outputs and state updates.

    Returns ``(locations [N,K,k] i32, miss_src [N,K*k] i64, miss_dst [N,K*k] i32,
    miss_count [N] i32, counters [N,4] i32)``; updates hot_pos, lru_order and
    hot_slot_of of the slots in ``slot_ids`` in place.  ``slot_ids`` must be
    distinct.  ``staging_rows`` may have more than N rows (an arena sized for the
    largest batch); ``staging_rows.shape[1] >= K*k - B`` (the worst case) is
    required up front because the kernel cannot raise.
    """
    if not isinstance(selections, torch.Tensor):
        raise ValueError(f"selections must be a torch.Tensor, got {type(selections).__name__}")
    dev = selections.device
    if selections.dtype != torch.int32 or selections.dim() != 3:
        raise ValueError(f"selections must be int32 [N, K, k], got {selections.dtype} "
                         f"{list(selections.shape)}")
    _check_device(dev)
    n_batch, n_queries, top_k = selections.shape
    width = n_queries * top_k
    if width and (selections.stride(2) != 1 or selections.stride(1) != top_k):
        raise ValueError(f"selections must be contiguous within a batch row (strides "
                         f"[*, {top_k}, 1]), got strides {list(selections.stride())}")
    if isinstance(page_size, bool) or not isinstance(page_size, numbers.Integral) or page_size <= 0:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    if not isinstance(hot_pos, torch.Tensor) or hot_pos.dim() != 2:
        raise ValueError(f"hot_pos must be a 2-D tensor [S, B], got "
                         f"{list(hot_pos.shape) if isinstance(hot_pos, torch.Tensor) else hot_pos!r}")
    n_slots, budget = hot_pos.shape
    _check("slot_ids", slot_ids, torch.int32, (n_batch,), dev)
    _check("page_table", page_table, torch.int32, (n_slots, None), dev)
    _check("hot_pos", hot_pos, torch.int32, (n_slots, budget), dev)
    _check("hot_rows", hot_rows, torch.int32, (n_slots, budget), dev)
    _check("lru_order", lru_order, torch.int32, (n_slots, budget), dev)
    _check("hot_slot_of", hot_slot_of, torch.int32, (n_slots, None), dev)
    _check("staging_rows", staging_rows, torch.int32, (None, None), dev)
    if staging_rows.shape[0] < n_batch:
        raise ValueError(f"staging_rows must have >= N = {n_batch} rows (one per batch row), "
                         f"got shape {list(staging_rows.shape)}")
    _check("host_base", host_base, torch.int64, (n_slots,), dev)
    if hot_slot_of.shape[1] >= _INT32_MAX:
        raise ValueError(f"hot_slot_of.shape[1] must be < {_INT32_MAX}, got {hot_slot_of.shape[1]}")
    need = max(0, width - budget)
    if staging_rows.shape[1] < need:
        raise ValueError(f"staging_rows.shape[1] must be >= K*k - B = {width} - {budget} = "
                         f"{need}, got {staging_rows.shape[1]}")

    locations = torch.empty(selections.shape, dtype=torch.int32, device=dev)
    miss_src = torch.empty(n_batch, width, dtype=torch.int64, device=dev)
    miss_dst = torch.empty(n_batch, width, dtype=torch.int32, device=dev)
    miss_count = torch.empty(n_batch, dtype=torch.int32, device=dev)
    counters = torch.empty(n_batch, NUM_COUNTERS, dtype=torch.int32, device=dev)
    if n_batch == 0:
        return locations, miss_src, miss_dst, miss_count, counters
    w_pad = triton.next_power_of_2(max(width, 1))
    wide_keys = hot_slot_of.shape[1] * w_pad > _NARROW_KEY_LIMIT
    scratch = torch.empty(n_batch, 2 * budget + 2 * w_pad, dtype=torch.int32, device=dev)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _resolve_kernel[(n_batch,)](
            selections, selections.stride(0),
            slot_ids,
            page_table, page_table.stride(0), page_table.shape[1],
            hot_pos, hot_pos.stride(0),
            hot_rows, hot_rows.stride(0),
            lru_order, lru_order.stride(0),
            hot_slot_of, hot_slot_of.stride(0), hot_slot_of.shape[1],
            staging_rows, staging_rows.stride(0),
            host_base,
            locations, miss_src, miss_dst, miss_count, counters,
            scratch, scratch.stride(0),
            width, budget,
            PAGE_SIZE=int(page_size),
            W_PAD=w_pad,
            LOG_W=w_pad.bit_length() - 1,
            WIDE_KEYS=wide_keys,
            BLOCK_W=min(_BLOCK_W, w_pad),
            BLOCK_B=min(_BLOCK_B, triton.next_power_of_2(max(budget, 1))),
            num_warps=_num_warps(w_pad, wide_keys),
            num_stages=1,
        )
    return locations, miss_src, miss_dst, miss_count, counters


def _num_warps(w_pad: int, wide_keys: bool) -> int:
    # The whole-block sort dominates registers: ~16 keys per thread.  ptxas for sm_90
    # reports no spills at K*k <= 512 and 8192, and 12-136 B at 2048, 4096, 16384;
    # int64 keys at 16384 spill less with 16 warps (480 B) than with 32 (1.8 KB).
    return max(4, min(16 if wide_keys else 32, w_pad // 512))
