"""vLLM's DeepSeek-V4 compressed (c4a) cache blocks as FlashMLA reads them.

A block holds 64 rows (256 tokens / compress ratio 4) as two planes and padding:
``[64 x 576 B data][64 x 8 B scales][64 B]`` = 37,440 B, the scale plane at byte
36,864 (vLLM 0.33 ``models/deepseek_v4/attention.py:860-884``,
``common/ops/cache_utils.py:64-74``).  FlashMLA takes a cache as a
``[blocks, rows_per_block, 1, 584]`` view whose ``stride(1)`` is 584 and finds the
scale plane ``rows_per_block * 576`` bytes into each block; an index names
``block * rows_per_block + row``.

The hierarchy's device rows store every row of a storage as one such block
(``[R x 576][R x 8]``, hierarchy/device_pool.py), so :func:`one_block_view` lets
FlashMLA read them in place with the hierarchy's row numbers as indices.
"""
from __future__ import annotations

import torch

DATA_BYTES = 576  # 448 fp8 e4m3 NoPE + 64 bf16 RoPE
SCALE_BYTES = 8  # 7 UE8M0 tile scales + 1 pad
ROW_BYTES = DATA_BYTES + SCALE_BYTES  # 584: FlashMLA picks the V4 format by this last dim
ROWS_PER_BLOCK = 64
BLOCK_STRIDE = 37440  # 64 x 584 rounded up to a multiple of 576
SCALE_PLANE = ROWS_PER_BLOCK * DATA_BYTES  # 36,864


def _check_bytes(storage: torch.Tensor, need: int, what: str) -> None:
    if storage.dtype != torch.uint8 or storage.dim() != 1 or not storage.is_contiguous():
        raise ValueError(f"{what}: storage must be a contiguous 1-D uint8 tensor, got "
                         f"{storage.dtype} {tuple(storage.shape)}")
    if storage.numel() < need:
        raise ValueError(f"{what}: storage holds {storage.numel()} B, the view needs {need} B")


def block_view(storage: torch.Tensor, num_blocks: int,
               block_stride: int = BLOCK_STRIDE) -> torch.Tensor:
    """vLLM's c4a blocks in ``storage``.  # [num_blocks, 64, 1, 584] uint8 (a view)"""
    if block_stride < BLOCK_STRIDE:
        raise ValueError(f"block_stride={block_stride}; allowed >= {BLOCK_STRIDE}")
    _check_bytes(storage, (num_blocks - 1) * block_stride + BLOCK_STRIDE, "block_view")
    return storage.as_strided((num_blocks, ROWS_PER_BLOCK, 1, ROW_BYTES),
                              (block_stride, ROW_BYTES, ROW_BYTES, 1))


def one_block_view(storage: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Rows stored plane by plane, ``[R x 576][R x 8]``, as one FlashMLA block of R rows.
    # [1, R, 1, 584] uint8 (a view)"""
    if num_rows * ROW_BYTES >= 2**31:
        # FlashMLA's block stride is a C int
        raise ValueError(f"one_block_view: {num_rows} rows of {ROW_BYTES} B exceed 2**31 B")
    _check_bytes(storage, num_rows * ROW_BYTES, "one_block_view")
    return storage.as_strided((1, num_rows, 1, ROW_BYTES),
                              (num_rows * ROW_BYTES, ROW_BYTES, ROW_BYTES, 1))


def as_blocks_2d(cache: torch.Tensor) -> torch.Tensor:
    """A FlashMLA cache view as ``[blocks, block_stride]`` bytes, the form vLLM's CPU
    op takes.  # [blocks, stride(0)] uint8 (a view)"""
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != ROW_BYTES:
        raise ValueError(f"expected a [blocks, rows, 1, {ROW_BYTES}] view, got "
                         f"{tuple(cache.shape)}")
    return cache.as_strided((cache.shape[0], cache.stride(0)), (cache.stride(0), 1))


def global_indices(block_table: torch.Tensor, req_of_token: torch.Tensor,
                   local: torch.Tensor, rows_per_block: int = ROWS_PER_BLOCK) -> torch.Tensor:
    """Request-local compressed positions to indices into vLLM's blocks:
    ``block_table[req, pos // 64] * 64 + pos % 64``; -1 stays -1.

    block_table [N, max_blocks] int32, req_of_token [T] int, local [T, k] int32.
    # [T, k] int32"""
    pos = local.long().clamp(min=0)
    table = block_table.long()[req_of_token.long()]  # [T, max_blocks]
    blk = torch.gather(table, 1, pos // rows_per_block)
    idx = blk * rows_per_block + pos % rows_per_block
    return torch.where(local >= 0, idx, torch.full_like(idx, -1)).to(torch.int32)
