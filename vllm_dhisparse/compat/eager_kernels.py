"""Eager torch replacements for two vLLM Triton kernels too slow when interpreted.

Under ``TRITON_INTERPRET=1`` every Triton program instance runs as Python;
these two launch one program per token / per (block, segment, chunk) and
dominate step time (a 3000-token prefill: ~70 s interpreted, ~3 s eager).
Both replacements are checked equal to the interpreted kernels in
``tests/compat/test_eager_kernels.py``.

- ``_COMPUTE_SWA_INDICES_AND_LENS_KERNEL``
  (``v1/attention/backends/mla/sparse_swa.py:1042-1122`` kernel,
  ``:1125-1221`` launcher, instance ``:1382``; called from the builder at
  ``:658``, ``:705``, ``:876``): per-token sliding-window slot ids.
  The builder looks the module global up at call time, so rebinding it is
  enough; ``register_warmup`` etc. are delegated to the original object.
- ``_zero_kv_blocks_kernel`` (``v1/worker/utils.py:60-98``), launched by
  ``KVBlockZeroer.zero_block_ids`` (``:226-253``) for newly allocated KV
  blocks (both model runners). Replaced by ``ctypes.memset`` over the same
  precomputed (address, block stride, page size) segment table.
"""

import ctypes

import torch

from .targets import expect

SWA_KERNEL = "vllm.v1.attention.backends.mla.sparse_swa:_COMPUTE_SWA_INDICES_AND_LENS_KERNEL"
ZEROER = "vllm.v1.worker.utils:KVBlockZeroer"


def compute_swa_indices_and_lens(
    swa_indices: torch.Tensor,  # [>=num_tokens, >=index_width] int32, out
    swa_lens: torch.Tensor,  # [>=num_tokens] int32, out
    window_size: int,
    index_width: int,
    left_visible: torch.Tensor,  # [tokens] int32, read only if has_image
    right_visible: torch.Tensor,
    query_start_loc: torch.Tensor,  # [num_reqs + 1] int32
    seq_lens: torch.Tensor,  # [num_reqs] int32
    token_to_req_indices: torch.Tensor,  # [tokens] int32
    is_valid_token: torch.Tensor,  # [tokens] bool
    block_table: torch.Tensor,  # [num_reqs, max_blocks] int32
    block_size: int,
    replay_start: torch.Tensor,  # [num_reqs] int32
    *,
    num_tokens: int,
    token_offset: int,
    has_image: bool = False,
) -> None:
    """Torch version of ``_compute_swa_indices_and_lens_kernel`` (same writes)."""
    if num_tokens == 0:
        return
    tok = torch.arange(num_tokens, device=swa_indices.device) + token_offset
    valid = is_valid_token[tok].bool()
    # Padded (invalid) tokens may carry any request index; never dereference it.
    req = torch.where(valid, token_to_req_indices[tok].long(), 0)
    q_start = query_start_loc[req].long()
    q_len = query_start_loc[req + 1].long() - q_start
    seq_len = seq_lens[req].long()
    pos = seq_len - q_len + tok - q_start
    if has_image:
        left = left_visible[tok].long()
        right = right_visible[tok].long()
    else:
        left = torch.zeros_like(pos)
        right = torch.zeros_like(pos)
    left_add = (left - (window_size - 1)).clamp(min=0)
    start = (pos - (window_size - 1) - left_add).clamp(min=0)
    start = torch.maximum(start, replay_start[req].long())
    end = pos + right + 1
    lens = end - start

    offset = torch.arange(index_width, device=swa_indices.device)
    pos_offset = start[:, None] + offset  # [T, W]
    in_window = offset[None, :] < lens[:, None]
    block_idx = torch.where(in_window, pos_offset // block_size, 0)
    block_num = block_table[req[:, None], block_idx].long()
    slots = torch.where(in_window, block_num * block_size + pos_offset % block_size, -1)
    slots = torch.where(valid[:, None], slots, -1)

    swa_lens[:num_tokens] = torch.where(valid, lens, 0).to(swa_lens.dtype)
    # vLLM 0.32's builders pass [tokens, 1, width] buffers (the kernel writes
    # row pid at pid * stride(0)); merge the trailing dims as a view.
    rows = swa_indices.flatten(1) if swa_indices.dim() > 2 else swa_indices
    assert rows.data_ptr() == swa_indices.data_ptr()
    rows[:num_tokens, :index_width] = slots.to(swa_indices.dtype)


class EagerSWAIndicesAndLens:
    """Drop-in for ``sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL``."""

    def __init__(self, triton_kernel) -> None:
        self.triton_kernel = triton_kernel

    def __call__(self, *args, **kwargs) -> None:
        compute_swa_indices_and_lens(*args, **kwargs)

    def __getattr__(self, name: str):
        # register_warmup / get_warmup_keys etc. stay with the Triton object.
        return getattr(self.triton_kernel, name)


def zero_block_ids(self, block_ids: list[int]) -> None:
    """Eager ``KVBlockZeroer.zero_block_ids``: memset each block's page per segment."""
    if not block_ids or self._meta is None:
        return
    seg_addrs, seg_block_strides, seg_page_sizes, _, _, _ = self._meta
    assert seg_addrs.device.type == "cpu", "eager zeroing reads host addresses"
    for addr, stride_el, page_el in zip(
        seg_addrs.tolist(), seg_block_strides.tolist(), seg_page_sizes.tolist()
    ):
        # Units are int32 elements, as in the kernel.
        for block_id in block_ids:
            ctypes.memset(addr + block_id * stride_el * 4, 0, page_el * 4)


def apply() -> None:
    current = expect(SWA_KERNEL)
    expect(f"{ZEROER}.zero_block_ids", ("block_ids",))
    sparse_swa = expect(SWA_KERNEL.partition(":")[0] + ":")
    if not isinstance(current, EagerSWAIndicesAndLens):
        sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL = EagerSWAIndicesAndLens(current)
    expect(ZEROER).zero_block_ids = zero_block_ids
