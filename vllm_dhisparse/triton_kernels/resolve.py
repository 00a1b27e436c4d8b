"""Fused resolver: direct map -> hot cache (LRU by call stamps) -> miss list -> locations.

One launch, one program (CTA) per batch row, as in SGLang's
``load_cache_to_device_buffer_kernel``.  Semantics, outputs and in-place state
updates are bit-identical to ``reference.resolve_reference`` (the spec).

No whole-block sort and no pass over the hot cache unless a row is missing.  Recency
is a stamp per hot slot (the spec's ``hot_stamp`` / ``hot_clock``): a hit costs one
store, and only a call with a miss walks the request's B stamps to choose victims.
Phases of one program (batch row n, request slot s), separated by CTA barriers; the
passes after phase 1 run only when their counts are non-zero:

  1a. per selection (chunks of BLOCK_W), on the entry state, no writes: direct page?
     -> loc; else ``hot_slot_of`` hit (an in-range hot slot whose hot_pos points back)
     -> loc = hot_loc[hot slot]; else host.  Four counts share one reduction.
  1b. after a barrier (every lookup has read the entry state): hits store the call's
     stamp c = hot_clock + 1 in their hot slot (duplicates store the same value); misses
     claim their row with ``atomic_min(hot_slot_of[pos], CLAIM + j)`` after resetting
     an entry below -1.  All direct -> done (no stamp, no miss).
  2. (misses) per host selection j: owner = the claim left is j's own; the
     owners' positions (the distinct misses) are compacted into mpos by a
     running cumsum, sorted ascending (the spec's host-address order) with a
     sort of 256, 1024, 2048 or next_pow2(K*k) keys, whichever is the smallest
     that holds them, and each rank r records its owner j (read back from the
     claim), writes miss_src[r] and replaces the claim by the rank code -2 - r.
  3. (misses) victims: the request's stamps and hot_pos (loaded once, during phase 2,
     when B fits one block) give, in one reduction, the unprotected hot slots (stamp !=
     c), their largest age and the bad hot_pos entries; when fewer victims are needed
     than there are, a radix select (a 256-bin histogram per byte of the largest age,
     from the top) finds the threshold age; the victims are the hot slots above it
     plus the first ties in hot-slot order, the i-th in hot-slot order for miss rank i
     (one packed cumsum): fills unlink their old row (where it points back), take the new one
     (hot_pos / hot_slot_of / stamp), write miss_dst[r] = hot_loc[victim] and the
     owner's location; bad hot_pos entries are emptied.  Overflow ranks take staging
     rows.
  4. only when a missing row was selected more than once (host selections >
     distinct misses): every host selection reads hot_slot_of[pos]: >= 0 is
     the filled hot slot, else the rank code of a staged row;
  5. staged rows leave hot_slot_of;  6. (fused copy) the program copies its own
     misses from pinned host memory, the words of consecutive rows side by side; the
     first EARLY_ELEMS words are read from host right after phase 2 and stored after
     phase 3, so one PCIe round trip runs under the select.

Requests in a batch must have distinct request slots (the programs update a request
slot's state without synchronisation); request slot -1 is a padding row.  Bounds:
every index read from page_table, hot_slot_of and hot_pos is range-checked as the
reference specifies (out-of-range entries degrade to empty and are counted in column 4
of the counters); stamps and clocks are never indices; a selection outside [-1, L) is
padding and counted in column 5, L being the request's length when ``seq_lens`` is
given, else P.
"""
from __future__ import annotations

import contextlib
import numbers
import os

import torch
import triton
import triton.language as tl

from .gather import check_rows, gather_rows, plane_views
from .reference import NUM_COUNTERS

_COUNTERS = tl.constexpr(NUM_COUNTERS)  # columns of counters
_INT32_MAX = 2**31 - 1
_MAX_WIDTH = 2**28  # claim codes CLAIM + j and rank codes -2 - r must not meet
_BLOCK_W = 2048  # selections per chunk in phases 1, 2, 4
_BLOCK_B = 4096  # hot slots per chunk in phase 3 when B does not fit one block (one wave):
# phase 3 walks B up to four times, one dependent load per chunk; at B = 8192 / 16384
# 4096-hot-slot chunks took 45.7 / 68.1 us where 1024 took 64.5 / 105.6 (benchmarks/METHODS.md)
_ONE_BLOCK_B = 4096  # largest B walked as one block in phase 3
_NUM_WARPS = 16  # at least; more for a wide miss sort (_num_warps).  16 beat 8 in 7 of
# the 9 SGLang cells (benchmarks/METHODS.md): more loads in flight per request
# more programs than SMs (a second wave otherwise): chunks small enough for two CTAs
# per SM (64 registers at 16 warps)
_MANY_BLOCK_W = 1024
_MANY_BLOCK_B = 512
_FUSE_MAX_WIDTH = 2048  # copy inside the resolve kernel when K*k <= this (fused_copy=None;
# measured up to 2048, single-query k=2048; wider miss lists keep the gather's grid)
_COPY_ELEMS = 4096  # words in flight per step of the fused copy (one-block path)
_COPY_ELEMS_CHUNKED = 4096  # the same where phase 3 walks B in chunks: a wider step raised
# the many-programs kernel's registers, a cost paid by calls that copy nothing (16384 words:
# batch 160 / 0 % 36.6 -> 52.5 us, benchmarks/METHODS.md)
_EARLY_ELEMS = 2048  # words of the fused copy read from host before the victim select
# (one-block path): their PCIe round trip runs under the select instead of after it
_EARLY_ELEMS_CHUNKED = 0  # the same where phase 3 walks B in chunks (more programs than
# SMs, or B above one block); 2048 left the 128K-context step at 512 sessions unchanged
# alone (2.07 ms), and with the 64-register cap it took 2.12 ms where neither took 1.95
# (likely spills under the cap; benchmarks/METHODS.md)
_SORT_MID = 1024  # extra sort size between 256 and 2048 (0: none)
_MANY_MAXNREG = 64  # register cap of the many-programs path when B is walked in chunks
# (0: the compiler's choice): at 16 warps two CTAs per SM instead of one; the 128K-context
# step at 512 sessions 2.07 -> 1.94 ms in one call (benchmarks/METHODS.md).  Not where B
# fits one block: that path holds the early words, which spill under the cap


def _num_warps(sort_max: int) -> int:
    # ~16 sort keys per thread at most (v0's finding: the whole-block sort spills beyond)
    return max(_NUM_WARPS, min(32, sort_max // 512))


@triton.jit
def _sort_prefix(ptr, count, SIZE: tl.constexpr):
    """Sorts ptr[0:count] ascending in place (count <= SIZE, distinct values)."""
    i = tl.arange(0, SIZE)
    v = tl.load(ptr + i, mask=i < count, other=2147483647)
    v = tl.sort(v)
    tl.debug_barrier()  # every entry read before any is overwritten
    tl.store(ptr + i, v, mask=i < count)


@triton.jit
def _sort_from_2048(ptr, count, SORT_MAX: tl.constexpr):
    if SORT_MAX <= 2048:
        _sort_prefix(ptr, count, SORT_MAX)
    elif count <= 2048:
        _sort_prefix(ptr, count, 2048)
    else:
        _sort_prefix(ptr, count, SORT_MAX)


@triton.jit
def _sort_misses(ptr, count, SORT_MAX: tl.constexpr, SORT_MID: tl.constexpr):
    """Sorts the ``count`` distinct misses with the smallest of 256 / SORT_MID / 2048 /
    SORT_MAX keys that holds them (a bitonic sort costs its size, not the count)."""
    if SORT_MAX <= 256:
        _sort_prefix(ptr, count, SORT_MAX)
    elif count <= 256:
        _sort_prefix(ptr, count, 256)
    elif SORT_MID > 256 and SORT_MID < SORT_MAX and SORT_MID != 2048:
        if count <= SORT_MID:
            _sort_prefix(ptr, count, SORT_MID)
        else:
            _sort_from_2048(ptr, count, SORT_MAX)
    else:
        _sort_from_2048(ptr, count, SORT_MAX)


@triton.jit
def _lookup(sel_row, j, m, real, pt_row, max_pages, pt_first, pt_last, hso_row, hot_pos_row,
            hot_loc_row,
            limit, B, loc_row, key_ptr, PAGE_SIZE: tl.constexpr):
    """Phase 1 lookups of selections ``j`` on the entry state; writes no state table,
    only the lanes' locations and keys (host: pos, hit: -2 - pos, else -1).

    Every table entry is range-checked before it is used as an index: a page_table
    entry outside {-1} u [F, R - PAGE_SIZE] is a page not ready, a hot_slot_of entry
    is a hit only when it is a hot slot whose hot_pos points back at the row.  A selection
    outside [-1, limit) reads nothing and is counted as invalid.  Returns the lanes'
    position, hot_slot_of entry, hit and host masks, and the chunk's direct, hot, host,
    repair and invalid counts."""
    sel = tl.load(sel_row + j, mask=m, other=-1)
    valid = m & real & (sel >= 0) & (sel < limit)
    invalid = m & real & ((sel < -1) | (sel >= limit))
    pos = tl.where(valid, sel, 0)
    page = pos // PAGE_SIZE
    # hot_slot_of is read in parallel with the page table (one dependent step less)
    pt = tl.load(pt_row + page, mask=valid & (page < max_pages), other=-1)
    v = tl.load(hso_row + pos, mask=valid, other=-1)
    pt_bad = valid & ((pt < -1) | ((pt >= 0) & (pt < pt_first)) | (pt > pt_last))
    direct = valid & (pt >= 0) & ~pt_bad
    nondirect = valid & ~direct
    v_in = nondirect & (v >= 0) & (v < B)
    held = tl.load(hot_pos_row + v, mask=v_in, other=-1)
    hot_row = tl.load(hot_loc_row + v, mask=v_in, other=-1)
    hot = v_in & (held == pos)
    host = nondirect & ~hot
    hso_bad = nondirect & (v != -1) & ~hot
    loc = tl.where(direct, pt + pos % PAGE_SIZE, tl.where(hot, hot_row, -1))
    tl.store(loc_row + j, loc, mask=m)
    tl.store(key_ptr + j, tl.where(host, pos, tl.where(hot, -2 - pos, -1)), mask=m)
    # one reduction for five counts; a chunk holds at most BLOCK_W <= 2**11 selections
    # (12 bits a count, repairs up to two per selection)
    packed = tl.sum(direct.to(tl.int64) + (hot.to(tl.int64) << 12) + (host.to(tl.int64) << 24)
                    + (invalid.to(tl.int64) << 36)
                    + ((pt_bad.to(tl.int64) + hso_bad.to(tl.int64)) << 48))
    return (pos, v, hot, host, (packed & 0xFFF).to(tl.int32),
            ((packed >> 12) & 0xFFF).to(tl.int32), ((packed >> 24) & 0xFFF).to(tl.int32),
            (packed >> 48).to(tl.int32), ((packed >> 36) & 0xFFF).to(tl.int32))


@triton.jit
def _stamp_and_claim(pos, v, hot, host, j, stamp_row, hso_row, c, CLAIM: tl.constexpr):
    """Phase 1 writes: hits stamp their hot slot with the call's stamp c (duplicates store
    the same value, so a plain store is race-free), misses claim their row
    (hot_slot_of = CLAIM + j, the smallest j left wins).  An entry that was below -1
    on entry (corrupt) is reset first; a reset may also clear another lane's claim,
    but every lane that resets claims after it, so the row still ends with one owner."""
    tl.store(stamp_row + v, tl.zeros_like(v) + c, mask=hot)
    # relaxed, CTA scope: only this program touches this request slot's rows, and the
    # barriers order the phases (acq_rel serialised each thread's atomics)
    tl.atomic_xchg(hso_row + pos, tl.zeros_like(pos) - 1, mask=host & (v < -1),
                   sem="relaxed", scope="cta")
    tl.atomic_min(hso_row + pos, CLAIM + j, mask=host, sem="relaxed", scope="cta")


@triton.jit
def _age(stamp, c):
    """(c - stamp) mod 2**32 as int64: how many stamps ago the hot slot was last used."""
    return (c - stamp).to(tl.int64) & 0xFFFFFFFF


@triton.jit
def _sum_sum_max(a0, b0, c0, a1, b1, c1):
    return a0 + a1, b0 + b1, tl.maximum(c0, c1)


@triton.jit
def _sum_sum(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@triton.jit
def _passes(max_age):
    """Radix passes (a byte each) that cover the ages up to ``max_age``."""
    return 1 + (max_age >= 256).to(tl.int32) + (max_age >= 65536).to(tl.int32) \
        + (max_age >= 16777216).to(tl.int32)


@triton.jit
def _age_histogram(age, free, prefix, shift):
    """Histogram of byte ``shift`` of the ages of the unprotected hot slots whose higher
    bytes equal ``prefix``'s, inverted so that the oldest fall in the lowest bins."""
    cand = free & ((age >> (shift + 8)) == (prefix >> (shift + 8)))
    dig = (255 - ((age >> shift) & 255)).to(tl.int32)
    return tl.histogram(dig, 256, mask=cand)


@triton.jit
def _radix_step(hist, need, prefix, shift):
    """One byte of the threshold age: the bin that holds the ``need``-th oldest hot slot.
    Returns how many of that bin's hot slots are still needed and the threshold so far."""
    cum = tl.cumsum(hist, 0)
    below = cum < need  # the bins before it (cum is non-decreasing)
    d, taken = tl.reduce((below.to(tl.int32), tl.where(below, hist, 0)), 0, _sum_sum)
    return need - taken, prefix | ((255 - d).to(tl.int64) << shift)


@triton.jit
def _fill_victims(st, hp, b, mb, now, max_pos, thresh, ties, run_a, run_t, mpos_ptr, mj_ptr,
                  hot_pos_row, hot_loc_row, stamp_row, hso_row, miss_dst_row, loc_row):
    """Phase 3 on the hot slots ``b`` (stamps ``st``, hot_pos ``hp``): victims are the
    unprotected hot slots older than ``thresh`` plus the first ``ties`` at ``thresh`` (in
    hot-slot order, ``run_a`` / ``run_t`` of each before ``b``); the victim with r victims
    before it takes miss rank r.  Empties bad hot_pos entries.  Returns this block's
    count of older hot slots plus its ties << 16."""
    free = mb & (st != now)
    age = _age(st, now)
    older = (free & (age > thresh)).to(tl.int32)
    tie = (free & (age == thresh)).to(tl.int32)
    packed = older + (tie << 16)
    before = tl.cumsum(packed, 0) - packed
    t_rank = run_t + (before >> 16)
    fill = (older > 0) | ((tie > 0) & (t_rank < ties))
    r = run_a + (before & 0xFFFF) + tl.minimum(t_rank, ties)  # miss rank of this victim
    bad = mb & ((hp < -1) | (hp >= max_pos))
    held = fill & ~bad & (hp >= 0)
    # the old row is unlinked only where it points back at this hot slot: a stale entry
    # may name a row that another victim takes in this call
    link = tl.load(hso_row + hp, mask=held, other=-1)
    new_pos = tl.load(mpos_ptr + r, mask=fill, other=0)
    owner = tl.load(mj_ptr + r, mask=fill, other=0)
    victim_row = tl.load(hot_loc_row + b, mask=fill, other=-1)
    tl.store(hso_row + hp, tl.zeros_like(hp) - 1, mask=held & (link == b))
    tl.store(hot_pos_row + b, tl.where(fill, new_pos, -1), mask=fill | bad)
    tl.store(stamp_row + b, tl.zeros_like(st) + now, mask=fill)
    tl.store(hso_row + new_pos, b, mask=fill)
    tl.store(miss_dst_row + r, victim_row, mask=fill)
    tl.store(loc_row + owner, victim_row, mask=fill)  # the selection that owns rank r
    return tl.sum(packed)


@triton.jit
def _host_words(miss_src_row, n_elems, e0, copy_src_ptr, SRC_STRIDE: tl.constexpr,
                ROW_ELEMS: tl.constexpr, COPY_ELEMS: tl.constexpr):
    """Words e0 .. e0 + COPY_ELEMS of the miss list's host rows (rank-major), side by
    side: no lane idles on a row's padding."""
    e = e0 + tl.arange(0, COPY_ELEMS)
    me = e < n_elems
    r = e // ROW_ELEMS
    src = tl.load(miss_src_row + r, mask=me, other=0)
    return tl.load(copy_src_ptr + src * SRC_STRIDE + (e - r * ROW_ELEMS), mask=me)


@triton.jit
def _store_words(val, miss_dst_row, n_elems, e0, copy_dst_ptr, copy_dst2_ptr,
                 DST_STRIDE: tl.constexpr, DST2_STRIDE: tl.constexpr, SPLIT: tl.constexpr,
                 ROW_ELEMS: tl.constexpr, COPY_ELEMS: tl.constexpr):
    """Stores ``_host_words``' words at the miss list's device rows: words below SPLIT
    in the first plane, the rest in the second (rows stored as two byte planes)."""
    e = e0 + tl.arange(0, COPY_ELEMS)
    me = e < n_elems
    r = e // ROW_ELEMS
    c = e - r * ROW_ELEMS
    dst = tl.load(miss_dst_row + r, mask=me, other=0).to(tl.int64)
    if SPLIT < ROW_ELEMS:
        lo = c < SPLIT
        tl.store(copy_dst_ptr + dst * DST_STRIDE + c, val, mask=me & lo)
        tl.store(copy_dst2_ptr + dst * DST2_STRIDE + (c - SPLIT), val, mask=me & ~lo)
    else:
        tl.store(copy_dst_ptr + dst * DST_STRIDE + c, val, mask=me)


@triton.jit
def _resolve_kernel(
    sel_ptr, sel_stride,  # [N, W] int32 (selections viewed as [N, K*k])
    req_slots_ptr, n_req_slots,  # [N] int32 request slot of each batch row, -1 = padding row
    page_table_ptr, page_table_stride, max_pages,  # [S, max_pages] int32
    pt_first, pt_last,  # entries in [F, R - PAGE_SIZE]: the source's own device rows
    hot_pos_ptr, hot_pos_stride,  # [S, B] int32 (updated)
    hot_loc_ptr, hot_loc_stride,  # [S, B] int32
    stamp_ptr, stamp_stride,  # [S, B] int32 (updated)
    clock_ptr,  # [S] int32 (updated)
    hot_slot_of_ptr, hot_slot_of_stride, max_pos,  # [S, P] int32 (updated)
    staging_ptr, staging_stride,  # [N, C] int32
    host_base_ptr,  # [S] int64
    seq_lens_ptr,  # [S] int32 (LENS): rows written per request, the bound of selections
    loc_ptr,  # [N, W] int32 out
    miss_src_ptr,  # [N, W] int64 out
    miss_dst_ptr,  # [N, W] int32 out
    miss_count_ptr,  # [N] int32 out
    counters_ptr,  # [N, 6] int32 out
    scratch_ptr, scratch_stride,  # [N, 2W + SORT_MAX]: key | miss pos | owner
    copy_src_ptr, copy_dst_ptr, copy_dst2_ptr,  # fused copy (COPY): host rows, device planes
    W, B,
    PAGE_SIZE: tl.constexpr, BLOCK_W: tl.constexpr, BLOCK_B: tl.constexpr,
    ONE_CHUNK: tl.constexpr,  # W <= BLOCK_W: phase 1 keeps its lookups in registers
    ONE_B: tl.constexpr,  # B <= BLOCK_B: phase 3 keeps the request's stamps in registers
    SORT_MAX: tl.constexpr, SORT_MID: tl.constexpr,
    COPY: tl.constexpr, SRC_STRIDE: tl.constexpr, DST_STRIDE: tl.constexpr,
    DST2_STRIDE: tl.constexpr, SPLIT: tl.constexpr,  # words of a row in the first plane
    ROW_ELEMS: tl.constexpr, COPY_ELEMS: tl.constexpr,
    EARLY_ELEMS: tl.constexpr,  # words read from host before phase 3 (COPY only)
    LENS: tl.constexpr,  # seq_lens given: selections at or past a request's length are invalid
):
    CLAIM: tl.constexpr = -(2**30)  # claim code of selection j: CLAIM + j (< -1 - W)
    n = tl.program_id(0).to(tl.int64)
    req_slot = tl.load(req_slots_ptr + n)
    real = (req_slot >= 0) & (req_slot < n_req_slots)  # else a padding row: touches no state
    s = tl.where(real, req_slot, 0).to(tl.int64)
    key_ptr = scratch_ptr + n * scratch_stride  # [W] host: pos, hit: -2 - pos, else -1
    mpos_ptr = key_ptr + W  # [SORT_MAX] position of miss rank r
    mj_ptr = mpos_ptr + SORT_MAX  # [W] the selection j that owns miss rank r
    sel_row = sel_ptr + n * sel_stride
    loc_row = loc_ptr + n * W
    miss_src_row = miss_src_ptr + n * W
    miss_dst_row = miss_dst_ptr + n * W
    staging_row = staging_ptr + n * staging_stride
    pt_row = page_table_ptr + s * page_table_stride
    hot_pos_row = hot_pos_ptr + s * hot_pos_stride
    hot_loc_row = hot_loc_ptr + s * hot_loc_stride
    stamp_row = stamp_ptr + s * stamp_stride
    hso_row = hot_slot_of_ptr + s * hot_slot_of_stride
    offs_w = tl.arange(0, BLOCK_W)
    offs_b = tl.arange(0, BLOCK_B)
    now = tl.load(clock_ptr + s, mask=real, other=0) + 1  # this call's stamp (wraps)
    limit = max_pos
    if LENS:  # a corrupt length only narrows or widens the bound within [0, P]
        written = tl.load(seq_lens_ptr + s, mask=real, other=0)
        limit = tl.minimum(tl.maximum(written, 0), max_pos)

    # 1a. lookups on the entry state: direct -> hot -> host (no state table written yet)
    n_direct = 0
    n_hot = 0
    n_host = 0
    n_invalid = 0
    repairs = (req_slot != -1) & ~real
    repairs = repairs.to(tl.int32)
    if ONE_CHUNK:
        j = offs_w
        m = j < W
        pos, v, hot, host, n_direct, n_hot, n_host, rep1, n_invalid = _lookup(
            sel_row, j, m, real, pt_row, max_pages, pt_first, pt_last, hso_row, hot_pos_row,
            hot_loc_row, limit, B, loc_row, key_ptr, PAGE_SIZE)
        repairs += rep1
    else:
        for w0 in range(0, W, BLOCK_W):
            jc = w0 + offs_w
            mc = jc < W
            _, vc, _, _, n_dir_c, n_hot_c, n_host_c, n_rep_c, n_inv_c = _lookup(
                sel_row, jc, mc, real, pt_row, max_pages, pt_first, pt_last, hso_row,
                hot_pos_row, hot_loc_row, limit, B, loc_row, key_ptr, PAGE_SIZE)
            tl.store(mj_ptr + jc, vc, mask=mc)  # entry values for 1b (mj is free until phase 2)
            n_direct += n_dir_c
            n_hot += n_hot_c
            n_host += n_host_c
            n_invalid += n_inv_c
            repairs += n_rep_c
    tl.debug_barrier()  # every lookup (and the clock) read the entry state before any write
    tl.store(clock_ptr + s, now, mask=real & (n_hot + n_host > 0))

    # 1b. hits stamp their hot slot, misses claim their row
    if ONE_CHUNK:
        _stamp_and_claim(pos, v, hot, host, j, stamp_row, hso_row, now, CLAIM)
    else:
        for w0 in range(0, W, BLOCK_W):
            jc = w0 + offs_w
            kc = tl.load(key_ptr + jc, mask=jc < W, other=-1)
            vc = tl.load(mj_ptr + jc, mask=jc < W, other=-1)
            hostc = kc >= 0
            hotc = kc <= -2
            posc = tl.where(hostc, kc, tl.where(hotc, -2 - kc, 0))
            _stamp_and_claim(posc, vc, hotc, hostc, jc, stamp_row, hso_row, now, CLAIM)
    tl.debug_barrier()

    # 2. distinct misses: owners are compacted, the few distinct positions sorted
    #    (ascending = host-address order), ranks scattered back
    n_miss = 0
    n_fill = 0
    base = tl.load(host_base_ptr + s, mask=real, other=0)
    if n_host > 0:
        if ONE_B:  # phase 3's only loads of the request slot's rows, in flight during phase 2
            mb = offs_b < B
            st_all = tl.load(stamp_row + offs_b, mask=mb, other=0)
            hp_all = tl.load(hot_pos_row + offs_b, mask=mb, other=-1)
        for w0 in range(0, W, BLOCK_W):
            j2 = w0 + offs_w
            kp = tl.load(key_ptr + j2, mask=j2 < W, other=-1)
            h2 = kp >= 0
            claim = tl.load(hso_row + kp, mask=h2, other=0)
            own = h2 & (claim == CLAIM + j2)
            o = own.to(tl.int32)
            tl.store(mpos_ptr + n_miss + tl.cumsum(o, 0) - o, kp, mask=own)
            n_miss += tl.sum(o)
        tl.debug_barrier()
        _sort_misses(mpos_ptr, n_miss, SORT_MAX, SORT_MID)
        tl.debug_barrier()
        for r0 in range(0, n_miss, BLOCK_W):
            r = r0 + offs_w
            mr = r < n_miss
            p = tl.load(mpos_ptr + r, mask=mr, other=0)
            claim = tl.load(hso_row + p, mask=mr, other=0)  # still the owner's claim
            tl.store(mj_ptr + r, claim - CLAIM, mask=mr)
            tl.store(hso_row + p, -2 - r, mask=mr)
            tl.store(miss_src_row + r, base + p.to(tl.int64), mask=mr)
        tl.debug_barrier()
        if EARLY_ELEMS > 0:  # the first words' host reads fly while phase 3 runs
            first = _host_words(miss_src_row, n_miss * ROW_ELEMS, 0, copy_src_ptr, SRC_STRIDE,
                                ROW_ELEMS, EARLY_ELEMS)

        # 3. victims: the n_fill oldest unprotected hot slots, the i-th in hot-slot order for
        #    miss rank i; each filled rank's owner gets its location here, duplicates
        #    in phase 4
        if ONE_B:  # the whole row in registers: one load, every pass reads registers
            free = mb & (st_all != now)
            age = _age(st_all, now)
            bad = mb & ((hp_all < -1) | (hp_all >= max_pos))
            n_free, n_hp_bad, max_age = tl.reduce(
                (free.to(tl.int32), bad.to(tl.int32), tl.where(free, age, 0)), 0, _sum_sum_max)
            n_fill = tl.minimum(n_miss, n_free)
            thresh = max_age * 0  # every unprotected hot slot is older than 0
            ties = n_fill * 0
            if n_fill < n_free:
                need = n_fill
                n_pass = _passes(max_age)
                for q in range(0, n_pass):
                    shift = ((n_pass - 1 - q) * 8).to(tl.int64)
                    hist = _age_histogram(age, free, thresh, shift)
                    need, thresh = _radix_step(hist, need, thresh, shift)
                ties = need
            _fill_victims(st_all, hp_all, offs_b, mb, now, max_pos, thresh, ties, 0, 0,
                          mpos_ptr, mj_ptr, hot_pos_row, hot_loc_row, stamp_row, hso_row,
                          miss_dst_row, loc_row)
        else:
            n_free = 0
            n_hp_bad = 0
            max_age = tl.zeros([1], tl.int64).sum()
            for b0 in range(0, B, BLOCK_B):
                b = b0 + offs_b
                mb = b < B
                st = tl.load(stamp_row + b, mask=mb, other=0)
                hp = tl.load(hot_pos_row + b, mask=mb, other=-1)
                free = mb & (st != now)
                bad = mb & ((hp < -1) | (hp >= max_pos))
                f_c, b_c, a_c = tl.reduce((free.to(tl.int32), bad.to(tl.int32),
                                           tl.where(free, _age(st, now), 0)), 0, _sum_sum_max)
                n_free += f_c
                n_hp_bad += b_c
                max_age = tl.maximum(max_age, a_c)
            n_fill = tl.minimum(n_miss, n_free)
            thresh = max_age * 0
            ties = n_fill * 0
            if n_fill < n_free:
                need = n_fill
                n_pass = _passes(max_age)
                for q in range(0, n_pass):
                    shift = ((n_pass - 1 - q) * 8).to(tl.int64)
                    hist = tl.zeros([256], tl.int32)
                    for b0 in range(0, B, BLOCK_B):
                        b = b0 + offs_b
                        mb = b < B
                        st = tl.load(stamp_row + b, mask=mb, other=0)
                        hist += _age_histogram(_age(st, now), mb & (st != now), thresh, shift)
                    need, thresh = _radix_step(hist, need, thresh, shift)
                ties = need
            run_a = 0
            run_t = 0
            for b0 in range(0, B, BLOCK_B):
                b = b0 + offs_b
                mb = b < B
                st = tl.load(stamp_row + b, mask=mb, other=0)
                hp = tl.load(hot_pos_row + b, mask=mb, other=-1)
                packed = _fill_victims(st, hp, b, mb, now, max_pos, thresh, ties, run_a, run_t,
                                       mpos_ptr, mj_ptr, hot_pos_row, hot_loc_row, stamp_row,
                                       hso_row, miss_dst_row, loc_row)
                run_a += packed & 0xFFFF
                run_t += packed >> 16
        repairs += n_hp_bad
        for r0 in range(n_fill, n_miss, BLOCK_W):  # overflow misses go to staging rows
            r = r0 + offs_w
            ms = r < n_miss
            stage = tl.load(staging_row + (r - n_fill), mask=ms)
            owner = tl.load(mj_ptr + r, mask=ms, other=0)
            tl.store(miss_dst_row + r, stage, mask=ms)
            tl.store(loc_row + owner, stage, mask=ms)
        if EARLY_ELEMS > 0:
            tl.debug_barrier()  # miss_dst written by other threads
            _store_words(first, miss_dst_row, n_miss * ROW_ELEMS, 0, copy_dst_ptr, copy_dst2_ptr,
                         DST_STRIDE, DST2_STRIDE, SPLIT, ROW_ELEMS, EARLY_ELEMS)
    for r0 in range(n_miss // BLOCK_W * BLOCK_W, W, BLOCK_W):  # unused tail: 0 / -1
        r = r0 + offs_w
        mt = (r >= n_miss) & (r < W)
        tl.store(miss_src_row + r, tl.zeros([BLOCK_W], tl.int64), mask=mt)
        tl.store(miss_dst_row + r, tl.full([BLOCK_W], -1, tl.int32), mask=mt)
    tl.debug_barrier()

    # 4. only when a missing row was selected more than once: every host selection
    #    reads its row's destination
    if n_host > n_miss:
        for w0 in range(0, W, BLOCK_W):
            j4 = w0 + offs_w
            kp = tl.load(key_ptr + j4, mask=j4 < W, other=-1)
            h4 = kp >= 0
            code = tl.load(hso_row + kp, mask=h4, other=-1)
            filled = h4 & (code >= 0)
            staged = h4 & (code < -1)
            hot_row = tl.load(hot_loc_row + code, mask=filled, other=-1)
            stage_row = tl.load(staging_row + (-2 - code - n_fill), mask=staged, other=-1)
            tl.store(loc_row + j4, tl.where(filled, hot_row, stage_row), mask=h4)
        tl.debug_barrier()
    # 5. staged rows do not enter the hot cache
    for r0 in range(n_fill, n_miss, BLOCK_W):
        r = r0 + offs_w
        ms = r < n_miss
        p = tl.load(mpos_ptr + r, mask=ms, other=0)
        tl.store(hso_row + p, tl.full([BLOCK_W], -1, tl.int32), mask=ms)

    # 6. (COPY) this program copies its own misses, host -> device, zero-copy: words
    #    of consecutive rows side by side (no lane idles on a row's padding)
    if COPY:
        if n_miss > 0:
            tl.debug_barrier()  # miss_src / miss_dst written by other threads
            n_elems = n_miss * ROW_ELEMS
            for e0 in range(EARLY_ELEMS, n_elems, COPY_ELEMS):
                val = _host_words(miss_src_row, n_elems, e0, copy_src_ptr, SRC_STRIDE, ROW_ELEMS,
                                  COPY_ELEMS)
                _store_words(val, miss_dst_row, n_elems, e0, copy_dst_ptr, copy_dst2_ptr,
                             DST_STRIDE, DST2_STRIDE, SPLIT, ROW_ELEMS, COPY_ELEMS)

    tl.store(miss_count_ptr + n, n_miss)
    counters_row = counters_ptr + n * _COUNTERS
    tl.store(counters_row + 0, n_direct)
    tl.store(counters_row + 1, n_hot)
    tl.store(counters_row + 2, n_host)
    tl.store(counters_row + 3, n_miss)
    tl.store(counters_row + 4, repairs)
    tl.store(counters_row + 5, n_invalid)


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


_SM_COUNT = {}


def _sm_count(dev: torch.device) -> int:
    if dev.type != "cuda":
        return 2**31
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def fuses_copy(width: int, fused_copy=None) -> bool:
    """Whether ``resolve(..., host_rows, device_rows)`` copies inside the resolve kernel."""
    return bool(fused_copy) if fused_copy is not None else width <= _FUSE_MAX_WIDTH


def resolve(selections, req_slots, page_table, page_size, hot_pos, hot_loc, hot_stamp,
            hot_clock, hot_slot_of, staging_rows, host_base, host_rows=None, device_rows=None,
            fused_copy=None, *, num_device_rows=None, first_device_row=0, seq_lens=None):
    """Triton ``resolve_reference``: same arguments, outputs and state updates.

    ``num_device_rows`` (R, the end of the source's device rows, which bounds
    page_table entries) defaults to the device rows' count when they are given; one
    of the two is required.  ``first_device_row`` (F) is where the source's rows start
    when pools share one storage.

    With ``host_rows`` and ``device_rows`` it also copies the misses (what
    ``gather_rows`` of the returned miss list would do, byte for byte).
    ``device_rows`` is one tensor of whole rows or a list of byte planes (consecutive
    column ranges of a row, in order, e.g. 576 + 8 bytes); one or two planes are copied
    inside
    the resolve kernel (each program copies its own misses right after
    assigning their destinations; no second launch) when ``fused_copy`` is true,
    or by a ``gather_rows`` launch when false; ``None`` fuses when
    K*k <= ``_FUSE_MAX_WIDTH`` (small per-request payloads, where the second
    launch and its latency dominate), else gathers with its wider grid.

    Returns ``(locations [N,K,k] i32, miss_src [N,K*k] i64, miss_dst [N,K*k] i32,
    miss_count [N] i32, counters [N,5] i32)``; updates hot_pos, hot_stamp, hot_clock
    and hot_slot_of of the request slots in ``req_slots`` in place.  ``req_slots`` must be
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
    n_req_slots, hot_cache_rows = hot_pos.shape
    _check("req_slots", req_slots, torch.int32, (n_batch,), dev)
    _check("page_table", page_table, torch.int32, (n_req_slots, None), dev)
    _check("hot_pos", hot_pos, torch.int32, (n_req_slots, hot_cache_rows), dev)
    _check("hot_loc", hot_loc, torch.int32, (n_req_slots, hot_cache_rows), dev)
    _check("hot_stamp", hot_stamp, torch.int32, (n_req_slots, hot_cache_rows), dev)
    _check("hot_clock", hot_clock, torch.int32, (n_req_slots,), dev)
    _check("hot_slot_of", hot_slot_of, torch.int32, (n_req_slots, None), dev)
    _check("staging_rows", staging_rows, torch.int32, (None, None), dev)
    if staging_rows.shape[0] < n_batch:
        raise ValueError(f"staging_rows must have >= N = {n_batch} rows (one per batch row), "
                         f"got shape {list(staging_rows.shape)}")
    _check("host_base", host_base, torch.int64, (n_req_slots,), dev)
    if seq_lens is not None:
        _check("seq_lens", seq_lens, torch.int32, (n_req_slots,), dev)
    if hot_slot_of.shape[1] >= _INT32_MAX:
        raise ValueError(f"hot_slot_of.shape[1] must be < {_INT32_MAX}, got {hot_slot_of.shape[1]}")
    if width >= _MAX_WIDTH:
        raise ValueError(f"selections: K*k = {width} must be < {_MAX_WIDTH}")
    if num_device_rows is None:
        if device_rows is None:
            raise ValueError("num_device_rows (rows of the device pool, the bound of page_table "
                             "entries) is required when device_rows is not given")
        first_plane = device_rows[0] if isinstance(device_rows, (list, tuple)) else device_rows
        num_device_rows = first_plane.shape[0]
    if isinstance(num_device_rows, bool) or not isinstance(num_device_rows, numbers.Integral) \
            or not 0 <= num_device_rows <= _INT32_MAX:
        raise ValueError(f"num_device_rows must be an int in [0, {_INT32_MAX}], "
                         f"got {num_device_rows!r}")
    if isinstance(first_device_row, bool) or not isinstance(first_device_row, numbers.Integral) \
            or not 0 <= first_device_row <= num_device_rows:
        raise ValueError(f"first_device_row must be an int in [0, num_device_rows = "
                         f"{num_device_rows}], got {first_device_row!r}")
    need = max(0, width - hot_cache_rows)
    if staging_rows.shape[1] < need:
        raise ValueError(f"staging_rows.shape[1] must be >= K*k - B = {width} - {hot_cache_rows} = "
                         f"{need}, got {staging_rows.shape[1]}")

    copy = host_rows is not None or device_rows is not None
    views = None
    planes, cols = [], []
    if copy:
        if host_rows is None or device_rows is None:
            raise ValueError("host_rows and device_rows must be given together")
        planes = list(device_rows) if isinstance(device_rows, (list, tuple)) else [device_rows]
        if not planes or not all(isinstance(p, torch.Tensor) and p.dim() == 2 for p in planes):
            raise ValueError("device_rows must be a 2-D tensor or a list of 2-D byte planes")
        if len(planes) > 1 and not (isinstance(host_rows, torch.Tensor) and host_rows.dim() == 2):
            raise ValueError("host_rows must be a 2-D tensor [rows, width] when device_rows is a "
                             "list of planes")
        if len(planes) > 1 and sum(p.shape[1] for p in planes) != host_rows.shape[1]:
            raise ValueError(f"device_rows planes of widths {[p.shape[1] for p in planes]} must "
                             f"sum to the host row width {host_rows.shape[1]}")
        start = 0
        for p in planes:
            cols.append((start, start + p.shape[1]))
            start += p.shape[1]
            check_rows(host_rows if len(planes) == 1 else host_rows[:, cols[-1][0]:cols[-1][1]], p)
            if p.device != dev:
                raise ValueError(f"device_rows is on {p.device}; it must be on {dev} "
                                 f"(the device of selections)")
            if p.shape[0] != planes[0].shape[0]:
                raise ValueError(f"device_rows planes must have the same rows, got "
                                 f"{[q.shape[0] for q in planes]}")
        if len(planes) <= 2:
            views = plane_views(host_rows, planes)
    fused = copy and views is not None and fuses_copy(width, fused_copy)

    locations = torch.empty(selections.shape, dtype=torch.int32, device=dev)
    miss_src = torch.empty(n_batch, width, dtype=torch.int64, device=dev)
    miss_dst = torch.empty(n_batch, width, dtype=torch.int32, device=dev)
    miss_count = torch.empty(n_batch, dtype=torch.int32, device=dev)
    counters = torch.empty(n_batch, NUM_COUNTERS, dtype=torch.int32, device=dev)
    if n_batch == 0:
        return locations, miss_src, miss_dst, miss_count, counters
    # one wave (N <= SMs): whole-B block, fewest dependent steps; more programs than
    # SMs: small chunks, so that two CTAs fit an SM
    one_wave = n_batch <= _sm_count(dev)
    block_w = min(_BLOCK_W if one_wave else _MANY_BLOCK_W, triton.next_power_of_2(max(width, 1)))
    assert block_w <= 2048, "phase 1 packs five counts of a chunk into 12 bits each"
    b_pad = triton.next_power_of_2(max(hot_cache_rows, 1))
    if one_wave and b_pad <= _ONE_BLOCK_B:
        block_b = b_pad
    else:
        block_b = min(_BLOCK_B if one_wave else _MANY_BLOCK_B, b_pad)
    one_block = hot_cache_rows <= block_b  # phase 3 keeps the request's stamps in registers
    sort_max = max(16, triton.next_power_of_2(max(width, 1)))
    scratch = torch.empty(n_batch, 2 * width + sort_max, dtype=torch.int32, device=dev)
    if fused:
        copy_src, dsts, row_elems = views
        copy_dst, copy_dst2 = dsts[0], dsts[-1]
        src_stride, dst_stride = copy_src.stride(0), copy_dst.stride(0)
        dst2_stride = copy_dst2.stride(0)
        split = copy_dst.shape[1] if len(dsts) == 2 else row_elems
    else:
        copy_src, copy_dst, copy_dst2, row_elems, split = miss_src, miss_src, miss_src, 1, 1
        src_stride = dst_stride = dst2_stride = 1
    warps = _num_warps(sort_max)
    extra = {}
    if not one_wave and not one_block and _MANY_MAXNREG and dev.type == "cuda":
        extra["maxnreg"] = int(_MANY_MAXNREG)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _resolve_kernel[(n_batch,)](
            selections, selections.stride(0),
            req_slots, n_req_slots,
            page_table, page_table.stride(0), page_table.shape[1], int(first_device_row),
            max(int(num_device_rows) - int(page_size), -1),
            hot_pos, hot_pos.stride(0),
            hot_loc, hot_loc.stride(0),
            hot_stamp, hot_stamp.stride(0),
            hot_clock,
            hot_slot_of, hot_slot_of.stride(0), hot_slot_of.shape[1],
            staging_rows, staging_rows.stride(0),
            host_base,
            req_slots if seq_lens is None else seq_lens,
            locations, miss_src, miss_dst, miss_count, counters,
            scratch, max(scratch.stride(0), 1),
            copy_src, copy_dst, copy_dst2,
            width, hot_cache_rows,
            PAGE_SIZE=int(page_size),
            BLOCK_W=block_w,
            BLOCK_B=block_b,
            ONE_CHUNK=width <= block_w,
            ONE_B=one_block,
            SORT_MAX=sort_max, SORT_MID=_SORT_MID,
            COPY=fused, SRC_STRIDE=src_stride, DST_STRIDE=dst_stride,
            DST2_STRIDE=dst2_stride, SPLIT=split,
            ROW_ELEMS=row_elems, COPY_ELEMS=_COPY_ELEMS if one_block else _COPY_ELEMS_CHUNKED,
            EARLY_ELEMS=(0 if not fused else _EARLY_ELEMS if one_block else _EARLY_ELEMS_CHUNKED),
            LENS=seq_lens is not None,
            num_warps=warps,
            num_stages=1,
            **extra,
        )
    if copy and not fused:
        for (a, b), p in zip(cols, planes):
            gather_rows(host_rows if len(planes) == 1 else host_rows[:, a:b], p, miss_src,
                        miss_dst, miss_count)
    return locations, miss_src, miss_dst, miss_count, counters
