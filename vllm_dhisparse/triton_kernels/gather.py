"""Host -> device row gather, zero-copy from pinned memory.

Copies ``host_rows[miss_src[n, i]]`` to ``device_rows[miss_dst[n, i]]`` for
``i < miss_count[n]`` (``reference.gather_reference``).  The kernel reads the
pinned host pool through its unified address (no staging memcpy) and reads
``miss_count`` on the device (no host sync).

Grid (N, G): G programs per batch row stride over its miss list, program g
taking rows g*ROWS, (g+G)*ROWS, ...  Misses are in host-address order, so
neighbouring programs read neighbouring host rows.  G grows as the batch
shrinks (32 at batch <= 8 down to 4 at batch >= 64), so a small batch still
keeps many copies in flight.  Rows are raw bytes reinterpreted as the widest of
int64 / int32 / int16 / uint8 that divides the row and its alignment.
"""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

_ELEMS_PER_STEP = 2048  # rows x columns copied per program step
_MAX_BLOCK_C = 512  # widest column block; longer rows loop


@triton.jit
def _gather_kernel(
    src_ptr, dst_ptr,  # [R_host, SRC_STRIDE], [R_dev, DST_STRIDE] (elements)
    miss_src_ptr, miss_src_stride,  # [N, M] int64
    miss_dst_ptr, miss_dst_stride,  # [N, M] int32
    miss_count_ptr,  # [N] int32
    SRC_STRIDE: tl.constexpr, DST_STRIDE: tl.constexpr, ROW_ELEMS: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_C: tl.constexpr,
):
    n = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    n_prog = tl.num_programs(1)
    count = tl.load(miss_count_ptr + n)
    rows = tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_C)
    for r0 in range(g * ROWS, count, n_prog * ROWS):
        r = r0 + rows
        rm = r < count
        src = tl.load(miss_src_ptr + n * miss_src_stride + r, mask=rm, other=0)
        dst = tl.load(miss_dst_ptr + n * miss_dst_stride + r, mask=rm, other=0).to(tl.int64)
        src_off = src[:, None] * SRC_STRIDE
        dst_off = dst[:, None] * DST_STRIDE
        for c0 in tl.static_range(0, ROW_ELEMS, BLOCK_C):
            c = c0 + cols
            m = rm[:, None] & (c < ROW_ELEMS)[None, :]
            v = tl.load(src_ptr + src_off + c[None, :], mask=m)
            tl.store(dst_ptr + dst_off + c[None, :], v, mask=m)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


_WORDS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _word_size(t: torch.Tensor, row_bytes: int) -> int:
    """Widest word dividing the row, the row stride and the address of ``t``."""
    b = _bytes(t)
    for w in (8, 4, 2):
        if row_bytes % w == 0 and b.stride(0) % w == 0 and b.data_ptr() % w == 0:
            return w
    return 1


def default_blocks_per_row(n_batch: int) -> int:
    """Copy programs per batch row: 32 at batch <= 8, halving down to 4 at >= 64."""
    return max(4, min(32, triton.next_power_of_2(triton.cdiv(256, max(n_batch, 1)))))


def _pinned_or_capturing(host_rows: torch.Tensor) -> bool:
    """``is_pinned`` queries the driver, which a CUDA graph capture in the default
    (global) mode forbids; a captured launch replays the eager launch before it, which
    every capture follows (vLLM's warm-up, torch's side-stream recipe) and which checked
    the same tensor."""
    return torch.cuda.is_current_stream_capturing() or host_rows.is_pinned()


def check_rows(host_rows, device_rows) -> None:
    """Validates a host/device row pair for a copy (gather_rows, fused resolve copy)."""
    for name, t in (("host_rows", host_rows), ("device_rows", device_rows)):
        if not isinstance(t, torch.Tensor) or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D tensor [rows, width], got "
                             f"{list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
        if t.shape[1] and t.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous, got strides {list(t.stride())}")
    if host_rows.dtype != device_rows.dtype or host_rows.shape[1] != device_rows.shape[1]:
        raise ValueError(f"host_rows and device_rows must have the same dtype and width, got "
                         f"{host_rows.dtype} {list(host_rows.shape)} and "
                         f"{device_rows.dtype} {list(device_rows.shape)}")
    dev = device_rows.device
    if not (dev.type == "cuda" or (dev.type == "cpu" and _interpreting())):
        raise ValueError(f"device_rows is on {dev}: gather_rows needs a CUDA tensor (or CPU "
                         f"with TRITON_INTERPRET=1); use gather_reference on CPU")
    if host_rows.device != dev and not (host_rows.device.type == "cpu" and dev.type == "cuda"
                                        and _pinned_or_capturing(host_rows)):
        raise ValueError(f"host_rows is on {host_rows.device} "
                         f"(pinned={host_rows.device.type == 'cpu' and host_rows.is_pinned()}); "
                         f"it must be on {dev} like device_rows, or in pinned CPU memory")


def plane_views(host_rows, planes):
    """(src, dsts, row_elems): host rows and device planes (consecutive column ranges of
    a row, in order) as the widest word that divides every width, row stride and
    address, or None when there is nothing to copy (zero-width rows)."""
    row_bytes = host_rows.shape[1] * host_rows.element_size()
    if row_bytes == 0:
        return None
    size = _word_size(host_rows, row_bytes)
    for p in planes:
        size = min(size, _word_size(p, p.shape[1] * p.element_size()))
    word = _WORDS[size]
    return _bytes(host_rows).view(word), [_bytes(p).view(word) for p in planes], row_bytes // size


def word_views(host_rows, device_rows):
    """(src, dst, row_elems): both row tensors as the widest common word, or None
    when there is nothing to copy (zero-width rows)."""
    views = plane_views(host_rows, [device_rows])
    return None if views is None else (views[0], views[1][0], views[2])


def gather_rows(host_rows, device_rows, miss_src, miss_dst, miss_count, blocks_per_row=None):
    """Triton ``gather_reference``: one launch, grid (N, blocks_per_row)."""
    check_rows(host_rows, device_rows)
    dev = device_rows.device
    if not isinstance(miss_src, torch.Tensor) or miss_src.dtype != torch.int64 or miss_src.dim() != 2:
        raise ValueError(f"miss_src must be int64 [N, M], got "
                         f"{getattr(miss_src, 'dtype', type(miss_src).__name__)} "
                         f"{list(getattr(miss_src, 'shape', []))}")
    n_batch, width = miss_src.shape
    if (not isinstance(miss_dst, torch.Tensor) or miss_dst.dtype != torch.int32
            or tuple(miss_dst.shape) != (n_batch, width)):
        raise ValueError(f"miss_dst must be int32 [{n_batch}, {width}] like miss_src, got "
                         f"{getattr(miss_dst, 'dtype', type(miss_dst).__name__)} "
                         f"{list(getattr(miss_dst, 'shape', []))}")
    if (not isinstance(miss_count, torch.Tensor) or miss_count.dtype != torch.int32
            or tuple(miss_count.shape) != (n_batch,)):
        raise ValueError(f"miss_count must be int32 [{n_batch}], got "
                         f"{getattr(miss_count, 'dtype', type(miss_count).__name__)} "
                         f"{list(getattr(miss_count, 'shape', []))}")
    for name, t in (("miss_src", miss_src), ("miss_dst", miss_dst), ("miss_count", miss_count)):
        if t.device != dev:
            raise ValueError(f"{name} is on {t.device}; it must be on {dev} like device_rows")
        if t.numel() and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, "
                             f"got strides {list(t.stride())}")
    if blocks_per_row is None:
        blocks_per_row = default_blocks_per_row(n_batch)
    if isinstance(blocks_per_row, bool) or not isinstance(blocks_per_row, int) \
            or not 1 <= blocks_per_row <= 65535:
        raise ValueError(f"blocks_per_row must be an int in [1, 65535], got {blocks_per_row!r}")
    views = word_views(host_rows, device_rows)
    if n_batch == 0 or width == 0 or views is None:
        return
    src, dst, row_elems = views
    block_c = min(triton.next_power_of_2(row_elems), _MAX_BLOCK_C)
    rows = max(1, _ELEMS_PER_STEP // block_c)
    with torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext():
        _gather_kernel[(n_batch, blocks_per_row)](
            src, dst,
            miss_src, miss_src.stride(0),
            miss_dst, miss_dst.stride(0),
            miss_count,
            SRC_STRIDE=src.stride(0), DST_STRIDE=dst.stride(0), ROW_ELEMS=row_elems,
            ROWS=rows, BLOCK_C=block_c,
            num_warps=4,
        )
