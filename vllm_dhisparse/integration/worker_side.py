"""Worker half of the connector: owns the KVHierarchy and keeps it in step with vLLM.

Per step (``bind_connector_metadata``, before the forward):
  * finished / preempted requests release everything;
  * rows that became *committed* since the last step (compressed rows whose
    tokens all precede ``num_computed_tokens``, eq. 8) are appended to the tail.
After the forward (``wait_for_save``):
  * a request whose prefill this step completed (the scheduler half says so,
    whatever the chunking or prefix hit) is admitted, its history read from
    vLLM's paged cache, where every block is still held (kv_spec.py);
    resident-first placement is the hierarchy's call;
  * the hierarchy backs up completed tail pages and repopulates optional
    history (``KVHierarchy.step``).
Requests in prefill read vLLM's cache, as in resident serving.

Rows computed in the current step (the anchor's and the drafts') are not
committed yet: the attention hook reads them through the layer's
``staging_arena`` (the request's rows of it), copied from vLLM's cache for
that layer only, so a rejected draft never reaches the hierarchy.  Accepted
rows are committed from vLLM's cache once ``num_computed_tokens`` covers them
(the next step's ``begin_step``), then backed up like any tail row.

Prefill/decode roles (handoff_worker.py): a ``kv_producer`` captures a
request's KV after the forward that completes its prefill, before admission;
a ``kv_consumer`` admits a loaded request's c4a history straight from the
handoff, before vLLM schedules the request, so its first step (the last
prompt token, recomputed to sample) already reads through the hierarchy.

A failure in one request's hierarchy work (admission, append, resolve, a
host backup) fails that request alone (``_isolated``).  Helpers with one
role each: routing.py (who the hook serves), vllm_cache.py (vLLM's block
layout), pool_sizing.py (pool sizes), stats.py (counters and summary).
"""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from vllm_dhisparse.config import DHiSparseConfig, parse_fault_hook, test_hook
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.host_store import HostBackupError
from vllm_dhisparse.hierarchy.specs import ResidencyConfig

from .handoff_worker import HandoffWorker, LoadJob
from .metadata import DHiSparseMetadata
from .model_probe import SparseLayer
from .pool_sizing import check_budgeted, device_pool_bytes, plan_sources, plan_staging, staging_sizes
from .routing import RoutingPlan, StepRouting
from .stats import StatsCollector, summarize, time_resolve_enabled, write_json_atomic
from .vllm_cache import VllmC4aCaches

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


@dataclass
class TrackedRequest:
    req_id: str
    prompt_len: int
    max_tokens: int
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0  # this step's tokens (prefill chunk, or anchor + drafts)
    num_spec_tokens: int = 0  # of those, drafts: computed this step but never committed
    prefill_complete: bool = False  # its known tokens are computed (or are this step)
    admitted: bool = False
    loaded: bool = False  # admitted from a handoff, not scheduled yet
    failed: str | None = None
    rows: dict[str, int] = field(default_factory=dict)  # committed rows per source


class WorkerSide:
    def __init__(self, cfg: DHiSparseConfig, layers: list[SparseLayer], max_model_len: int,
                 max_num_seqs: int, max_spec_queries: int, device: torch.device,
                 spec_sizes: dict | None = None, kv_role: str = "kv_both"):
        self.cfg = cfg
        self.kv_role = kv_role
        self.handoff: HandoffWorker | None = None  # kv_producer / kv_consumer
        self.spec_sizes = dict(spec_sizes) if spec_sizes else None  # spec.check_engine
        self.corrupt_mapping = test_hook("DHISPARSE_TEST_CORRUPT_MAPPING") == "1"
        self.fail_backup_of = test_hook("DHISPARSE_TEST_FAIL_BACKUP_OF")
        self.faults = parse_fault_hook(test_hook("DHISPARSE_TEST_FAIL"))
        self.layers = {layer.name: layer for layer in layers}
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_queries = max_spec_queries
        self.device = device
        self.hierarchy: KVHierarchy | None = None
        self.device_pool_bytes = 0  # counted inside vLLM's KV budget (pool_sizing.py)
        self.requests: dict[str, TrackedRequest] = {}
        self.vllm_cache = VllmC4aCaches()
        self.failed: dict[str, str] = {}
        self.fresh_rows: dict[str, int] = {}  # per source: arena columns for this step's rows
        self.pending_appends: dict[str, list] = {}  # per source: (request, have, want) rows
        self.fresh_selections = 0  # selections of rows computed this step (tail, direct)
        self.step_req_ids: list[str] = []  # requests scheduled in the current step
        self.routing = StepRouting()  # this step's plans; the hook asks once per layer
        self.failed_unreported: dict[str, str] = {}  # for the scheduler (worker metadata)
        self.failed_total = 0
        # metrics (stats.py): valid selections counted here, independently of the resolver's
        # direct/hot/host census; resolve call times on CPU (or DHISPARSE_TIME_RESOLVE=1)
        self.selected_rows = 0
        self.resolve_times: list[float] = []
        self.verify_queries: list[int] = []  # K_r of admitted requests' decode steps
        self.prompt_tokens_computed = 0  # prompt tokens this engine ran forward (not loaded)
        self.time_resolve = time_resolve_enabled(device.type)
        self.stats_collector = StatsCollector()

    # -- set-up -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], kv_cache_config=None) -> None:
        self.vllm_cache.register(kv_caches, self.layers)
        if self.kv_role in ("kv_producer", "kv_consumer"):
            self.handoff = HandoffWorker(self.kv_role, self.cfg, kv_caches, kv_cache_config,
                                         list(self.layers.values()), self._vllm_rows_upto)
        plans = plan_sources(self.cfg, list(self.layers.values()), self.max_model_len,
                             self.max_num_seqs, self.max_queries)
        staging = plan_staging(self.cfg, plans)
        check_budgeted(plans, staging)
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
        assert self.device_pool_bytes == device_pool_bytes(plans, staging), \
            "the hierarchy allocated other sizes than pool_sizing planned"
        logger.info("DHiSparse: %d sparse sources (%s), hot cache %d rows, host pool %.2f GiB",
                    len(specs), ", ".join(self.layers), specs[0].hot_rows, self.cfg.host_pool_gib)

    # -- per step -----------------------------------------------------------------------
    def begin_step(self, meta: DHiSparseMetadata) -> None:
        h = self.hierarchy
        assert h is not None, "register_kv_caches must run before the first step"
        self.routing.clear()
        for rid in sorted(meta.finished | meta.preempted):
            req = self.requests.pop(rid, None)
            if req is not None and req.admitted:
                (h.preempt if rid in meta.preempted else h.finish)(rid)
            self.failed.pop(rid, None)
        self.step_req_ids = [rs.req_id for rs in meta.requests]
        self.pending_appends = {}  # a step that raised before appending left nothing behind
        if self.handoff is not None:
            self.handoff.begin_step(meta)
        decoding = []
        for rs in meta.requests:
            req = self.requests.get(rs.req_id)
            self.prompt_tokens_computed += max(0, min(rs.num_scheduled_tokens,
                                                      rs.prompt_len - rs.num_computed_tokens))
            if req is not None and req.loaded:  # first step after its handoff was admitted
                req.loaded = False
                req.block_ids = [list(b) for b in rs.block_ids or ()]
            elif req is None or rs.replace_blocks:
                if req is not None and req.admitted:  # resumed after preemption
                    h.preempt(rs.req_id)
                req = TrackedRequest(rs.req_id, rs.prompt_len, rs.max_tokens,
                                     [list(b) for b in rs.block_ids or ()])
                self.requests[rs.req_id] = req
            elif rs.block_ids is not None:
                for group, new in zip(req.block_ids, rs.block_ids):
                    group.extend(new)
            req.num_computed_tokens = rs.num_computed_tokens
            req.num_scheduled_tokens = rs.num_scheduled_tokens
            req.num_spec_tokens = rs.num_spec_tokens
            if req.failed:
                continue
            if req.admitted and rs.num_scheduled_tokens > self.max_queries:
                self._fail(req, f"{rs.num_scheduled_tokens} tokens scheduled in one step "
                                f"after the prefill; the hierarchy serves at most "
                                f"{self.max_queries} (1 + speculative tokens)")
                continue
            with self._isolated(req):
                if not req.admitted and req.prefill_complete:
                    self._admit(req)  # retry: no device room when its prefill completed
                if req.admitted:
                    self._commit_rows(req)
            if req.admitted:
                decoding.append((req, rs.num_scheduled_tokens))
            req.prefill_complete = req.prefill_complete or rs.completes_prefill
        self._append_committed()
        # K_r of every request this step serves (stats.py)
        self.verify_queries.extend(k for req, k in decoding if req.admitted and not req.failed)

    @contextlib.contextmanager
    def _isolated(self, req: TrackedRequest):
        """Per-request hierarchy work: an exception fails this request alone (finish
        reason ``error``); the hierarchy releases it, every other request goes on."""
        try:
            yield
        except HostBackupError as e:
            self._fail(req, str(e))
        except Exception as e:  # noqa: BLE001 -- isolation is the point; logged in full
            logger.exception("DHiSparse: request %s: hierarchy work failed", req.req_id)
            self._fail(req, f"{type(e).__name__}: {e}")
        finally:
            self._take_hierarchy_failures()

    def _take_hierarchy_failures(self) -> None:
        """Requests the hierarchy released on its own (a victim whose deferred backup
        failed during another request's admission, a failed tail backup)."""
        for rid, why in self.hierarchy.take_failures().items():
            req = self.requests.get(rid)
            if req is not None:
                req.admitted = False  # already released
                self._fail(req, why)

    def _inject(self, point: str, req_id: str) -> None:
        """TEST ONLY (DHISPARSE_TEST_FAIL): a fault at ``point`` for this request."""
        if any(req_id.startswith(p) for p in self.faults.get(point, ())):
            raise RuntimeError(f"injected {point} failure")

    def _fail(self, req: TrackedRequest, why: str) -> None:
        """The request cannot be served exactly any more: fail it alone (the scheduler
        half finishes it with an error, see scheduler_hooks.py)."""
        if req.failed:
            return
        req.failed = why
        self.failed[req.req_id] = why
        self.failed_unreported[req.req_id] = why
        self.failed_total += 1
        if req.admitted and req.req_id in self.hierarchy.requests:
            self.hierarchy.preempt(req.req_id)
        req.admitted = False
        logger.error("DHiSparse: request %s failed: %s", req.req_id, why)

    def admit_completed_prefills(self) -> None:
        """After the forward (``wait_for_save``): requests whose prefill this step completed
        are admitted.  vLLM frees c4a blocks behind ``device_window_tokens`` only from the
        next step's allocation on (kv_spec.py), so every row is still in its cache."""
        window = self.cfg.device_window_tokens
        for rid in self.step_req_ids:
            req = self.requests.get(rid)
            if req is None or req.admitted or req.failed or not req.prefill_complete:
                continue
            # drafts (or placeholder drafts) computed this step are not history
            req.num_computed_tokens += req.num_scheduled_tokens - req.num_spec_tokens
            req.num_scheduled_tokens = req.num_spec_tokens = 0
            with self._isolated(req):
                self._admit(req)
            if not req.admitted and not req.failed and window:
                self._fail(req, "no room in the hierarchy (device slots or host extent) "
                                "to hold the history vLLM frees behind "
                                "device_window_tokens; raise host_pool_gib / "
                                "device_pool_pages or lower max_num_seqs")

    def _committed_rows(self, req: TrackedRequest, layer: SparseLayer) -> int:
        return req.num_computed_tokens // layer.compress_ratio  # eq. 8: complete rows only

    def _vllm_rows(self, req: TrackedRequest, layer: SparseLayer, start: int, end: int) -> torch.Tensor:
        return self.vllm_cache.rows(layer, req.block_ids[layer.group],
                                    torch.arange(start, end, dtype=torch.int64))

    def _vllm_rows_upto(self, layer: SparseLayer, block_ids: list[int], n: int) -> torch.Tensor:
        return self.vllm_cache.rows(layer, block_ids, torch.arange(n, dtype=torch.int64))

    def _max_rows(self, req: TrackedRequest) -> dict[str, int]:
        return {name: min(self.hierarchy.source(name).spec.max_rows,
                          -(-(req.prompt_len + req.max_tokens) // layer.compress_ratio) + 1)
                for name, layer in self.layers.items()}

    def admit_loaded(self, job: LoadJob) -> bool:
        """kv_consumer: a loaded request's c4a history goes straight into the hierarchy
        (resident-first); False when there is no room yet (the request stays parked)."""
        item, rows = job.item, job.handoff.rows
        req = TrackedRequest(item.req_id, item.num_tokens, item.max_tokens,
                             [list(b) for b in item.block_ids],
                             num_computed_tokens=item.num_tokens - 1, loaded=True)
        if not self.hierarchy.admit(req.req_id, self._max_rows(req), rows):
            return False
        req.admitted = req.prefill_complete = True
        req.rows = {name: rows[name].shape[0] for name in self.layers}
        self.requests[req.req_id] = req
        c = self.handoff.counters
        for name in self.layers:
            parts = self.hierarchy.source(name)
            rec = parts.residency.request(req.req_id)
            host = (rec.eligible_pages - len(rec.optional)) * parts.spec.page_size
            c.rows_host += host
            c.rows_device += req.rows[name] - host
        return True

    def transfer_results(self) -> tuple[set[str], set[str]]:
        """kv_consumer: loads finished (and failed) since the last call."""
        if self.handoff is None:
            return set(), set()
        out = self.handoff.transfer_results(self.admit_loaded)
        self._take_hierarchy_failures()
        return out

    def _admit(self, req: TrackedRequest) -> None:
        self._inject("admit", req.req_id)
        h = self.hierarchy
        imported, max_rows = {}, self._max_rows(req)
        for name, layer in self.layers.items():
            imported[name] = self._vllm_rows(req, layer, 0, self._committed_rows(req, layer))
        if self.fail_backup_of and req.req_id.startswith(self.fail_backup_of):
            for name in self.layers:
                h.source(name).host.fail_next_backup_of.add(req.req_id)
        if not h.admit(req.req_id, max_rows, imported):
            logger.warning("DHiSparse: no device room to admit %s now; it reads vLLM's cache "
                           "this step", req.req_id)
            return
        req.admitted = True
        req.rows = {name: imported[name].shape[0] for name in self.layers}

    def _commit_rows(self, req: TrackedRequest) -> None:
        """Rows that became committed are appended after every request of the step is
        known (``_append_committed``: one append_batch per source)."""
        self._inject("append", req.req_id)
        for name, layer in self.layers.items():
            have, want = req.rows[name], self._committed_rows(req, layer)
            if want > have:
                self.pending_appends.setdefault(name, []).append((req, have, want))

    def _append_committed(self) -> None:
        pending, self.pending_appends = self.pending_appends, {}
        for name, items in pending.items():
            layer = self.layers[name]
            batch = []  # (request, rows it commits up to, those rows)
            for req, have, want in items:
                if req.admitted and not req.failed:
                    with self._isolated(req):
                        batch.append((req, want, self._vllm_rows(req, layer, have, want)))
            if not batch:
                continue
            try:
                failed = self.hierarchy.append_batch(
                    name, [req.req_id for req, _, _ in batch], torch.cat([d for _, _, d in batch]),
                    [d.shape[0] for _, _, d in batch])
            except Exception:  # noqa: BLE001 -- nothing changed when it raises: find whose
                logger.exception("DHiSparse: a batched append to %s failed; appending its %d "
                                 "requests one by one", name, len(batch))
                failed = None
            for req, want, rows in batch:
                with self._isolated(req):
                    if failed is None:
                        self.hierarchy.append(req.req_id, name, rows)
                    elif req.req_id in failed:
                        raise failed[req.req_id]
                    req.rows[name] = want

    # -- attention hook support ------------------------------------------------------------
    def attention_cache(self, layer: SparseLayer) -> tuple[torch.Tensor, int]:
        """The storage the source's pool and staging arenas share, as the attention op's
        ``(cache_2d, block_size)``: one block of all rows, which locations index."""
        rows = self.hierarchy.source(layer.name).pool.device_rows
        return rows.storage.view(1, -1), rows.num_rows

    def staging_arena(self, layer: SparseLayer):
        """Context manager: the staging arena ``layer`` holds from its resolve until its
        attention has returned (``KVHierarchy.staging_arena``)."""
        return self.hierarchy.staging_arena(layer.name)

    def routing_plan(self, layer: SparseLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
                     token_rows: torch.Tensor) -> RoutingPlan:
        """This step's plan for ``layer``'s KV cache group (routing.py): built on the first
        ask, reused by the group's other layers."""
        return self.routing.plan(self.requests, layer.group,
                                 layer.rows_per_block * layer.compress_ratio, block_table,
                                 seq_lens, token_rows)

    def resolve_tokens(self, layer: SparseLayer, plan: RoutingPlan, topk: torch.Tensor,
                       arena) -> torch.Tensor:
        """Routed tokens' top-k rows -> storage rows.  topk [T_r, k] int32 -> [T_r, k] int64.

        ``arena`` (from ``staging_arena(layer)``, held until attention has read the rows):
        batch row i's overflow misses and this step's rows go to request i's arena rows."""
        h = self.hierarchy
        parts = h.source(layer.name)
        req_ids, tok_n, tok_j = plan.req_ids, plan.tok_n, plan.tok_j
        reqs = [self.requests[r] for r in req_ids]
        n, kq, top_k = len(req_ids), plan.num_queries, topk.shape[1]
        sel = torch.full((n, kq, top_k), -1, dtype=torch.int32, device=topk.device)
        sel[tok_n, tok_j] = topk.to(torch.int32)
        committed = torch.tensor([r.rows.get(layer.name, 0) for r in reqs],
                                 dtype=torch.int32, device=sel.device).view(n, 1, 1)
        fresh = sel >= committed  # rows computed this step: not in the hierarchy yet
        cap = self.fresh_rows[layer.name]
        wants: dict[int, torch.Tensor] = {}
        has_fresh = fresh.flatten(1).any(1).tolist()  # one host read for all requests
        for i, req in enumerate(reqs):
            if req.failed:
                continue
            with self._isolated(req):
                self._inject("resolve", req.req_id)
                if has_fresh[i]:
                    want = torch.unique(sel[i][fresh[i]].to(torch.int64))
                    if want.numel() > cap:
                        raise RuntimeError(f"{want.numel()} rows computed this step exceed the "
                                           f"{cap} staging arena rows planned for them")
                    wants[i] = want
        # A request failed in this step reads no row (its output is discarded with the
        # error); the others are resolved together.
        locs = torch.full((n, kq, top_k), -1, dtype=torch.int64, device=sel.device)
        committed_sel = torch.where(fresh, -1, sel)
        ok = [i for i, r in enumerate(reqs) if not r.failed]
        resolved = list(ok)  # the resolver counted these requests' selections
        if ok:
            t0 = time.perf_counter()
            try:
                got, _ = h.resolve(layer.name, [req_ids[i] for i in ok], committed_sel[ok],
                                   arena=arena, arena_rows=ok)
                locs[ok] = got.to(torch.int64)
            except Exception:  # noqa: BLE001 -- find whose: one request at a time, isolated
                logger.exception("DHiSparse: a batched resolve failed; resolving its %d requests "
                                 "one by one", len(ok))
                resolved = []
                for i in ok:
                    with self._isolated(reqs[i]):
                        got, _ = h.resolve(layer.name, [req_ids[i]], committed_sel[i:i + 1],
                                           arena=arena, arena_rows=[i])
                        locs[i] = got[0].to(torch.int64)
                        resolved.append(i)
            if self.time_resolve:
                if sel.is_cuda:
                    torch.cuda.synchronize(sel.device)
                self.resolve_times.append(time.perf_counter() - t0)
        for i, want in wants.items():
            if reqs[i].failed:  # failed above, or released meanwhile by the hierarchy
                continue
            with self._isolated(reqs[i]):
                dst = arena.fresh_rows(i, want.numel())  # [n] int64, request i's own rows
                parts.pool.write(dst, self.vllm_cache.rows(layer, reqs[i].block_ids[layer.group],
                                                           want))
                locs[i][fresh[i]] = dst[torch.searchsorted(want, sel[i][fresh[i]].to(torch.int64))]
        served = [i for i in ok if not reqs[i].failed]
        for i in set(ok) - set(served):
            locs[i] = -1
        # selected = direct + hot + host: the resolver's census of what it resolved, plus
        # this step's rows (direct) of the requests served
        self.selected_rows += int((committed_sel[resolved] >= 0).sum()) + int(fresh[served].sum())
        self.fresh_selections += int(fresh[served].sum())
        if self.corrupt_mapping:
            _corrupt_one(locs)
        return locs[tok_n, tok_j]

    def end_step(self) -> None:
        if self.hierarchy is not None:
            if self.handoff is not None:  # before admission: every block is still vLLM's
                self.handoff.capture(self.requests, self.step_req_ids)
            self.admit_completed_prefills()
            self.hierarchy.step()
            self._take_hierarchy_failures()
            if self.cfg.stats_file:
                write_json_atomic(self.cfg.stats_file.replace("{pid}", str(os.getpid())),
                                  self.summary())
        self.routing.clear()  # admissions and failures changed who is routed

    def summary(self) -> dict:
        """Counters summed over sources (stats.summarize)."""
        return summarize(self)

    def take_failed(self) -> dict[str, str]:
        out, self.failed_unreported = self.failed_unreported, {}
        return out

    def get_kv_connector_stats(self):
        """Deltas since the previous call, for vLLM's metrics path (stats.py)."""
        return self.stats_collector.collect(self)


def _corrupt_one(locs: torch.Tensor) -> None:
    """TEST ONLY: point one selection at another selected row (proves E2E tests can fail)."""
    flat = locs.view(-1)
    valid = (flat >= 0).nonzero().flatten()
    if valid.numel() >= 2:
        a, b = int(valid[0]), int(valid[1])
        if int(flat[a]) != int(flat[b]):
            flat[a] = flat[b]
