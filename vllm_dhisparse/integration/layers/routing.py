"""One step's routing plan: which tokens of vLLM's batch the hierarchy serves, and whose.

The routed attention layer (cpu_attention.py, through the step context) asks
once per layer; the plan for a KV cache group's block tables is built on the
first ask of a step and reused by every later layer of that group.  A batch row belongs to an admitted request
when it holds that request's newest token in its block table: that block is
live (never behind the device window), so it belongs to one running request
only, whereas a request's first blocks may have been freed and handed to
another request.  The match is then checked against the scheduler's numbers
(sequence length and tokens this step), and a mismatch stops the step loudly
instead of resolving one request's tokens against another's tables.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RoutingPlan:
    rows_req: list[str | None]  # batch row -> admitted request id (None: not routed)
    token_idx: torch.Tensor  # [T_r] int64 routed tokens (indices into the batch)
    rows: list[int]  # routed batch rows, ascending
    req_ids: list[str]  # [N] requests with routed tokens, in batch order
    tok_n: torch.Tensor  # [T_r] int64 request (0..N-1) of each routed token
    tok_j: torch.Tensor  # [T_r] int64 query index inside its request (anchor first, eq. 5)
    num_queries: int  # K: most routed tokens of one request
    all_routed: bool  # every token of the batch is routed

    @property
    def any_routed(self) -> bool:
        return bool(self.req_ids)


def newest_blocks(requests, group: int, tokens_per_block: int) -> dict[int, str]:
    """Block holding each admitted request's newest token (this step's) -> request id."""
    newest = {}
    for r in requests:
        blocks = r.block_ids[group] if r.admitted else None
        n = r.num_computed_tokens + r.num_scheduled_tokens
        if blocks and n > 0 and (n - 1) // tokens_per_block < len(blocks):
            newest[blocks[(n - 1) // tokens_per_block]] = r.req_id
    return newest


def check_identity(requests: dict, rows_req: list[str | None], seq_lens: torch.Tensor,
                   token_rows: torch.Tensor) -> None:
    """Every routed batch row is a distinct request whose sequence length and token count
    this step are the ones the scheduler sent for it; raises ``RuntimeError`` otherwise."""
    counts = torch.bincount(token_rows.cpu().to(torch.int64), minlength=len(rows_req)).tolist()
    lens = seq_lens.cpu().tolist()
    seen: set[str] = set()
    for row, rid in enumerate(rows_req):
        if rid is None:
            continue
        req = requests[rid]
        want = req.num_computed_tokens + req.num_scheduled_tokens
        got = lens[row] if row < len(lens) else None
        if rid in seen or got != want or counts[row] != req.num_scheduled_tokens:
            raise RuntimeError(
                f"DHiSparse: batch row {row} resolved to request {rid} but does not match it "
                f"(sequence length {got} vs {want}, {counts[row]} tokens vs "
                f"{req.num_scheduled_tokens} scheduled, seen twice: {rid in seen}); "
                f"refusing to read another request's rows")
        seen.add(rid)


def build_plan(requests: dict, block_table: torch.Tensor, seq_lens: torch.Tensor,
               token_rows: torch.Tensor, group: int, tokens_per_block: int) -> RoutingPlan:
    """block_table [R, blocks] int32, seq_lens [>=R] int32, token_rows [T] (batch row of
    each real token: padding tokens left out)."""
    newest = newest_blocks(requests.values(), group, tokens_per_block)
    n_rows = min(block_table.shape[0], seq_lens.shape[0])
    cols = ((seq_lens[:n_rows].to(torch.int64) - 1).clamp(min=0) // tokens_per_block).cpu()
    cols = cols.clamp(max=block_table.shape[1] - 1)
    ids = block_table[:n_rows].cpu().gather(1, cols.view(-1, 1)).flatten().tolist()
    live = (seq_lens[:n_rows] > 0).cpu().tolist()  # padding rows (length 0) are nobody's
    rows_req = [newest.get(int(b)) if alive else None for b, alive in zip(ids, live)] \
        + [None] * (block_table.shape[0] - n_rows)
    check_identity(requests, rows_req, seq_lens, token_rows)
    token_rows = token_rows.cpu().to(torch.int64)
    routed = torch.tensor([rows_req[r] is not None for r in token_rows.tolist()], dtype=torch.bool)
    token_idx = routed.nonzero().flatten()
    if not token_idx.numel():
        empty = torch.empty(0, dtype=torch.int64)
        return RoutingPlan(rows_req, token_idx, [], [], empty, empty, 0, False)
    # A request's tokens are contiguous in vLLM's batch: request n = n-th run of equal rows,
    # query j = position inside the run.
    runs, tok_n, counts = torch.unique_consecutive(token_rows[token_idx], return_inverse=True,
                                                   return_counts=True)
    starts = torch.cumsum(counts, 0) - counts  # [N]
    tok_j = torch.arange(token_idx.numel()) - starts[tok_n]
    return RoutingPlan(rows_req, token_idx, sorted(set(runs.tolist())),
                       [rows_req[r] for r in runs.tolist()], tok_n, tok_j, int(counts.max()),
                       bool(routed.all()))


class StepRouting:
    """The plans of the current step, one per (KV cache group, tokens per block)."""

    def __init__(self):
        self._plans: dict[tuple[int, int], RoutingPlan] = {}

    def clear(self) -> None:
        """Admissions, failures and a new step change who is routed."""
        self._plans.clear()

    def plan(self, requests: dict, group: int, tokens_per_block: int, block_table: torch.Tensor,
             seq_lens: torch.Tensor, token_rows: torch.Tensor) -> RoutingPlan:
        key = (group, tokens_per_block)
        if key not in self._plans:
            self._plans[key] = build_plan(requests, block_table, seq_lens, token_rows, *key)
        return self._plans[key]
