"""The routed c4a decode's locations, computed on the device from vLLM's decode metadata.

vLLM 0.33's FlashMLA decode (``nvidia/flashmla.py`` ``_forward_decode``) reads a c4a
layer's top-k rows through ``extra_k_cache`` (vLLM's blocks) and global indices.  The
routed decode gives FlashMLA the hierarchy's storage instead (``layout.one_block_view``)
and, per token, the storage rows of the same top-k rows.  :meth:`RoutedDecode.locations`
finds them with fixed shapes and no host read, so a FULL CUDA graph captures it once and
replays it while requests come and go:

1. the request slot of every decode row from its newest token's block
   (``routing.req_slots``); padding rows and rows of requests the hierarchy
   does not hold get -1;
2. rows past the committed ones (``committed <= row < seq_len // 4``: those the
   compressor wrote in this very step, and with asynchronous scheduling those of the
   previous step's drafts, committed only once verified; at most ``fresh_rows`` per
   request) are copied from vLLM's blocks into the last
   ``fresh_rows`` staging rows of the request's request slot;
3. the tokens' committed selections, grouped per request (``[N, K_max, k]``, the anchor
   and its drafts; ragged groups padded with -1), go to ``KVHierarchy.resolve_req_slots``
   with the first staging rows of each request slot for overflow misses;
4. FlashMLA's ``extra_topk_length`` is computed as vLLM computes it.

A valid token whose request the hierarchy does not hold reads nothing from the extra
cache (locations -1); ``counters`` counts such tokens batch-wide (they have no request
slot), and
``lost_by_slot`` the fresh rows that did not fit per request slot, so that the worker
can fail that request.  vLLM 0.33 classes every step of at most 1 + speculative tokens
as a decode, a short last prompt chunk or a full prefix-cache hit too: the worker
admits such a request before the forward (worker_side.py), so the hierarchy holds it.
"""
from __future__ import annotations

import torch

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.triton_kernels import reference
from vllm_dhisparse.triton_kernels.gather import gather_rows

from . import layout as L
from . import routing as R

COUNTER_FRESH = 0  # selections of rows past the committed ones
COUNTER_UNROUTED = 1  # valid tokens of requests the hierarchy does not hold
COUNTER_SELECTED = 2  # valid selections of routed tokens (the census's denominator)
NUM_COUNTERS = 3
WORD = 8  # bytes: plane offsets of a c4a block are multiples of 8


def plane_words(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """vLLM's c4a cache (``[blocks, 64, (1,) 584]`` uint8 with a block stride) as two
    overlapping row views whose row i starts at byte 8*i: ``(data [*, 576], scales [*, 8],
    block stride in words)``; a row's data starts at word ``(b * S + r * 576) / 8``."""
    stride = cache.stride(0)
    if cache.dtype != torch.uint8 or cache.shape[-1] != L.ROW_BYTES or stride % WORD \
            or cache.shape[1] != L.ROWS_PER_BLOCK:
        raise ValueError(f"expected vLLM's c4a cache [blocks, {L.ROWS_PER_BLOCK}, (1,) "
                         f"{L.ROW_BYTES}] uint8 with a block stride that is a multiple of "
                         f"{WORD} B, got {cache.dtype} {tuple(cache.shape)} strides "
                         f"{cache.stride()}")
    words = ((cache.shape[0] - 1) * stride + L.BLOCK_STRIDE) // WORD
    base = cache.as_strided((words * WORD,), (1,))
    data = base.as_strided((words - L.DATA_BYTES // WORD + 1, L.DATA_BYTES), (WORD, 1))
    scales = base.as_strided((words, L.SCALE_BYTES), (WORD, 1))
    return data, scales, stride // WORD


class RoutedDecode:
    """Routing of one c4a source's decode tokens; its buffers live as long as the engine
    (a captured graph reads them at fixed addresses)."""

    def __init__(self, hierarchy: KVHierarchy, source: str, *, num_vllm_blocks: int,
                 max_queries: int, fresh_rows: int, staging: torch.Tensor):
        parts = hierarchy.source(source)
        if parts.spec.plane_bytes != (L.DATA_BYTES, L.SCALE_BYTES):
            raise ValueError(f"source {source!r} stores rows as planes "
                             f"{parts.spec.plane_bytes}; FlashMLA reads "
                             f"({L.DATA_BYTES}, {L.SCALE_BYTES})")
        if max_queries < 1 or fresh_rows < 1:
            raise ValueError(f"max_queries={max_queries}, fresh_rows={fresh_rows}; "
                             f"allowed: >= 1")
        slots = parts.state.max_req_slots
        if staging.dtype != torch.int32 or staging.dim() != 2 or staging.shape[0] < slots \
                or staging.shape[1] < fresh_rows:
            raise ValueError(f"staging must be int32 [>= {slots} request slots, >= "
                             f"{fresh_rows} rows], got {staging.dtype} "
                             f"{tuple(staging.shape)}")
        self.hierarchy, self.source = hierarchy, source
        self.parts = parts
        self.max_queries, self.fresh_rows = max_queries, fresh_rows
        self.staging = staging[:slots]  # [S, C] int32 storage rows of each request slot
        dev = parts.state.device
        # written before every forward, outside graphs (routing.write_slot_by_block)
        self.slot_by_block = torch.full((num_vllm_blocks,), -1, dtype=torch.int32,
                                        device=dev)  # [blocks] int32
        self.counters = torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=dev)
        # fresh rows beyond ``fresh_rows`` (served as -1) per request slot
        self.lost_by_slot = torch.zeros(slots + 1, dtype=torch.int64,
                                        device=dev)  # [S + 1] int64, row S: no request slot
        rows = parts.pool.device_rows
        self.pool_view = L.one_block_view(rows.storage, rows.num_rows)  # [1, R, 1, 584]
        self._planes = [p for _, p in rows.planes]  # data [R, 576], scales [R, 8]
        self._copy = gather_rows if dev.type == "cuda" else reference.gather_reference

    def locations(self, local: torch.Tensor, token_to_req: torch.Tensor,
                  query_start_loc: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor, is_valid: torch.Tensor, vllm_cache: torch.Tensor):
        """Storage rows of every decode token's top-k rows and FlashMLA's lengths.

        local [T, k] int32 (the indexer's request-local rows, valid leftmost, -1 padding);
        token_to_req [T]; query_start_loc [>= N+1]; block_table [N, max_blocks] int32;
        seq_lens [N] (tokens, this step's included); is_valid [T] bool; vllm_cache: the
        layer's c4a blocks.  # ([T, k] int32, [T] int32)"""
        t, k = local.shape
        n = block_table.shape[0]
        st = self.parts.state
        dev = local.device
        req = token_to_req.long().clamp(max=n - 1)  # [T] (padding tokens may name any batch row)
        req_slot = R.req_slots(self.slot_by_block, block_table, seq_lens,
                               L.ROWS_PER_BLOCK * 4)  # [N] int32
        batch_row = torch.where(is_valid, req, n)  # [T]; invalid tokens -> padding batch row N
        # a batch row without a valid token is graph padding, whatever its stale table entries say
        has_token = torch.zeros(n + 1, dtype=torch.bool,
                                device=dev).index_fill_(0, batch_row, True)
        held = (req_slot >= 0) & has_token[:n]
        req_slot = torch.where(held, req_slot, -1)
        safe = req_slot.long().clamp(min=0)
        committed = torch.where(held, st.seq_lens[safe], 0)  # [N] int32 rows in the hierarchy
        written = torch.div(seq_lens.long(), 4, rounding_mode="floor")  # [N] rows vLLM holds
        fresh_n = torch.where(held, (written - committed).clamp(min=0), 0)  # [N]
        self.lost_by_slot.index_add_(
            0, torch.where(held, req_slot, self.staging.shape[0]).long(),
            (fresh_n - self.fresh_rows).clamp(min=0))
        fresh_n = fresh_n.clamp(max=self.fresh_rows).to(torch.int32)
        fresh_dst = self.staging[safe, -self.fresh_rows:]  # [N, F] int32
        self._copy_fresh(vllm_cache, block_table, committed, fresh_n, fresh_dst)

        pos = torch.arange(t, device=dev) - query_start_loc.long()[req]
        j = torch.where(is_valid, pos, 0).clamp(min=0)  # [T] query index within its request
        tok_req_slot = torch.where(is_valid & (j < self.max_queries), req_slot[req],
                                   -1)  # [T]
        self.counters[COUNTER_UNROUTED] += (is_valid & (tok_req_slot < 0)).sum()
        j = j.clamp(max=self.max_queries - 1)
        batch_row = torch.where(tok_req_slot >= 0, batch_row, n)
        tok_committed = committed[req].view(t, 1)  # [T, 1]
        routed = (tok_req_slot >= 0).view(t, 1)  # [T, 1]
        fresh = (local >= tok_committed) & routed  # [T, k]
        committed_sel = torch.where(fresh, -1, local)
        # tokens -> [N + 1, K_max, k]; unrouted tokens all land in padding batch row N
        # (request slot -1)
        sel = torch.full((n + 1, self.max_queries, k), -1, dtype=torch.int32, device=dev)
        sel[batch_row, j] = committed_sel.to(torch.int32)
        req_slots = torch.cat([req_slot, torch.full((1,), -1, dtype=torch.int32, device=dev)])
        need = self.parts.resolver.staging_columns(self.max_queries, k)
        overflow = None
        if need:
            if need + self.fresh_rows > self.staging.shape[1]:
                raise ValueError(f"{need} overflow + {self.fresh_rows} fresh rows per request "
                                 f"exceed the {self.staging.shape[1]} staging rows")
            overflow = self.staging[torch.cat([safe, safe[:1]]), :need]  # [N + 1, need]
        loc, _ = self.hierarchy.resolve_req_slots(self.source, req_slots.contiguous(), sel,
                                                  overflow)
        loc = loc[batch_row, j]  # [T, k]
        ahead = local.long() - tok_committed  # [T, k] rows past the committed ones
        fresh_loc = torch.gather(fresh_dst[req], 1, ahead.clamp(0, self.fresh_rows - 1))
        # a fresh row past the copied ones was lost above: it reads nothing (the clamped
        # offset would name another staged row)
        fresh_ok = ahead < fresh_n[req].view(t, 1).long()
        lost = fresh & ~fresh_ok  # [T, k]
        # counted as the CPU layers count: rows served (a lost one fails its request)
        self.counters[COUNTER_FRESH] += (fresh & fresh_ok).sum()
        self.counters[COUNTER_SELECTED] += ((local >= 0) & routed & ~lost).sum()
        loc = torch.where(fresh, torch.where(fresh_ok, fresh_loc, -1), loc)
        loc = torch.where(routed, loc, -1)
        return loc.to(torch.int32), R.topk_lengths(local, is_valid)

    def _copy_fresh(self, cache, block_table, committed, count, dst) -> None:
        """Rows ``committed[n] + i`` (i < count[n]) of row n's blocks -> storage rows dst."""
        data, scales, stride_w = plane_words(cache)
        rows = committed.long().view(-1, 1) + torch.arange(self.fresh_rows,
                                                           device=committed.device)  # [N, F]
        col = (rows // L.ROWS_PER_BLOCK).clamp(max=block_table.shape[1] - 1)
        blk = torch.gather(block_table.long(), 1, col)
        first = blk * stride_w + (rows % L.ROWS_PER_BLOCK) * (L.DATA_BYTES // WORD)
        scale = blk * stride_w + (L.SCALE_PLANE + (rows % L.ROWS_PER_BLOCK)
                                  * L.SCALE_BYTES) // WORD
        for src, idx, plane in ((data, first, self._planes[0]), (scales, scale, self._planes[1])):
            self._copy(src, plane, idx.contiguous(), dst.contiguous(), count)
