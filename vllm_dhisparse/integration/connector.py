"""DHiSparseConnector: the thin vLLM front over the scheduler and worker halves.

Enable with::

    --kv-transfer-config '{"kv_connector":"DHiSparseConnector","kv_role":"kv_both",
                           "kv_connector_extra_config":{...}}'

``kv_both`` serves alone.  For prefill/decode disaggregation the prefill
instance runs ``kv_producer`` and the decode instance ``kv_consumer``; the
handoff between them is in ``handoff_*.py``.

The extra config is parsed once, by :class:`~vllm_dhisparse.config.DHiSparseConfig`
(unknown keys are rejected with the valid list).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorTransferResults,
                                                               SupportsHMA)
from vllm.logger import init_logger
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from vllm_dhisparse.config import DHiSparseConfig
from vllm_dhisparse.spec import check_engine, ring_sizes

from .draft_ring import ring_block_size
from .extension_points import require
from .handoff.scheduler import HandoffScheduler
from .host_prefix.index import PrefixIndex
from .metadata import DHiSparseHandshake, DHiSparseMetadata, DHiSparseWorkerMetadata
from .layers.model_probe import find_sparse_layers, iter_sparse_modules, require_sparse_indexer
from .worker.pool_sizing import max_queries
from .engine_core.scheduler_side import SchedulerSide
from .metrics.stats import DHiSparseConnectorStats, DHiSparsePromMetrics
from .support import check_supported
from .worker.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


class DHiSparseConnector(KVConnectorBase_V1, SupportsHMA):
    _cache_hit_source = CacheHitSource.P2P  # loaded tokens come from a prefill instance
    # CUDA configurations the in-engine audit has not covered (FULL graphs of mixed
    # batches, a compiled model, SM100) are refused (support.py); only the measuring
    # subclass outside the package (scripts/gpu_measure.py) sets this
    measures_unaudited = False

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig" = None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self.cfg = DHiSparseConfig.from_extra_config(extra)
        # refuse what would give wrong tokens, in every process
        check_supported(vllm_config, unaudited=self.measures_unaudited)
        require(vllm_config)  # every extension point applied, our scheduler and worker
        top_k = require_sparse_indexer(vllm_config.model_config)
        self.cfg.hot_cache_rows_for(top_k)  # B < k is a start-up error, in every process
        self.spec_sizes = check_engine(vllm_config, self.cfg.spec)  # None without DSpark/DFlash2
        self.scheduler_side: SchedulerSide | None = None
        self.dhisparse_worker: WorkerSide | None = None
        max_len = vllm_config.model_config.max_model_len
        self.kv_role = vllm_config.kv_transfer_config.kv_role
        # host prefix entries need vLLM's block hashes (prefix caching) and serve one
        # instance alone (a P/D consumer loads whole prompts from its producer)
        self.host_prefix = self.cfg.host_prefix_gib > 0 and self.kv_role == "kv_both" and \
            bool(vllm_config.cache_config.enable_prefix_caching)
        if self.cfg.host_prefix_gib > 0 and not self.host_prefix:
            logger.warning("DHiSparse: host_prefix_gib is set but host prefix hits are off: "
                           "they need prefix caching on and kv_role kv_both (this engine: "
                           "prefix caching %s, kv_role %s)",
                           vllm_config.cache_config.enable_prefix_caching, self.kv_role)
        self._kv_cache_config = kv_cache_config
        if role == KVConnectorRole.SCHEDULER:
            self.handoff = HandoffScheduler(self.kv_role, self.cfg,
                                            vllm_config.kv_transfer_config.engine_id,
                                            kv_cache_config)
            self.prefix = PrefixIndex(int(self.cfg.host_prefix_gib * 2**30), kv_cache_config,
                                      self.host_prefix)
            # model runner V2 writes the step's new blocks before it calls
            # handle_preemptions; V1 after
            self.scheduler_side = SchedulerSide(
                max_len, self.handoff, self.prefix,
                rewrites_before_preemptions=bool(getattr(vllm_config, "use_v2_model_runner",
                                                         False)))
        else:
            ring_block = ring_block_size(kv_cache_config)
            if self.spec_sizes is not None and ring_block:
                self.spec_sizes.update(ring_sizes(self.spec_sizes, ring_block))
            device = torch.device(vllm_config.device_config.device)
            self._worker_args = (max_len, vllm_config.scheduler_config.max_num_seqs,
                                 max_queries(vllm_config), device)

    # -- worker --------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from .layers.model import is_routed
        for name, module in iter_sparse_modules(self._vllm_config):
            if not is_routed(module):
                arch = self._vllm_config.model_config.architecture
                raise RuntimeError(
                    f"DHiSparseConnector: c4a layer {name!r} is vLLM's {type(module).__qualname__}, "
                    f"not read through the hierarchy: architecture {arch!r} was not built by the "
                    f"connector's model class (supported: DeepseekV4ForCausalLM)")
        layers = find_sparse_layers(self._vllm_config, self._kv_cache_config)
        self.dhisparse_worker = self.new_worker_side(
            self.cfg, layers, *self._worker_args, spec_sizes=self.spec_sizes,
            kv_role=self.kv_role, host_prefix=self.host_prefix)
        self.dhisparse_worker.register_kv_caches(
            kv_caches, self._kv_cache_config, dict(iter_sparse_modules(self._vllm_config)))

    def new_worker_side(self, *args, **kwargs) -> WorkerSide:
        """The worker half (a subclass of the connector may build it with other parts)."""
        return WorkerSide(*args, **kwargs)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        # Both model runners bind before the forward; MRV2 calls start_load_kv
        # only after it, too late to admit requests and commit rows.
        super().bind_connector_metadata(connector_metadata)
        assert isinstance(connector_metadata, DHiSparseMetadata), type(connector_metadata)
        if self.dhisparse_worker is not None:
            self.dhisparse_worker.begin_step(connector_metadata)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        return

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        return

    def wait_for_save(self) -> None:
        if self.dhisparse_worker is not None and self.has_connector_metadata():
            self.dhisparse_worker.end_step()

    def get_finished(self, finished_req_ids: set[str]):
        sent, done, _ = self._transfer_results()
        return sent or None, done or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Finished requests whose host prefix capture is done (``finished_sending``:
        vLLM frees their blocks); loads (kv_consumer, host prefix hits) finished since the
        last call, a failed one in both sets (vLLM applies kv_load_failure_policy)."""
        sent, done, failed = self._transfer_results()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done,
                                          failed_recving=failed)

    def _transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        if self.dhisparse_worker is None:
            return set(), set(), set()
        return self.dhisparse_worker.transfer_results()

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """A preempted request's host prefix capture, unless the worker class did it
        before the model runner zeroed this step's new blocks (model runner V2 calls this
        after that; V1 before)."""
        if self.dhisparse_worker is not None:
            self.dhisparse_worker.capture_preempted(kv_connector_metadata)

    def shutdown(self) -> None:
        pd = self.dhisparse_worker.handoff if self.dhisparse_worker is not None else None
        if pd is not None:
            pd.close()  # the side channel's port is free for the next engine

    def get_handshake_metadata(self) -> DHiSparseHandshake | None:
        """kv_producer: the side channel's address, for the scheduler's kv_transfer_params."""
        pd = self.dhisparse_worker.handoff if self.dhisparse_worker is not None else None
        if pd is None or pd.producer is None:
            return None
        server = pd.producer.server
        return DHiSparseHandshake(server.host, server.port)

    def set_xfer_handshake_metadata(self, metadata: dict) -> None:
        if len(metadata) > 1:
            raise ValueError("DHiSparseConnector P/D supports one worker per engine (tensor "
                             f"parallel size 1); got handshakes from ranks {sorted(metadata)}")
        for meta in metadata.values():
            if isinstance(meta, DHiSparseHandshake):
                self.handoff.set_address(meta.host, meta.port)

    def build_connector_worker_meta(self):
        """Requests the worker failed this step (the scheduler ends them with an error)."""
        if self.dhisparse_worker is None:
            return None
        failed = self.dhisparse_worker.take_failed()
        lost, captured = self.dhisparse_worker.take_prefix_reports()
        return DHiSparseWorkerMetadata(failed, lost, captured) \
            if failed or lost or captured else None

    # -- metrics (stats.py) ----------------------------------------------------------------
    def get_kv_connector_stats(self) -> DHiSparseConnectorStats | None:
        if self.dhisparse_worker is None:
            return None
        return self.dhisparse_worker.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> DHiSparseConnectorStats:
        return DHiSparseConnectorStats(data=data or {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> DHiSparsePromMetrics:
        return DHiSparsePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler -----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int):
        """``(prompt tokens, True)`` for a kv_consumer request with a handoff to pull
        (``do_remote_prefill``); ``(tokens, True)`` for a request whose prompt begins with
        a host prefix entry's tokens beyond its local hit; both loads are asynchronous.
        ``(0, False)`` otherwise."""
        found = self.handoff.get_num_new_matched_tokens(request, num_computed_tokens)
        if found[0] or getattr(request, "kv_transfer_params", None):
            return found
        tokens = self.prefix.lookup(request, num_computed_tokens)
        return (tokens, True) if tokens else (0, False)

    def get_loaded_kv_cache_group_ids(self, request: "Request") -> tuple[int, ...]:
        if self.prefix.wants_load(request.request_id):  # every group, the c4a rows too
            return tuple(range(len(self._kv_cache_config.kv_cache_groups)))
        return self.handoff.loaded_groups

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if self.prefix.after_alloc(request, tuple(list(b) for b in blocks.get_block_ids()),
                                   num_external_tokens):
            return
        self.handoff.update_state_after_alloc(request, blocks, num_external_tokens,
                                              self.scheduler_side.max_tokens_of(request))

    def get_external_cache_hit_sources(self, request: "Request", num_external_tokens: int):
        if num_external_tokens and request.request_id in self.prefix.host_loads:
            return {CacheHitSource.HOST: num_external_tokens}
        return super().get_external_cache_hit_sources(request, num_external_tokens)

    def reset_cache(self) -> bool:
        """``reset_prefix_cache(reset_connector=True)``: the host prefix entries go too."""
        self.prefix.reset()
        return True

    def update_connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(meta, DHiSparseWorkerMetadata):
            self.prefix.confirm(meta.prefix_captured)
            self.prefix.forget(meta.prefix_lost)

    def on_new_request(self, request: "Request") -> None:
        self.scheduler_side.on_new_request(request)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def request_finished(self, request: "Request", block_ids: list[int]):
        return self.scheduler_side.request_finished(request)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]):
        # DeepSeek-V4 runs with the hybrid allocator (SWA, compressed and indexer groups).
        return self.scheduler_side.request_finished(request)
