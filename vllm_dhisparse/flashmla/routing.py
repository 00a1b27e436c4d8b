"""Which request slot each decode token reads, found on the device from vLLM's metadata.

vLLM 0.33's FlashMLA decode sees tokens, not requests: ``token_to_req_indices`` [T],
``is_valid_token`` [T] (graph padding is invalid), the block table and ``seq_lens`` of
the step's requests, and the indexer's request-local top-k [T, k].  The routed decode
needs each token's request slot in the hierarchy without a host read, so that a FULL
CUDA graph can capture it and replay it while requests come and go:

* ``slot_by_block`` [num_vllm_blocks] int32, written before the forward (outside
  graphs): the block holding an admitted request's newest token -> its request slot,
  every other block -1.  The newest token's block is never freed by the device window.
* :func:`token_req_slots` looks the slot up per token; invalid tokens and requests the
  hierarchy does not hold get -1, which the resolver treats as a padding row (reads
  nothing, changes nothing).

Pure torch, no synchronisation, fixed shapes.
"""
from __future__ import annotations

import torch


def write_slot_by_block(slot_by_block: torch.Tensor, newest_blocks: torch.Tensor,
                        req_slots: torch.Tensor) -> None:
    """Rewrites the table for this step: ``slot_by_block[newest_blocks[i]] = req_slots[i]``,
    every other entry -1.  newest_blocks, req_slots [R] int (one per admitted request)."""
    if newest_blocks.shape != req_slots.shape:
        raise ValueError(f"newest_blocks {tuple(newest_blocks.shape)} and req_slots "
                         f"{tuple(req_slots.shape)} must be one entry per admitted request")
    slot_by_block.fill_(-1)
    dev = slot_by_block.device
    slot_by_block[newest_blocks.to(dev, torch.int64)] = req_slots.to(dev, torch.int32)


def req_slots(slot_by_block: torch.Tensor, block_table: torch.Tensor,
              seq_lens: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Request slot per batch row, from its newest token's block (-1: not held).

    slot_by_block [num_blocks] int32; block_table [R, max_blocks] int32; seq_lens [R]
    (tokens, the newest included).  # [R] int32"""
    if block_table.shape[0] != seq_lens.shape[0]:
        raise ValueError(f"block_table {tuple(block_table.shape)} needs a row per seq_lens "
                         f"{tuple(seq_lens.shape)}")
    newest = ((seq_lens.long() - 1).clamp(min=0) // block_tokens).view(-1, 1)  # [R, 1]
    blocks = torch.gather(block_table.long(), 1, newest).view(-1)  # [R]
    return slot_by_block[blocks]


def token_req_slots(slot_by_block: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, token_to_req: torch.Tensor,
                    is_valid: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Request slot per token, -1 for padding and for requests outside the hierarchy.

    token_to_req [T]; is_valid [T] bool; the rest as :func:`req_slots`.  # [T] int32"""
    if token_to_req.shape != is_valid.shape:
        raise ValueError(f"token_to_req {tuple(token_to_req.shape)} needs an entry per "
                         f"is_valid {tuple(is_valid.shape)}")
    per_req = req_slots(slot_by_block, block_table, seq_lens, block_tokens)  # [R]
    per_token = per_req[token_to_req.long()]  # [T]
    return torch.where(is_valid, per_token, torch.full_like(per_token, -1)).to(torch.int32)


def topk_lengths(local: torch.Tensor, is_valid: torch.Tensor) -> torch.Tensor:
    """FlashMLA's ``extra_topk_length`` as vLLM computes it: the count of selected rows
    (>= 0) of each valid token, 0 for padding.  local [T, k] int32, is_valid [T].
    # [T] int32"""
    count = (local >= 0).sum(-1, dtype=torch.int32)
    return torch.where(is_valid, count, torch.zeros_like(count))


def group_queries(local: torch.Tensor, token_slots: torch.Tensor, queries: int):
    """A uniform decode batch (FULL graphs: every request has ``queries`` tokens, the
    anchor and its drafts, next to each other) as the resolver's batch rows:
    ``(selections [N, queries, k] int32, req_slots [N] int32)``."""
    t, k = local.shape
    if t % queries:
        raise ValueError(f"{t} decode tokens do not split into groups of {queries} queries")
    # the resolver reads request slots as a contiguous [N] tensor
    return (local.view(t // queries, queries, k),
            token_slots.view(t // queries, queries)[:, 0].contiguous())
