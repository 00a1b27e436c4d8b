"""The worker's view of vLLM's requests, kept in step with the scheduler's metadata."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..metadata import DHiSparseMetadata, RequestStep


@dataclass
class TrackedRequest:
    req_id: str
    prompt_len: int
    max_tokens: int
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0  # this step's tokens (prefill chunk, or anchor + drafts)
    num_spec_tokens: int = 0  # of those, drafts: computed this step but never committed
    num_unverified_tokens: int = 0  # of num_computed_tokens, drafts not verified yet
    prefill_complete: bool = False  # its known tokens are computed (or are this step)
    admitted: bool = False
    loaded: bool = False  # admitted from a handoff, not scheduled yet
    failed: str | None = None
    rows: dict[str, int] = field(default_factory=dict)  # committed rows per source

    @property
    def num_verified_tokens(self) -> int:
        return self.num_computed_tokens - self.num_unverified_tokens


class RequestTable(dict):
    """request id -> :class:`TrackedRequest` of the requests vLLM has scheduled."""

    def ended(self, meta: DHiSparseMetadata) -> list[tuple[TrackedRequest, bool]]:
        """Finished and preempted requests leave the table: ``(request, preempted)``."""
        out = []
        for rid in sorted(meta.finished | meta.preempted):
            req = self.pop(rid, None)
            if req is not None:
                out.append((req, rid in meta.preempted))
        return out

    def update(self, rs: RequestStep) -> tuple[TrackedRequest, TrackedRequest | None]:
        """This step's facts about one request: ``(request, replaced)`` where
        ``replaced`` is the admitted request a resume replaces (release it first)."""
        req, replaced = self.get(rs.req_id), None
        if req is not None and req.loaded:  # first step after its handoff was admitted
            req.loaded = False
            req.block_ids = [list(b) for b in rs.block_ids or ()]
        elif req is None or rs.replace_blocks:
            if req is not None and req.admitted:  # resumed after preemption
                replaced = req
            req = TrackedRequest(rs.req_id, rs.prompt_len, rs.max_tokens,
                                 [list(b) for b in rs.block_ids or ()])
            self[rs.req_id] = req
        elif rs.block_ids is not None:
            for group, new in zip(req.block_ids, rs.block_ids):
                group.extend(new)
        req.num_computed_tokens = rs.num_computed_tokens
        req.num_scheduled_tokens = rs.num_scheduled_tokens
        req.num_spec_tokens = rs.num_spec_tokens
        req.num_unverified_tokens = rs.num_unverified_tokens
        return req, replaced
