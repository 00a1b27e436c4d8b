"""Scheduler half of the connector: follows requests and ships per-step facts to workers.

The hierarchy itself lives in the workers (it owns device and host memory);
the scheduler half only translates vLLM's ``SchedulerOutput`` into
:class:`DHiSparseMetadata`.  vLLM's own prefix cache serves hits; external KV
comes from a prefill instance (``handoff/scheduler.py``, kv_consumer) or from
the host prefix entries of earlier requests (``host_prefix/index.py``).

It also decides when a request's prefill is complete: in the step that
computes the last of its known tokens (the prompt, or the prompt and the
outputs a resumed request replays), whatever the chunking or prefix hit
before.  The worker admits the request after that forward, and the c4a
window (kv_spec.py) starts freeing blocks only from then on.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from ..handoff.scheduler import HandoffScheduler
from ..host_prefix.index import PrefixIndex
from ..metadata import DHiSparseMetadata, RequestStep

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


class SchedulerSide:
    def __init__(self, max_model_len: int, handoff: HandoffScheduler | None = None,
                 prefix: PrefixIndex | None = None, rewrites_before_preemptions: bool = False):
        self.max_model_len = max_model_len
        # the model runner writes a step's new blocks before handle_preemptions
        self.rewrites_before_preemptions = rewrites_before_preemptions
        # kv_both (one instance serving alone) without one: P/D parameters are ignored
        self.handoff = handoff or HandoffScheduler("kv_both", None, "", None)
        self.prefix = prefix or PrefixIndex(0, None, False)
        self._requests: dict[str, "Request"] = {}
        self._prefilled: set[str] = set()  # prefill complete (until preempted)
        self._finished: set[str] = set()
        self._step = 0
        # request id -> computed tokens at which its (re)prefill completes; the c4a window
        # managers read it (kv_spec.py; DHiSparseScheduler hands it to them)
        self.window_from: dict[str, int] = {}

    def on_new_request(self, request: "Request") -> None:
        self._requests[request.request_id] = request
        self.handoff.on_new_request(request)

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        """A producer's handoff was captured when the prefill completed: the blocks can
        go at once, and the answer carries what the decode instance pulls.  A host prefix
        capture keeps them until the worker has copied them (``finished_sending``)."""
        rid = request.request_id
        self._finished.add(rid)
        self._requests.pop(rid, None)
        capture = self.prefix.on_ended(request)
        prefilled = rid in self._prefilled
        self._prefilled.discard(rid)
        self.window_from.pop(rid, None)
        return capture, self.handoff.request_finished(request, prefilled)

    def _completes_prefill(self, rid: str, num_computed: int, num_real: int) -> bool:
        """True once, for the step that computes the request's last known token
        (``num_real``: scheduled tokens minus (placeholder) drafts)."""
        req = self._requests.get(rid)
        if rid in self._prefilled or req is None:
            return False
        done = num_computed + num_real
        if done < req.num_tokens:
            return False
        self._prefilled.add(rid)
        # A resumable (streaming-input) request keeps its blocks between turns and
        # prefills again on top of them: the window never frees its blocks.
        if not getattr(req, "resumable", False):
            self.window_from[rid] = done
        return True

    def _prompt_len(self, rid: str) -> int:
        req = self._requests.get(rid)
        return req.num_prompt_tokens if req is not None else 0

    def max_tokens_of(self, request: "Request") -> int:
        sp = getattr(request, "sampling_params", None)
        return getattr(sp, "max_tokens", None) or self.max_model_len

    def _max_tokens(self, rid: str) -> int:
        """The request's own limit (a streaming-input session updates it per turn)."""
        sp = getattr(self._requests.get(rid), "sampling_params", None)
        return getattr(sp, "max_tokens", None) or self.max_model_len

    def _unverified(self, rid: str) -> int:
        """Drafts that ``num_computed_tokens`` already counts though their step's output has
        not reached the scheduler: vLLM's asynchronous scheduler adds a step's 1 + K
        output placeholders after building this metadata and takes the rejected drafts
        back when the output arrives, and keeps at most one step of a request
        unprocessed, so here the placeholders are that step's, all but its anchor drafts
        (vLLM's own max_tokens check subtracts the same).  0 without asynchronous
        scheduling."""
        return max(0, getattr(self._requests.get(rid), "num_output_placeholders", 0) - 1)

    def build_connector_meta(self, out: "SchedulerOutput") -> DHiSparseMetadata:
        meta = DHiSparseMetadata(step=self._step)
        self._step += 1
        meta.preempted = set(out.preempted_req_ids or ())
        for rid in meta.preempted:  # before this step's requests: a resume may follow at once
            self._prefilled.discard(rid)
            self.window_from.pop(rid, None)
            if rid in self._requests:
                self.prefix.on_ended(self._requests[rid])
        drafts = getattr(out, "scheduled_spec_decode_tokens", None) or {}
        for new in out.scheduled_new_reqs:
            rid = new.req_id
            self._prefilled.discard(rid)  # a new prefill: first turn, next turn or resume
            scheduled = out.num_scheduled_tokens.get(rid, 0)
            spec = len(drafts.get(rid, ()))
            meta.requests.append(RequestStep(
                req_id=rid, num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=scheduled,
                prompt_len=self._prompt_len(rid) or len(new.prompt_token_ids or ()),
                block_ids=tuple(list(b) for b in new.block_ids), replace_blocks=True,
                max_tokens=self._max_tokens(rid),
                completes_prefill=self._completes_prefill(rid, new.num_computed_tokens,
                                                          scheduled - spec),
                num_spec_tokens=spec, num_unverified_tokens=self._unverified(rid),
                handoff_id=self.handoff.handoff_id(rid)))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            computed = cached.num_computed_tokens[i]
            scheduled = out.num_scheduled_tokens.get(rid, 0)
            spec = len(drafts.get(rid, ()))
            if rid in cached.resumed_req_ids:
                self._prefilled.discard(rid)
            meta.requests.append(RequestStep(
                req_id=rid, num_computed_tokens=computed, num_scheduled_tokens=scheduled,
                prompt_len=self._prompt_len(rid),
                block_ids=tuple(list(b) for b in blocks) if blocks is not None else None,
                replace_blocks=rid in cached.resumed_req_ids,
                max_tokens=self._max_tokens(rid),
                completes_prefill=self._completes_prefill(rid, computed, scheduled - spec),
                num_spec_tokens=spec, num_unverified_tokens=self._unverified(rid)))
        for rs in meta.requests:  # unverified drafts count as rejected: a later boundary
            self.prefix.on_step(rs.req_id, rs.num_verified_tokens + rs.num_scheduled_tokens
                                - rs.num_spec_tokens)
        meta.loads = self.handoff.take_loads()
        meta.prefix_captures, meta.prefix_loads, meta.prefix_evictions = self.prefix.take()
        if self.rewrites_before_preemptions and any(c.req_id in meta.preempted
                                                    for c in meta.prefix_captures):
            meta.rewritten_blocks = rewritten_blocks(out)
        meta.finished = set(out.finished_req_ids) | self._finished
        self._finished = set()
        return meta


def rewritten_blocks(out: "SchedulerOutput") -> frozenset[int]:
    """Block ids the model runner writes this step before its forward: new blocks it zeroes
    (mixed-precision caches such as DeepSeek-V4's) and copy-on-write targets of partial
    prefix hits.  A preempted request's freed blocks are among them when vLLM hands them
    to another request in the same step."""
    zeroed = getattr(out, "new_block_ids_to_zero", None) or ()
    copies = getattr(out, "kv_cache_block_copies", None) or ()
    return frozenset(zeroed) | frozenset(c.dst_block_id for c in copies)
