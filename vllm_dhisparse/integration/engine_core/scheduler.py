"""The scheduler the connector runs with: vLLM's, plus finishing failed requests with an error.

vLLM's KV connector API has no way to fail a *running* request: ``failed_recving``
acts only on requests in ``WAITING_FOR_REMOTE_KVS`` and ``invalid_block_ids`` is
refused for models with several KV cache groups (DeepSeek-V4 has five), both in
``v1/core/sched/scheduler.py`` (``_handle_failed_recving``, ``_handle_invalid_blocks``).
A request whose hierarchy work failed (its history cannot be read exactly any more)
must still end, with an error, without touching any other request.

So the worker half reports failed requests in its ``KVConnectorWorkerMetadata``
(:class:`~.metadata.DHiSparseWorkerMetadata`, aggregated over workers), and this
subclass, selected with vLLM's ``scheduler_cls``, finishes them with
``RequestStatus.FINISHED_ERROR`` *before* vLLM processes the step's output: the
output loop then skips them as it skips requests aborted mid-step, so the failed
request emits no token of that step, only its ``"error"`` finish reason.

``DHiSparseScheduler`` is the one name to configure: with async scheduling on (vLLM's
default where it applies) it builds :class:`DHiSparseAsyncScheduler`, the same logic
over vLLM's ``AsyncScheduler``.
"""
from __future__ import annotations

from vllm.logger import init_logger
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
from vllm.v1.request import RequestStatus

from vllm_dhisparse.compat.targets import expect, fail

from ..kv_spec import DHiSparseWindowManager
from ..metadata import DHiSparseWorkerMetadata

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

QUALNAME = f"{__name__}.DHiSparseScheduler"


def check() -> None:
    """What this module needs from vLLM, checked at start-up."""
    base = "vllm.v1.core.sched.scheduler:Scheduler"
    expect(f"{base}.update_from_output", ("scheduler_output", "model_runner_output"),
           exact=True)
    expect(f"{base}.finish_requests", ("request_ids", "finished_status"))
    expect("vllm.v1.request:Request.get_finished_reason", ())
    expect("vllm.v1.request:RequestStatus.FINISHED_ERROR")


def failed_requests(model_runner_output) -> dict[str, str]:
    """Request id -> error, as the workers reported them for this step."""
    out = getattr(model_runner_output, "kv_connector_output", None)
    meta = getattr(out, "kv_connector_worker_meta", None) if out is not None else None
    return dict(meta.failed) if isinstance(meta, DHiSparseWorkerMetadata) else {}


class _FailsRequests:
    """``update_from_output`` that first finishes the requests the workers failed; and
    at construction, the connector's prefill register handed to the c4a window managers."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        share_prefill_register(self)

    def update_from_output(self, scheduler_output, model_runner_output):
        failed = failed_requests(model_runner_output)
        for rid, why in failed.items():
            if rid in self.requests:
                logger.error("DHiSparse: finishing request %s with an error: %s", rid, why)
        errored = self.finish_requests(set(failed) & set(self.requests),
                                       RequestStatus.FINISHED_ERROR) if failed else []
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        for request in errored:
            eco = outputs.get(request.client_index)
            if eco is None:
                eco = outputs[request.client_index] = EngineCoreOutputs()
            eco.outputs.append(EngineCoreOutput(
                request_id=request.request_id, new_token_ids=[],
                finish_reason=request.get_finished_reason(), events=request.take_events(),
                trace_headers=request.trace_headers))
        return outputs


def share_prefill_register(scheduler) -> None:
    """The connector's scheduler half records when each request's prefill completes; the
    c4a window managers of the same engine core free blocks only from then on
    (kv_spec.py).  Both are built inside vLLM's ``Scheduler.__init__``; this joins them."""
    side = getattr(getattr(scheduler, "connector", None), "scheduler_side", None)
    if side is None:
        return  # not DHiSparseConnector: no window managers of ours either
    coordinator = getattr(getattr(scheduler, "kv_cache_manager", None), "coordinator", None)
    managers = getattr(coordinator, "single_type_managers", None)
    if managers is None:
        raise fail("Scheduler.kv_cache_manager.coordinator.single_type_managers",
                   "vLLM's scheduler no longer keeps its KV cache managers there")
    for manager in managers:
        if isinstance(manager, DHiSparseWindowManager):
            manager.window_from = side.window_from


class DHiSparseAsyncScheduler(_FailsRequests, AsyncScheduler):
    pass


class DHiSparseScheduler(_FailsRequests, Scheduler):
    def __new__(cls, *args, **kwargs):
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is DHiSparseScheduler and vllm_config is not None \
                and vllm_config.scheduler_config.async_scheduling:
            return DHiSparseAsyncScheduler(*args, **kwargs)
        return super().__new__(cls)


def is_ours(scheduler_cls) -> bool:
    return isinstance(scheduler_cls, type) and issubclass(scheduler_cls, _FailsRequests)
