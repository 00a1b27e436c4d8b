"""Failing one request from the worker half.

vLLM 0.32 has no connector API to fail a *running* request: ``failed_recving``
only acts on requests in ``WAITING_FOR_REMOTE_KVS``, and ``invalid_block_ids``
raises for models with several KV cache groups (DeepSeek-V4 has five)
(``v1/core/sched/scheduler.py`` ``_handle_failed_recving`` /
``_handle_invalid_blocks``).  What it does have is a per-step error set that
``update_from_output`` finishes with ``RequestStatus.FINISHED_ERROR``
(finish reason ``"error"`` to the client), fed by scheduler-internal checks.

So: the worker half reports failed requests in its
``KVConnectorWorkerMetadata`` (:class:`DHiSparseWorkerMetadata`, carried in
``KVConnectorOutput.kv_connector_worker_meta`` and aggregated over workers);
this hook, wrapped around ``Scheduler.update_from_output``, adds them to that
error set *before* the step's outputs are built, so the failed request ends
in the same step, with an error, and no other request is touched.
"""
from __future__ import annotations

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

_installed = False


def install() -> bool:
    global _installed
    if _installed:
        return True
    from vllm.v1.core.sched.scheduler import Scheduler

    from .metadata import DHiSparseWorkerMetadata

    original = Scheduler.update_from_output

    def update_from_output(self, scheduler_output, model_runner_output):
        out = getattr(model_runner_output, "kv_connector_output", None)
        meta = getattr(out, "kv_connector_worker_meta", None) if out is not None else None
        if isinstance(meta, DHiSparseWorkerMetadata) and meta.failed:
            errors = getattr(self, "encoder_cache_mismatch_reqs", None)
            for rid, why in meta.failed.items():
                if rid in self.requests:
                    logger.error("DHiSparse: finishing request %s with an error: %s", rid, why)
                    errors.add(rid)
        return original(self, scheduler_output, model_runner_output)

    Scheduler.update_from_output = update_from_output
    _installed = True
    return True
