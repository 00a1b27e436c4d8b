"""DeepSeek-V4's CPU sparse attention with the c4a top-k rows read through the hierarchy.

``DeepseekV4CPUAttention.forward_mqa`` (vllm/models/deepseek_v4/cpu/cpu_sparse.py:561)
maps the indexer's request-local compressed positions to slots of vLLM's paged cache
and calls the sparse attention op.  For tokens of requests the hierarchy has admitted,
:class:`RoutedDeepseekV4CPUAttention` instead resolves those positions (eq. 2, 6, 12)
to rows of the hierarchy's device storage -- hot cache, tail, optional history,
staging arena -- through the bound step's context (step_context.py), and runs the same
op on that storage.  The sliding-window part, the dense compressed (c128a) layers and
tokens of requests still in prefill are computed as upstream does.

A batch that mixes routed tokens with prefill tokens runs the op twice: once over the
whole batch on vLLM's cache, whose results for the prefill tokens are exactly
resident serving's (the CPU op's result for one token depends on the other tokens'
selections, so it must see the same batch), and once over the routed tokens on the
hierarchy's storage, whose outputs replace the first call's for those tokens.  In the
first call the routed requests' rows read their newest block (never freed) through a
copy of the block table: blocks behind the device window may be freed and reused.
"""
from __future__ import annotations

import torch
from vllm.forward_context import get_forward_context
from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention
from vllm.models.deepseek_v4.cpu.cpu_utils import map_local_to_global_slots_cpu

from vllm_dhisparse.compat.targets import expect

from .. import kv_spec
from . import step_context

UPSTREAM = "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention"


def check() -> None:
    """What this module needs from vLLM, checked at start-up."""
    expect(f"{UPSTREAM}.forward_mqa", ("q", "kv", "positions", "output"), exact=True)
    expect(f"{UPSTREAM}.get_kv_cache_spec", ("vllm_config",), exact=True)
    expect("vllm.models.deepseek_v4.cpu.cpu_utils:map_local_to_global_slots_cpu",
           ("local_indices", "req_idx", "block_table", "block_size"))
    expect("vllm.forward_context:get_forward_context")


class RoutedDeepseekV4CPUAttention(DeepseekV4CPUAttention):
    """A c4a layer (compress ratio 4, top-k indexer) whose history the hierarchy holds."""

    def get_kv_cache_spec(self, vllm_config):
        return kv_spec.windowed(super().get_kv_cache_spec(vllm_config), vllm_config)

    def forward_mqa(self, q, kv, positions, output):
        ctx = step_context.current()
        layer = ctx.layer(self.prefix) if ctx is not None else None
        meta = get_forward_context().attn_metadata
        if layer is None or meta is None:
            return super().forward_mqa(q, kv, positions, output)
        swa, mla = meta[self.swa_cache_layer.prefix], meta[self.prefix]
        req_idx = swa.token_to_req_indices  # [T] row of each token in the block tables
        num_tokens = q.shape[0]
        qsl = getattr(swa, "query_start_loc_cpu", None)  # padding tokens map to row 0: leave out
        real = min(num_tokens, int(qsl[-1])) if qsl is not None and qsl.numel() else num_tokens
        plan = ctx.plan(layer, mla.block_table, swa.seq_lens, req_idx[:real])
        if not plan.any_routed:
            return super().forward_mqa(q, kv, positions, output)
        idx = plan.token_idx  # [T_r]
        topk = self.topk_indices_buffer[:num_tokens][idx]  # [T_r, k] request-local rows (a copy)
        window_cache = self.swa_cache_layer.kv_cache
        window_cache_2d = window_cache.view(window_cache.shape[0], -1)
        window_slots = self._window_slots(positions, req_idx, swa)  # [T, W]
        if not plan.all_routed:
            tokens_per_block = layer.rows_per_block * layer.compress_ratio
            table = mla.block_table.clone()  # [R, blocks] int32; vLLM's stays as it is
            for row in plan.rows:
                newest = (int(swa.seq_lens[row]) - 1) // tokens_per_block
                table[row] = table[row, min(newest, table.shape[1] - 1)]
            rows_per_block = mla.block_size // self.compress_ratio
            slots = map_local_to_global_slots_cpu(
                self.topk_indices_buffer[:num_tokens], req_idx, table, rows_per_block)
            torch.ops._C.flash_mla_with_kvcache_cpu(
                output, q, window_cache_2d, window_slots, swa.block_size,
                self.kv_cache.view(self.kv_cache.shape[0], -1), slots, rows_per_block,
                self.attn_sink, self.scale)
        storage_2d, storage_block = ctx.storage(layer)
        out_r = torch.empty((idx.numel(),) + tuple(output.shape[1:]), dtype=output.dtype,
                            device=output.device)
        with ctx.staging_arena(layer) as arena:  # released once attention has read its rows
            locations = ctx.resolve(layer, plan, topk, arena)  # [T_r, k] int64 rows
            torch.ops._C.flash_mla_with_kvcache_cpu(
                out_r, q[idx].contiguous(), window_cache_2d, window_slots[idx], swa.block_size,
                storage_2d, locations, storage_block, self.attn_sink, self.scale)
        output[idx] = out_r

    def _window_slots(self, positions, req_idx, swa) -> torch.Tensor:
        """Sliding-window slots of every token, as upstream computes them.  # [T, W] int64"""
        window = self.window_size
        local = (positions - window + 1).clamp(min=0).unsqueeze(-1) \
            + torch.arange(window, device=positions.device)
        local = torch.where(local <= positions.unsqueeze(-1), local, torch.full_like(local, -1))
        return map_local_to_global_slots_cpu(local, req_idx, swa.block_table, swa.block_size)
