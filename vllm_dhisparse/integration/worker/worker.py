"""The worker the connector runs with: vLLM's, plus the hierarchy's share of the KV budget
and the draft ring's KV specs.

Selected with vLLM's ``worker_cls``; the base is the platform's worker (``CPUWorker`` on
CPU, ``Worker`` on CUDA).  Without DHiSparseConnector configured it behaves as its base.

* ``determine_available_memory``: the hierarchy's device pools and staging arenas are
  counted inside the KV memory the operator gives vLLM (``--kv-cache-memory-bytes`` or
  the share from ``--gpu-memory-utilization``); vLLM's own blocks get the rest
  (pool_sizing.py sizes both, from the loaded model).
* ``initialize_from_config``: before vLLM allocates anything, the pools its KV cache
  config implies are checked equal to the share taken above.
* ``get_kv_cache_spec``: a DSpark / DFlash2 drafter's layers report the window-bounded
  draft ring (draft_ring.py).  The c4a layers' windowed spec comes from their routed
  attention class (model.py), which owns that cache.
* ``execute_model``: a preempted request's host prefix capture runs before the model
  runner sees the step.  Model runner V2 calls the connector's ``handle_preemptions``
  only after it zeroed the step's new blocks, among which vLLM may have put the
  preempted request's freed ones.  (vLLM's compiled-graph Ray executor calls the model
  runner directly; there the worker half's guard on rewritten blocks alone applies.)
"""
from __future__ import annotations

import torch
from vllm.distributed.kv_transfer import get_kv_transfer_group
from vllm.logger import init_logger
from vllm.platforms import current_platform

from vllm_dhisparse.compat.targets import expect

from .. import draft_ring
from . import pool_sizing
from ..layers.model_probe import find_sparse_layers
from ..metadata import DHiSparseMetadata
from ..support import connector_config

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


def base_for(platform) -> str:
    """The platform's worker class, which ours extends."""
    return ("vllm.v1.worker.cpu_worker:CPUWorker" if platform.is_cpu()
            else "vllm.v1.worker.gpu_worker:Worker")


BASE = base_for(current_platform)
QUALNAME = f"{__name__}.DHiSparseWorker"


def check(base: str = BASE) -> None:
    """What this module needs from vLLM (from ``base``, the platform's worker), checked
    at start-up."""
    expect(f"{base}.determine_available_memory", (), exact=True)
    expect(f"{base}.get_kv_cache_spec", (), exact=True)
    expect(f"{base}.initialize_from_config", ("kv_cache_config",), exact=True)
    expect(f"{base}.execute_model", ("scheduler_output",), exact=True)


_Base = expect(BASE)


class DHiSparseWorker(_Base):
    budgeted_bytes: int | None = None  # what the hierarchy's pools took of the KV budget

    def determine_available_memory(self) -> int:
        available = super().determine_available_memory()
        cfg = connector_config(self.vllm_config)
        if cfg is None:
            return available
        rest, self.budgeted_bytes = pool_sizing.take_budget(self.vllm_config, cfg, available)
        return rest

    def initialize_from_config(self, kv_cache_config) -> None:
        """Before anything is allocated: the pools that vLLM's KV cache config implies are
        the ones taken off the budget."""
        cfg = connector_config(self.vllm_config)
        if cfg is not None and self.budgeted_bytes is not None:
            layers = find_sparse_layers(self.vllm_config, kv_cache_config)
            plan = pool_sizing.engine_plan(self.vllm_config, cfg, layers)
            pool_sizing.check_budgeted(plan.device_bytes, self.budgeted_bytes)
        super().initialize_from_config(kv_cache_config)

    def execute_model(self, scheduler_output):
        meta = getattr(scheduler_output, "kv_connector_metadata", None)
        if isinstance(meta, DHiSparseMetadata) and meta.preempted and meta.prefix_captures:
            side = getattr(get_kv_transfer_group(), "dhisparse_worker", None)
            if side is not None:  # the runner's handle_preemptions later: a no-op for these
                with torch.inference_mode():  # as the base's execute_model runs
                    side.capture_preempted(meta, blocks_intact=True)
        return super().execute_model(scheduler_output)

    def get_kv_cache_spec(self):
        specs = super().get_kv_cache_spec()
        if connector_config(self.vllm_config) is None:
            return specs
        return draft_ring.with_draft_ring(self.vllm_config, self.model_runner, specs)


def is_ours(worker_cls) -> bool:
    return isinstance(worker_cls, type) and issubclass(worker_cls, DHiSparseWorker)
