"""Worker half of the connector: owns the KVHierarchy and keeps it in step with vLLM.

Per step, before the forward (``begin_step``, from ``bind_connector_metadata``):
finished and preempted requests release everything; this step's facts update the
request table (requests.py); admitted requests commit the rows that became committed
(admission.py); then the step's :class:`~.step_context.StepContext` is bound for the
routed attention layers.  After the forward (``end_step``, from ``wait_for_save``): a
``kv_producer`` captures finished prefills (handoff_worker.py), requests whose prefill
completed are admitted, and the hierarchy backs up completed tail pages and repopulates
optional history (``KVHierarchy.step``).  Requests in prefill read vLLM's cache, as in
resident serving.

A ``kv_consumer`` admits a loaded request's c4a history straight from the handoff,
before vLLM schedules the request, so its first step already reads through the
hierarchy.  A failure in one request's hierarchy work fails that request alone
(failures.py).
"""
from __future__ import annotations

import os

import torch
from vllm.logger import init_logger

from vllm_dhisparse.config import DHiSparseConfig
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.specs import ResidencyConfig

from ..layers import step_context
from .admission import Admissions
from .decode_policy import CpuDecode, CudaDecode
from ..layers.failures import Failures
from ..handoff.worker import HandoffWorker, LoadJob
from ..host_prefix.index import scheduler_block
from ..host_prefix.store import PrefixStore
from ..metadata import DHiSparseMetadata
from ..layers.model_probe import SparseLayer
from .pool_sizing import plan_pools, staging_sizes
from .requests import RequestTable, TrackedRequest
from ..metrics.stats import StatsCollector, write_json_atomic
from .worker_report import WorkerReport
from ..layers.step_context import ServedCounters, StepContext
from ..layers.vllm_cache import VllmC4aCaches

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


class WorkerSide(WorkerReport):
    def __init__(self, cfg: DHiSparseConfig, layers: list[SparseLayer], max_model_len: int,
                 max_num_seqs: int, max_spec_queries: int, device: torch.device,
                 spec_sizes: dict | None = None, kv_role: str = "kv_both", *,
                 host_prefix: bool = False, context_cls=StepContext,
                 admissions_cls=Admissions):
        """``host_prefix``: keep prefix entries of ended requests on host (host_prefix/);
        ``context_cls``: what begin_step binds for the routed layers; ``admissions_cls``:
        what admits and commits rows (the tests' fault injection passes subclasses)."""
        self.context_cls, self.admissions_cls = context_cls, admissions_cls
        self.cfg = cfg
        self.kv_role = kv_role
        self.handoff: HandoffWorker | None = None  # kv_producer / kv_consumer
        self.host_prefix_on = host_prefix
        self.host_prefix: PrefixStore | None = None
        # for the scheduler: entries captured, entries whose capture or load failed
        self.prefix_captured: set[int] = set()
        self.prefix_lost: set[int] = set()
        self.prefix_loaded: dict[str, str | None] = {}  # request -> load error (None: done)
        self.prefix_sent: set[str] = set()  # finished requests whose blocks may go now
        self.prefix_preempted_done: set[int] = set()  # captured in handle_preemptions
        self.step_tokens: dict[str, tuple[int, int]] = {}  # request -> computed before, after
        self.spec_sizes = dict(spec_sizes) if spec_sizes else None  # spec.check_engine
        self.layers = {layer.name: layer for layer in layers}
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_queries = max_spec_queries
        self.device = device
        self.hierarchy: KVHierarchy | None = None
        self.device_pool_bytes = 0  # counted inside vLLM's KV budget (pool_sizing.py)
        self.pool_plan = None  # pool_sizing.PoolPlan, made with the hierarchy
        self.requests = RequestTable()
        self.vllm_cache = VllmC4aCaches()
        self.fresh_rows: dict[str, int] = {}  # per source: arena columns for uncommitted rows
        self.step_req_ids: list[str] = []  # requests scheduled in the current step
        self.served = ServedCounters()
        self.verify_queries: list[int] = []  # K_r of admitted requests' decode steps
        self.prompt_tokens_computed = 0  # prompt tokens this engine ran forward (not loaded)
        self.time_resolve = cfg.resolve_timing == "on" or (
            cfg.resolve_timing == "auto" and device.type == "cpu")
        self.stats_collector = StatsCollector(cfg.stats_interval_s)
        self.flush_stats = False  # the next collection ignores the interval
        self.failures: Failures | None = None
        self.admissions: Admissions | None = None
        self.context: StepContext | None = None
        self.decode = CpuDecode()  # how the model's decode reads c4a rows (decode_policy.py)

    # -- set-up -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config=None,
                           modules: dict | None = None) -> None:
        """``modules``: the c4a layers' attention modules (the CUDA decode binds to them)."""
        self.vllm_cache.register(kv_caches, self.layers)
        if self.kv_role in ("kv_producer", "kv_consumer"):
            self.handoff = HandoffWorker(self.kv_role, self.cfg, kv_caches, kv_cache_config,
                                         list(self.layers.values()), self.vllm_cache.first_rows)
        if self.host_prefix_on:
            self.host_prefix = PrefixStore(kv_caches, kv_cache_config, self.layers,
                                           scheduler_block(kv_cache_config))
        self.pool_plan = plan_pools(self.cfg, list(self.layers.values()), self.max_model_len,
                                    self.max_num_seqs, self.max_queries)
        plans, staging = list(self.pool_plan.sources), self.pool_plan.staging
        self.fresh_rows = {p.spec.name: p.fresh_rows for p in plans}
        if self.spec_sizes is not None:
            self.spec_sizes.update(staging_sizes(plans, staging, list(self.layers.values()),
                                                 self.spec_sizes["k_max"]))
            logger.info("DHiSparse speculation: %s", self.spec_sizes)
        specs = [p.spec for p in plans]
        residency = ResidencyConfig(
            admission_reserve_pages=self.cfg.admission_reserve_pages,
            repopulate_pages_per_step=self.cfg.repopulate_pages_per_step,
            reclaim_policy=self.cfg.reclaim_policy,
            optional_residency=self.cfg.optional_residency, eager_backup=self.cfg.eager_backup)
        self.hierarchy = KVHierarchy(specs, residency, device=self.device,
                                     backend=self.cfg.resolver_backend, staging=staging)
        self.device_pool_bytes = self.hierarchy.device_bytes  # what was allocated
        assert self.device_pool_bytes == self.pool_plan.device_bytes, \
            "the hierarchy allocated other sizes than pool_sizing planned"
        self.failures = Failures(self.hierarchy, self.requests)
        self.admissions = self.admissions_cls(self.hierarchy, self.layers, self.vllm_cache,
                                              self.failures, self.cfg.device_window_tokens)
        if self.device.type == "cuda":
            from .decode_binding import DecodeBinding
            self.decode = CudaDecode(DecodeBinding(self.hierarchy, self.layers, kv_caches,
                                                   self.max_queries, self.fresh_rows,
                                                   modules or {}))
        logger.info("DHiSparse: %d sparse sources (%s), hot cache %d rows, host pool %.2f GiB",
                    len(specs), ", ".join(self.layers), specs[0].hot_cache_rows,
                    self.cfg.host_pool_gib)

    # -- per step -----------------------------------------------------------------------
    def begin_step(self, meta: DHiSparseMetadata) -> None:
        h, failures, admissions = self.hierarchy, self.failures, self.admissions
        assert h is not None, "register_kv_caches must run before the first step"
        if self.host_prefix is not None:  # before the ended requests release their rows
            self._host_prefix_work(meta)
        ended = False
        for req, preempted in self.requests.ended(meta):
            ended = True
            if self.host_prefix is not None:
                self.host_prefix.forget_request(req.req_id)
            if req.admitted:
                (h.preempt if preempted else h.finish)(req.req_id)
            failures.forget(req.req_id)
        # the last requests ended and nothing runs: vLLM runs this step only to tell the
        # workers, and no step may follow for a while, so the counters go out now
        self.flush_stats = self.flush_stats or (ended and not meta.requests)
        self.step_req_ids = [rs.req_id for rs in meta.requests]
        admissions.pending = {}  # a step that raised before appending left nothing behind
        if self.handoff is not None:
            self.handoff.begin_step(meta)
        decoding = []  # (request, K_r) of the admitted requests this step serves
        for rs in meta.requests:
            self.prompt_tokens_computed += max(0, min(rs.num_scheduled_tokens,
                                                      rs.prompt_len - rs.num_computed_tokens))
            req, replaced = self.requests.update(rs)
            if replaced is not None:  # resumed after preemption: starts from its history
                h.preempt(replaced.req_id)
            if self.host_prefix is not None:
                if rs.replace_blocks:
                    self.host_prefix.forget_request(rs.req_id)
                # verified tokens only: every one before the step is final on the device
                # (vLLM frees window blocks behind its own verified count), and the step
                # adds at least its anchor whatever the device accepted
                verified = rs.num_verified_tokens
                self.step_tokens[rs.req_id] = (
                    verified, verified + rs.num_scheduled_tokens - rs.num_spec_tokens)
            if req.failed:
                continue
            as_decode = rs.num_scheduled_tokens <= self.max_queries
            if req.admitted and req.prefill_complete and not as_decode:
                failures.fail(req, f"{rs.num_scheduled_tokens} tokens scheduled in one step "
                                   f"after the prefill; the hierarchy serves at most "
                                   f"{self.max_queries} (1 + speculative tokens)")
                continue
            # a step of <= 1 + speculative tokens (without parallel drafting on model runner
            # V1, which adds the speculative tokens again) is admitted now where the decode
            # serves it from the hierarchy, from the rows computed so far (decode_policy.py)
            admit_now = req.prefill_complete or (self.decode.admits_decode_steps and as_decode)
            with failures.isolated(req):
                if not req.admitted and admit_now:
                    admissions.admit(req)  # or a retry: no device room at an earlier step
                if req.admitted:
                    admissions.commit(req)
            if self.decode.admits_decode_steps and admit_now and not req.admitted \
                    and not req.failed:
                # the routed FlashMLA decode reads no c4a row for it: fail it, never answer
                failures.fail(req, "no room in the hierarchy (request slots, device pages or "
                                   "host extent) for a step vLLM serves as a decode; on CUDA "
                                   "only admitted requests decode")
                continue
            if req.admitted and as_decode:
                decoding.append((req, rs.num_scheduled_tokens, req.prefill_complete))
            req.prefill_complete = req.prefill_complete or rs.completes_prefill
        admissions.append_committed()
        self.decode.before_forward([(req, req.num_computed_tokens + k) for req, k, _ in decoding
                                    if req.admitted and not req.failed])
        self.verify_queries.extend(k for req, k, after_prefill in decoding
                                   if after_prefill and req.admitted and not req.failed)
        self.context = self.context_cls(h, self.layers, self.requests, self.vllm_cache,
                                        failures, self.served, self.fresh_rows, self.time_resolve)
        step_context.bind(self.context)

    def end_step(self) -> None:
        step_context.unbind()
        self.context = None
        if self.hierarchy is None:
            return
        if self.handoff is not None:  # before admission: every block is still vLLM's
            self.handoff.capture(self.requests, self.step_req_ids)
        if self.host_prefix is not None:  # the window blocks this forward leaves
            for rid, (before, after) in self.step_tokens.items():
                req = self.requests.get(rid)
                if req is not None and not req.failed:
                    self.host_prefix.after_forward(req, before, after)
            self.step_tokens = {}
        self.decode.after_forward(self.requests, self.failures, self.served)
        self.admissions.admit_completed_prefills(self.requests, self.step_req_ids)
        self.hierarchy.step()
        self.failures.take_hierarchy_failures()
        if self.cfg.stats_file:
            write_json_atomic(self.cfg.stats_file.replace("{pid}", str(os.getpid())),
                              self.summary())

    # -- host prefix entries (host_prefix/) ------------------------------------------------
    def capture_preempted(self, meta: DHiSparseMetadata, blocks_intact: bool = False) -> None:
        """``handle_preemptions``: vLLM freed a preempted request's blocks in this
        schedule and may hand them to another request.  The worker class calls this
        before the model runner sees the step, and the runner again: V1 before it writes
        anything, V2 after it zeroed new blocks and applied copy-on-write copies.  A
        capture not done yet whose blocks were rewritten is given up (its entry would
        hold those bytes); ``blocks_intact``: the caller runs before any of those writes."""
        if self.host_prefix is None:
            return
        for item in meta.prefix_captures:
            if item.req_id not in meta.preempted or item.entry_id in self.prefix_preempted_done:
                continue  # done by the worker class before the model runner's own call
            req = self.requests.get(item.req_id)
            if req is not None and meta.rewritten_blocks and not blocks_intact and \
                    not meta.rewritten_blocks.isdisjoint(self._blocks_read(req, item.num_tokens)):
                self.host_prefix.counters.capture_failed += 1
                self.prefix_lost.add(item.entry_id)
                logger.debug("DHiSparse: host prefix entry of preempted request %s given up: "
                             "vLLM rewrote one of its blocks before handle_preemptions",
                             item.req_id)
            else:
                self._capture(item)
            self.prefix_preempted_done.add(item.entry_id)

    def _blocks_read(self, req: TrackedRequest, num_tokens: int) -> set[int]:
        """vLLM block ids a capture of ``req`` at ``num_tokens`` reads: the store's, and
        the c4a blocks of the rows the hierarchy does not hold (``_history_rows``)."""
        out = self.host_prefix.blocks_read(num_tokens, req.block_ids)
        for layer in self.layers.values():
            n = num_tokens // layer.compress_ratio
            have = self._rows_held(req, layer, n)
            if have < n:
                ids = req.block_ids[layer.group]
                rpb = layer.rows_per_block
                out.update(ids[have // rpb:(n - 1) // rpb + 1])
        return out

    def _capture(self, item) -> None:
        req = self.requests.get(item.req_id)
        try:
            if req is None or req.failed:
                raise RuntimeError("the request is not served here")
            self.host_prefix.capture(item, req,
                                     lambda layer, n, req=req: self._history_rows(req, layer, n))
            self.prefix_captured.add(item.entry_id)
        except Exception as e:  # noqa: BLE001 -- the scheduler forgets this entry only
            self.host_prefix.counters.capture_failed += 1
            self.prefix_lost.add(item.entry_id)
            logger.warning("DHiSparse: host prefix entry of request %s (%d tokens) not "
                           "captured: %s", item.req_id, item.num_tokens, e)

    def _host_prefix_work(self, meta: DHiSparseMetadata) -> None:
        """The step's captures of finished requests (their blocks are held for it:
        ``delay_free``), then loads into newly allocated blocks, then evictions."""
        hp = self.host_prefix
        for item in meta.prefix_captures:
            if item.entry_id in self.prefix_preempted_done:
                self.prefix_preempted_done.discard(item.entry_id)
            elif item.req_id in meta.preempted:  # a runner that skipped handle_preemptions:
                hp.counters.capture_failed += 1  # its blocks may be rewritten already
                self.prefix_lost.add(item.entry_id)
            else:
                self._capture(item)
                self.prefix_sent.add(item.req_id)  # vLLM frees its blocks now
        for item in meta.prefix_loads:
            try:
                hp.load(item, self.vllm_cache.write_rows)
                self.prefix_loaded[item.req_id] = None
            except Exception as e:  # noqa: BLE001 -- vLLM's kv_load_failure_policy, this request
                hp.counters.load_failed += 1
                self.prefix_loaded[item.req_id] = f"{type(e).__name__}: {e}"
                self.prefix_lost.add(item.entry_id)  # never loaded again
                logger.error("DHiSparse: loading host prefix entry %d into request %s failed: "
                             "%s", item.entry_id, item.req_id, e)
        for entry_id in meta.prefix_evictions:
            hp.evict(entry_id)

    @staticmethod
    def _rows_held(req: TrackedRequest, layer: SparseLayer, n: int) -> int:
        """How many of the request's first ``n`` c4a rows the hierarchy holds."""
        return min(n, req.rows.get(layer.name, 0)) if req.admitted else 0

    def _history_rows(self, req: TrackedRequest, layer: SparseLayer, n: int) -> torch.Tensor:
        """The request's first ``n`` c4a rows: those the hierarchy holds (committed at the
        last step's start), the rest from vLLM's blocks (inside the device window; in
        prefill nothing is freed).  # [n, row_bytes]"""
        have = self._rows_held(req, layer, n)
        parts = [self.hierarchy.read_history(req.req_id, layer.name, have)] if have else []
        if n > have:
            parts.append(self.vllm_cache.rows(layer, req.block_ids[layer.group],
                                              torch.arange(have, n, dtype=torch.int64)).cpu())
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def take_prefix_reports(self) -> tuple[set[int], set[int]]:
        """(entries lost, entries captured) since the last call, for the scheduler."""
        out = (self.prefix_lost, self.prefix_captured)
        self.prefix_lost, self.prefix_captured = set(), set()
        return out

    # -- P/D (kv_consumer) ----------------------------------------------------------------
    def admit_loaded(self, job: LoadJob) -> bool:
        """A loaded request's c4a history goes straight into the hierarchy (resident-first);
        False when there is no room yet (the request stays parked)."""
        item, rows = job.item, job.handoff.rows
        req = TrackedRequest(item.req_id, item.num_tokens, item.max_tokens,
                             [list(b) for b in item.block_ids],
                             num_computed_tokens=item.num_tokens - 1, loaded=True)
        if not self.admissions.admit_imported(req, rows):
            return False
        self.requests[req.req_id] = req
        c = self.handoff.counters
        for name, host in self.hierarchy.host_only_rows(req.req_id).items():
            c.rows_host += host
            c.rows_device += req.rows[name] - host
        return True

    def transfer_results(self) -> tuple[set[str], set[str], set[str]]:
        """``(finished_sending, finished_recving, failed_recving)`` since the last call:
        finished requests whose host prefix capture is done (vLLM frees their blocks),
        loads finished and failed (a kv_consumer's handoffs, host prefix entries written
        before this step's forward)."""
        sent, self.prefix_sent = self.prefix_sent, set()
        done, failed = set(self.prefix_loaded), {r for r, e in self.prefix_loaded.items() if e}
        self.prefix_loaded = {}
        if self.handoff is None:
            return sent, done, failed
        got, lost = self.handoff.transfer_results(self.admit_loaded)
        self.failures.take_hierarchy_failures()
        return sent, done | got, failed | lost

    # -- reporting ---------------------------------------------------------------------
    def take_failed(self) -> dict[str, str]:
        return self.failures.take_unreported() if self.failures is not None else {}

    def get_kv_connector_stats(self):
        """Deltas since the previous call, for vLLM's metrics path (stats.py); spaced by
        ``stats_interval_s`` except when the engine goes idle."""
        flush, self.flush_stats = self.flush_stats, False
        return self.stats_collector.collect(self, force=flush)
