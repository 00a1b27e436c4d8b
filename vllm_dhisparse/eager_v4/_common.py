"""Shared pieces of the eager DeepSeek-V4 attention/indexer ops: GPT-J RoPE,
FP8 (e4m3) block quantization and the paged cache byte layouts.

Cache layouts (read from vLLM's ``csrc/cpu/sgl-kernels/store_cache.cpp``,
``flash_mla.cpp``, ``compressor.cpp``, ``paged_mqa_logits.cpp``). Each cache
is viewed 2-D as ``[num_blocks, block_bytes]`` (uint8); the row stride between
blocks may exceed ``block_bytes`` (pooled allocations), so rows are always
addressed as ``(block, byte offset inside the block)``, never by flattening.

- ``fp8_ds_mla`` (SWA and compressed attention caches, head_dim 512), per block
  of ``bs`` rows::

      [bs * 576 B: per row 448 B fp8 e4m3 "nope" + 64 bf16 rope (128 B)]
      [bs *   8 B: per row 7 UE8M0 scale bytes (one per 64-wide tile) + 1 pad]

  UE8M0 byte ``e`` means the scale ``2 ** (e - 127)`` (0 -> 0, 255 -> NaN).
- indexer K cache (head_dim 128), per block of ``bs`` rows::

      [bs * 128 B: per row 128 fp8 e4m3][bs * 4 B: per row one fp32 scale]
"""
from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0

# fp8_ds_mla
NOPE_DIM = 448
ROPE_DIM = 64
HEAD_DIM = NOPE_DIM + ROPE_DIM  # 512
TILE = 64
NUM_TILES = NOPE_DIM // TILE  # 7
ROW_DATA_BYTES = NOPE_DIM + 2 * ROPE_DIM  # 576
ROW_SCALE_BYTES = NUM_TILES + 1  # 8
QUANT_EPS = 1e-4

# indexer K cache
IDX_HEAD_DIM = 128
IDX_SCALE_BYTES = 4


# ---------------------------------------------------------------- RoPE (GPT-J)
def gptj_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              inverse: bool = False) -> torch.Tensor:
    """Interleaved (GPT-J) rotation of the last dim of ``x`` (fp32).

    Pairs are ``(x[2i], x[2i+1])`` with angle ``i``; ``cos``/``sin`` are
    ``[..., dim/2]`` and broadcast against ``x[..., ::2]``. Forward:
    ``(e cos - o sin, e sin + o cos)``; inverse: ``(e cos + o sin, o cos - e sin)``.
    """
    e, o = x[..., 0::2], x[..., 1::2]
    if inverse:
        re, ro = e * cos + o * sin, o * cos - e * sin
    else:
        re, ro = e * cos - o * sin, e * sin + o * cos
    return torch.stack((re, ro), dim=-1).flatten(-2)


def cos_sin_at(cos_sin_cache: torch.Tensor, pos: torch.Tensor, rope_dim: int):
    """``cos_sin_cache`` rows are ``[cos(rope_dim/2) | sin(rope_dim/2)]``."""
    cs = cos_sin_cache[pos.long()].float()
    half = rope_dim // 2
    return cs[..., :half], cs[..., half:rope_dim]


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


# ---------------------------------------------------------------- FP8 helpers
def to_fp8_bytes(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp8 e4m3 (RNE, clamped to +-448) -> raw bytes (uint8)."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8).view(torch.uint8)


def fp8_bytes_to_float(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(FP8).float()


def ue8m0_to_float(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 byte -> 2**(b-127); 0 -> 0 and 255 -> NaN, as the kernels read it."""
    v = torch.exp2(b.float() - 127.0)
    v = torch.where(b == 0, torch.zeros_like(v), v)
    return torch.where(b == 255, torch.full_like(v, float("nan")), v)


def quant_tiles_ue8m0(nope: torch.Tensor):
    """Quantize ``[N, 448]`` fp32 (already bf16-rounded) in 64-wide tiles.

    Per tile: ``s = 2**ceil(log2(max(amax/448, 1e-4)))``; value bytes are
    ``fp8(x / s)``; scale byte is ``log2(s) + 127``. Returns
    ``(fp8 bytes [N, 448], scale bytes [N, 8])`` (the 8th byte is 0 padding).
    """
    n = nope.shape[0]
    tiles = nope.reshape(n, NUM_TILES, TILE)
    amax = tiles.abs().amax(dim=-1)
    exp = torch.ceil(torch.log2(torch.clamp(amax / FP8_MAX, min=QUANT_EPS)))
    q = to_fp8_bytes(tiles * torch.exp2(-exp).unsqueeze(-1)).reshape(n, NOPE_DIM)
    scales = torch.zeros(n, ROW_SCALE_BYTES, dtype=torch.uint8, device=nope.device)
    scales[:, :NUM_TILES] = (exp + 127).to(torch.uint8)
    return q, scales


def quant_row_pow2(x: torch.Tensor, amax_floor: float = QUANT_EPS):
    """One power-of-two scale per row of ``x`` ``[..., D]`` (indexer layout).

    ``s = 2**ceil(log2(max(amax, 1e-4) / 448))``; returns ``(fp8 bytes, s)``.
    """
    amax = x.abs().amax(dim=-1).clamp(min=amax_floor)
    s = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    return to_fp8_bytes(x / s.unsqueeze(-1)), s


# ------------------------------------------------------- paged byte addressing
def split_slots(slots: torch.Tensor, block_size: int):
    slots = slots.long()
    return torch.div(slots, block_size, rounding_mode="floor"), slots % block_size


def write_bytes(cache_2d: torch.Tensor, block: torch.Tensor, offset: torch.Tensor,
                data: torch.Tensor) -> None:
    """``cache_2d[block[i], offset[i] + j] = data[i, j]`` (in place, any row stride)."""
    cols = offset.unsqueeze(-1) + torch.arange(data.shape[-1], device=data.device)
    cache_2d[block.unsqueeze(-1), cols] = data


def read_bytes(cache_2d: torch.Tensor, block: torch.Tensor, offset: torch.Tensor,
               nbytes: int) -> torch.Tensor:
    cols = offset.unsqueeze(-1) + torch.arange(nbytes, device=cache_2d.device)
    return cache_2d[block.unsqueeze(-1), cols]


def region(cache_2d: torch.Tensor, block_size: int, row_bytes: int,
           base: int = 0) -> torch.Tensor:
    """Strided ``[num_blocks, block_size, row_bytes]`` view of one per-row
    region of every block (rows of ``row_bytes`` starting at byte ``base``);
    indexing it with ``[block, pos]`` reads or writes whole rows in place."""
    assert cache_2d.stride(1) == 1
    return cache_2d.as_strided((cache_2d.shape[0], block_size, row_bytes),
                               (cache_2d.stride(0), row_bytes, 1),
                               cache_2d.storage_offset() + base)


def store_ds_mla_rows(cache_2d: torch.Tensor, slots: torch.Tensor, block_size: int,
                      nope_bf16: torch.Tensor, rope: torch.Tensor) -> None:
    """Quantize and write rows of the fp8_ds_mla layout at ``slots`` (all >= 0).

    ``nope_bf16`` ``[N, 448]`` fp32 values already rounded to bf16 (the tile
    quantizer's input); ``rope`` ``[N, 64]`` fp32, stored as bf16.
    """
    if slots.numel() == 0:
        return
    q, scales = quant_tiles_ue8m0(nope_bf16)
    rope_bytes = rope.to(torch.bfloat16).contiguous().view(torch.uint8)
    block, pos = split_slots(slots, block_size)
    region(cache_2d, block_size, ROW_DATA_BYTES)[block, pos] = torch.cat([q, rope_bytes], 1)
    region(cache_2d, block_size, ROW_SCALE_BYTES, block_size * ROW_DATA_BYTES)[block, pos] = (
        scales)


def load_ds_mla_rows(cache_2d: torch.Tensor, slots: torch.Tensor,
                     block_size: int) -> torch.Tensor:
    """Dequantize fp8_ds_mla rows at ``slots`` (all valid) -> ``[N, 512]`` fp32:
    nope = fp8 * tile scale, rope = the stored bf16."""
    block, pos = split_slots(slots, block_size)
    data = region(cache_2d, block_size, ROW_DATA_BYTES)[block, pos]
    scales = region(cache_2d, block_size, ROW_SCALE_BYTES,
                    block_size * ROW_DATA_BYTES)[block, pos][:, :NUM_TILES]
    n = data.shape[0]
    nope = fp8_bytes_to_float(data[:, :NOPE_DIM]).view(n, NUM_TILES, TILE)
    nope = (nope * ue8m0_to_float(scales).unsqueeze(-1)).view(n, NOPE_DIM)
    rope = data[:, NOPE_DIM:].contiguous().view(torch.bfloat16).float()
    return torch.cat([nope, rope], dim=1)


# ------------------------------------------------------------- compressor pool
def compressor_pool(state_cache: torch.Tensor, gather_slots: torch.Tensor,
                    compress_ratio: int, head_dim: int) -> torch.Tensor:
    """Softmax-pooled compressed rows (compressor.cpp's shared prologue).

    ``state_cache`` ``[num_blocks, bs, 2 * W]`` fp32 holds per raw token
    ``[kv (W) | score + ape (W)]`` with ``W = coff * head_dim``;
    ``gather_slots`` ``[N, window]`` (-1 = absent). Window entry ``w`` reads
    the first head_dim half of ``kv``/``score`` when ``w < compress_ratio`` and
    the second half otherwise (overlapping windows). Per channel ``d``:
    ``out[d] = sum_w softmax_w(score[w, d]) * kv[w, d]`` over present entries.
    Returns ``[N, head_dim]`` fp32.
    """
    n, window = gather_slots.shape
    width = state_cache.shape[2] // 2
    valid = gather_slots >= 0
    block, pos = split_slots(gather_slots.clamp(min=0), state_cache.shape[1])
    rows = state_cache[block, pos].float()  # [N, window, 2W]
    half = (torch.arange(window, device=rows.device) >= compress_ratio).long() * head_dim
    cols = half.view(1, window, 1) + torch.arange(head_dim, device=rows.device)
    kv = torch.gather(rows, 2, cols.expand(n, window, head_dim))
    score = torch.gather(rows, 2, (cols + width).expand(n, window, head_dim))
    score = score.masked_fill(~valid.unsqueeze(-1), float("-inf"))
    weight = torch.softmax(score, dim=1)
    return (weight * kv.masked_fill(~valid.unsqueeze(-1), 0.0)).sum(dim=1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    inv = torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = x * inv
    return y * weight.float() if weight is not None else y
