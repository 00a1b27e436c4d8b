"""Torch reference of FlashMLA's DeepSeek-V4 sparse decode (``flash_mla_with_kvcache``
with ``indices``, fp8 584-B rows, an ``extra_k_cache``), the specification the routed
decode is held to on CPU.

Semantics (vLLM 0.33 ``third_party/flashmla/flash_mla_interface.py:60-205``): one
softmax over the rows ``indices`` names in ``k_cache`` and the rows
``extra_indices_in_kvcache`` names in ``extra_k_cache``; an entry is ignored when it
is -1 or at a position >= its batch entry's length; K = V = the dequantized 512-wide
row; the sink scales the output by ``1 / (1 + exp(sink - lse))``; no valid row gives 0.
That is the math of vLLM's CPU op ``flash_mla_with_kvcache_cpu``, whose eager version
(eager_v4/) computes it here; this module maps FlashMLA's arguments onto it.
"""
from __future__ import annotations

import torch

from vllm_dhisparse.eager_v4.attention_ops import flash_mla_with_kvcache_cpu

from .layout import ROW_BYTES, as_blocks_2d


def _masked(indices: torch.Tensor, lengths: torch.Tensor | None) -> torch.Tensor:
    """indices [B, s_q, k] with entries at positions >= lengths[b] set to -1.
    # [B * s_q, k] int64"""
    idx = indices.long()
    if lengths is not None:
        pos = torch.arange(idx.shape[-1], device=idx.device)
        idx = torch.where(pos < lengths.long().view(-1, 1, 1), idx, -1)
    return idx.reshape(-1, idx.shape[-1])


def _check(name: str, cache: torch.Tensor, indices: torch.Tensor, q: torch.Tensor) -> None:
    if cache.dtype != torch.uint8 or cache.dim() != 4 or cache.shape[-1] != ROW_BYTES:
        raise ValueError(f"{name}: expected a uint8 [blocks, rows, 1, {ROW_BYTES}] cache, got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    if indices.dim() != 3 or indices.shape[:2] != q.shape[:2]:
        raise ValueError(f"{name}: indices {tuple(indices.shape)} must be [B, s_q, k] with "
                         f"q's [B, s_q] = {tuple(q.shape[:2])}")


def sparse_decode(q: torch.Tensor, k_cache: torch.Tensor, indices: torch.Tensor,
                  topk_length: torch.Tensor | None, attn_sink: torch.Tensor,
                  softmax_scale: float, extra_k_cache: torch.Tensor | None = None,
                  extra_indices: torch.Tensor | None = None,
                  extra_topk_length: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, s_q, H, 512] bf16; caches [blocks, rows, 1, 584] uint8 views; indices
    [B, s_q, k] int32; lengths [B] int32 or None; attn_sink [H] fp32.
    # [B, s_q, H, 512] bf16"""
    if q.dim() != 4 or q.shape[-1] != 512:
        raise ValueError(f"q must be [B, s_q, H, 512], got {tuple(q.shape)}")
    _check("k_cache", k_cache, indices, q)
    b, s_q, h, d = q.shape
    slots = _masked(indices, topk_length)
    if extra_k_cache is None:
        # an empty extra cache: every entry invalid
        extra_2d = torch.zeros(1, ROW_BYTES, dtype=torch.uint8, device=q.device)
        extra_slots, extra_rows = torch.full((b * s_q, 1), -1, device=q.device), 1
    else:
        _check("extra_k_cache", extra_k_cache, extra_indices, q)
        extra_2d, extra_rows = as_blocks_2d(extra_k_cache), extra_k_cache.shape[1]
        extra_slots = _masked(extra_indices, extra_topk_length)
    out = torch.empty(b * s_q, h, d, dtype=torch.bfloat16, device=q.device)
    flash_mla_with_kvcache_cpu(out, q.reshape(b * s_q, h, d), as_blocks_2d(k_cache), slots,
                               k_cache.shape[1], extra_2d, extra_slots, extra_rows,
                               attn_sink, softmax_scale)
    return out.view(b, s_q, h, d)
