"""Scheduler half of the connector: follows requests and ships per-step facts to workers.

The hierarchy itself lives in the workers (it owns device and host memory);
the scheduler half only translates vLLM's ``SchedulerOutput`` into
:class:`DHiSparseMetadata`.  It never loads external KV (we are not a prefix
cache), so ``get_num_new_matched_tokens`` always answers 0.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.logger import init_logger

from .metadata import DHiSparseMetadata, RequestStep

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = init_logger(__name__)


class SchedulerSide:
    def __init__(self, max_model_len: int):
        self.max_model_len = max_model_len
        self._prompt_len: dict[str, int] = {}
        self._max_tokens: dict[str, int] = {}
        self._finished: set[str] = set()
        self._step = 0

    def on_new_request(self, request: "Request") -> None:
        self._prompt_len[request.request_id] = request.num_prompt_tokens
        sp = request.sampling_params
        max_tokens = getattr(sp, "max_tokens", None) if sp is not None else None
        self._max_tokens[request.request_id] = max_tokens or self.max_model_len

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        self._finished.add(request.request_id)
        self._prompt_len.pop(request.request_id, None)
        self._max_tokens.pop(request.request_id, None)
        return False, None

    def build_connector_meta(self, out: "SchedulerOutput") -> DHiSparseMetadata:
        meta = DHiSparseMetadata(step=self._step)
        self._step += 1
        for new in out.scheduled_new_reqs:
            rid = new.req_id
            meta.requests.append(RequestStep(
                req_id=rid, num_computed_tokens=new.num_computed_tokens,
                num_scheduled_tokens=out.num_scheduled_tokens.get(rid, 0),
                prompt_len=self._prompt_len.get(rid, len(new.prompt_token_ids or ())),
                block_ids=tuple(list(b) for b in new.block_ids), replace_blocks=True,
                max_tokens=self._max_tokens.get(rid, self.max_model_len)))
        cached = out.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            blocks = cached.new_block_ids[i]
            meta.requests.append(RequestStep(
                req_id=rid, num_computed_tokens=cached.num_computed_tokens[i],
                num_scheduled_tokens=out.num_scheduled_tokens.get(rid, 0),
                prompt_len=self._prompt_len.get(rid, 0),
                block_ids=tuple(list(b) for b in blocks) if blocks is not None else None,
                replace_blocks=rid in cached.resumed_req_ids,
                max_tokens=self._max_tokens.get(rid, self.max_model_len)))
        meta.finished = set(out.finished_req_ids) | self._finished
        self._finished = set()
        meta.preempted = set(out.preempted_req_ids or ())
        return meta
