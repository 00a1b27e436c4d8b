"""Resolver hook for DeepSeek-V4: the indexer's top-k rows are read through the hierarchy.

``DeepseekV4CPUAttention.forward_mqa`` (vllm/models/deepseek_v4/cpu/cpu_sparse.py:561)
maps the indexer's request-local compressed positions to slots of vLLM's
paged cache and calls the sparse attention op.  For tokens of requests the
hierarchy has admitted, we instead resolve those positions (eq. 2, 6, 12) to
rows of the hierarchy's device storage -- hot cache, tail, optional history,
staging arena -- and run the same op on that storage.  The sliding-window part and the
dense compressed (c128a) layers are untouched, and so are tokens of requests
still in prefill (their history is being computed on device).

Rows computed in this very step (not committed yet: the anchor's and the
drafts', eq. 7-8) are copied from vLLM's cache into the request's rows of the
layer's staging arena, which the layer holds from its resolve until the
attention op has returned; the next layer may then reuse the arena.
"""
from __future__ import annotations

import torch
from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
from vllm.forward_context import get_forward_context
from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

_original_forward_mqa = None


def _active_worker():
    if not has_kv_transfer_group():
        return None
    connector = get_kv_transfer_group()
    return getattr(connector, "dhisparse_worker", None)


def install() -> bool:
    """Wraps ``forward_mqa`` once per process; harmless to call again."""
    global _original_forward_mqa
    try:
        from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention
    except ImportError:
        return False
    if _original_forward_mqa is not None:
        return True
    _original_forward_mqa = DeepseekV4CPUAttention.forward_mqa

    def forward_mqa(self, q, kv, positions, output):
        worker = _active_worker()
        layer = worker.layers.get(self.prefix) if worker is not None else None
        meta = get_forward_context().attn_metadata
        if layer is None or meta is None:
            return _original_forward_mqa(self, q, kv, positions, output)
        return _routed_forward_mqa(self, worker, layer, meta, q, kv, positions, output)

    DeepseekV4CPUAttention.forward_mqa = forward_mqa
    return True


def _routed_forward_mqa(attn, worker, layer, meta, q, kv, positions, output):
    from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu

    swa = meta[attn.swa_cache_layer.prefix]
    mla = meta[attn.prefix]
    req_idx = swa.token_to_req_indices  # [T] row of each token in the block tables
    num_tokens = q.shape[0]
    qsl = getattr(swa, "query_start_loc_cpu", None)  # padding tokens map to row 0: leave out
    real = min(num_tokens, int(qsl[-1])) if qsl is not None and qsl.numel() else num_tokens
    # which tokens the hierarchy serves, and whose (routing.py; checked, one per group/step)
    plan = worker.routing_plan(layer, mla.block_table, swa.seq_lens, req_idx[:real])
    if not plan.any_routed:
        return _original_forward_mqa(attn, q, kv, positions, output)
    idx = plan.token_idx  # [T_r]
    topk = attn.topk_indices_buffer[:num_tokens][idx]  # [T_r, k] request-local rows (a copy)
    req_r = req_idx[idx]
    if not plan.all_routed:
        # Prefill tokens of other requests read vLLM's cache as usual; routed tokens
        # are recomputed below and overwrite their outputs.  With device_window_tokens
        # vLLM has freed (and may have reused) the routed requests' blocks behind the
        # window: for this call their block-table rows point at their newest (live)
        # block, so every row read is finite.  Selections stay as they are: the CPU
        # kernel's results for one token depend on the others' selections (not on their
        # finite values), so the prefill tokens get exactly what resident serving gives.
        bt = mla.block_table
        tokens_per_block = layer.rows_per_block * layer.compress_ratio
        saved = {}
        for row in plan.rows:
            newest = (int(swa.seq_lens[row]) - 1) // tokens_per_block
            saved[row] = bt[row].clone()
            bt[row] = bt[row, min(newest, bt.shape[1] - 1)]
        try:
            _original_forward_mqa(attn, q, kv, positions, output)
        finally:
            for row, values in saved.items():
                bt[row] = values

    q_r, pos_r = q[idx], positions[idx]

    # Sliding window, exactly as upstream (positions are absolute).
    window = attn.window_size
    local = (pos_r - window + 1).clamp(min=0).unsqueeze(-1) + torch.arange(window, device=q.device)
    local = torch.where(local <= pos_r.unsqueeze(-1), local, torch.full_like(local, -1))
    window_slots = map_local_to_global_slots_cpu(local, req_r, swa.block_table, swa.block_size)
    window_cache = attn.swa_cache_layer.kv_cache
    window_cache_2d = window_cache.view(window_cache.shape[0], -1)

    pool_2d, pool_block = worker.attention_cache(layer)  # pools + arenas as one block
    out_r = torch.empty((idx.numel(),) + tuple(output.shape[1:]), dtype=output.dtype,
                        device=output.device)
    with worker.staging_arena(layer) as arena:  # released once attention has read its rows
        locations = worker.resolve_tokens(layer, plan, topk, arena)  # [T_r, k] int64 rows
        torch.ops._C.flash_mla_with_kvcache_cpu(
            out_r, q_r.contiguous(), window_cache_2d, window_slots, swa.block_size,
            pool_2d, locations, pool_block, attn.attn_sink, attn.scale)
    output[idx] = out_r
