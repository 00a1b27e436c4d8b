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
committed yet: the attention hook reads them through per-request staging
rows, copied from vLLM's cache for that step only, so a rejected draft never
reaches the hierarchy.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from vllm_dhisparse.config import DHiSparseConfig, parse_fault_hook, test_hook
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.host_store import HostBackupError
from vllm_dhisparse.hierarchy.specs import ResidencyConfig

from .metadata import DHiSparseMetadata
from .model_probe import SparseLayer
from .pool_sizing import device_pool_bytes, plan_sources
from .stats import StatsCollector, time_resolve_enabled

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


@dataclass
class TrackedRequest:
    req_id: str
    prompt_len: int
    max_tokens: int
    block_ids: list[list[int]]  # per KV cache group
    num_computed_tokens: int = 0
    num_scheduled_tokens: int = 0  # this step's tokens (prefill chunk, or anchor + drafts)
    prefill_complete: bool = False  # its known tokens are computed (or are this step)
    admitted: bool = False
    failed: str | None = None
    rows: dict[str, int] = field(default_factory=dict)  # committed rows per source


class WorkerSide:
    def __init__(self, cfg: DHiSparseConfig, layers: list[SparseLayer], max_model_len: int,
                 max_num_seqs: int, max_spec_queries: int, device: torch.device):
        self.cfg = cfg
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
        self.caches: dict[str, torch.Tensor] = {}  # source -> vLLM rows view [R, row_bytes]
        self.failed: dict[str, str] = {}
        self.fresh_rows: dict[str, int] = {}  # per source: staging columns for this step's rows
        self.fresh_selections = 0  # selections of rows computed this step (tail, direct)
        self.step_req_ids: list[str] = []  # requests scheduled in the current step
        # this step's newest_blocks(...) per (group, tokens_per_block); the hook asks per layer
        self.newest: dict[tuple[int, int], dict[int, str]] = {}
        self.failed_unreported: dict[str, str] = {}  # for the scheduler (worker metadata)
        self.failed_total = 0
        # metrics (stats.py): valid selections counted here, independently of the resolver's
        # direct/hot/host census; resolve call times on CPU (or DHISPARSE_TIME_RESOLVE=1)
        self.selected_rows = 0
        self.resolve_times: list[float] = []
        self.time_resolve = time_resolve_enabled(device.type)
        self.stats_collector = StatsCollector()

    # -- set-up -------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        for name in self.layers:
            if name not in kv_caches:
                raise ValueError(f"sparse layer {name!r} has no KV cache; caches: {sorted(kv_caches)}")
            cache = kv_caches[name].view(torch.uint8)
            # A block is [rows x 576 data][rows x 8 scales], padded to a 576 B
            # multiple (attention.py:873); logical rows are data + scales.
            self.caches[name] = cache.reshape(cache.shape[0], -1)
        plans = plan_sources(self.cfg, list(self.layers.values()), self.max_model_len,
                             self.max_num_seqs, self.max_queries)
        self.fresh_rows = {p.spec.name: p.fresh_rows for p in plans}
        self.device_pool_bytes = device_pool_bytes(plans)
        specs = [p.spec for p in plans]
        residency = ResidencyConfig(
            admission_reserve_pages=self.cfg.admission_reserve_pages,
            repopulate_pages_per_step=self.cfg.repopulate_pages_per_step,
            reclaim_policy=self.cfg.reclaim_policy,
            optional_residency=self.cfg.optional_residency, eager_backup=self.cfg.eager_backup)
        self.hierarchy = KVHierarchy(specs, residency, device=self.device,
                                     backend=self.cfg.resolver_backend)
        logger.info("DHiSparse: %d sparse sources (%s), hot cache %d rows, host pool %.2f GiB",
                    len(specs), ", ".join(self.layers), specs[0].hot_rows, self.cfg.host_pool_gib)

    # -- per step -----------------------------------------------------------------------
    def begin_step(self, meta: DHiSparseMetadata) -> None:
        h = self.hierarchy
        assert h is not None, "register_kv_caches must run before the first step"
        self.newest.clear()
        for rid in sorted(meta.finished | meta.preempted):
            req = self.requests.pop(rid, None)
            if req is not None and req.admitted:
                (h.preempt if rid in meta.preempted else h.finish)(rid)
            self.failed.pop(rid, None)
        self.step_req_ids = [rs.req_id for rs in meta.requests]
        for rs in meta.requests:
            req = self.requests.get(rs.req_id)
            if req is None or rs.replace_blocks:
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
            req.prefill_complete = req.prefill_complete or rs.completes_prefill

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
            req.num_computed_tokens += req.num_scheduled_tokens
            req.num_scheduled_tokens = 0
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
        return self._vllm_rows_at(req, layer, torch.arange(start, end, dtype=torch.int64))

    def _vllm_rows_at(self, req: TrackedRequest, layer: SparseLayer, rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of ``req`` as vLLM's paged cache holds them.  # [n, row_bytes] uint8"""
        cache = self.caches[layer.name]  # [blocks, block_bytes] uint8
        blocks = torch.tensor(req.block_ids[layer.group], dtype=torch.int64)
        rows = rows.to(torch.int64).cpu()
        b = blocks[rows // layer.rows_per_block].to(cache.device)
        pos = (rows % layer.rows_per_block).to(cache.device)
        parts, plane_start = [], 0
        for seg in layer.segments:  # plane s of a block starts after rows_per_block rows of s-1
            cols = plane_start + pos[:, None] * seg + torch.arange(seg, device=cache.device)
            parts.append(cache[b[:, None], cols])
            plane_start += layer.rows_per_block * seg
        return torch.cat(parts, dim=1)

    def _admit(self, req: TrackedRequest) -> None:
        self._inject("admit", req.req_id)
        h = self.hierarchy
        imported, max_rows = {}, {}
        for name, layer in self.layers.items():
            imported[name] = self._vllm_rows(req, layer, 0, self._committed_rows(req, layer))
            spec_rows = h.source(name).spec.max_rows
            max_rows[name] = min(spec_rows, -(-(req.prompt_len + req.max_tokens) // layer.compress_ratio) + 1)
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
        self._inject("append", req.req_id)
        for name, layer in self.layers.items():
            have, want = req.rows[name], self._committed_rows(req, layer)
            if want > have:
                self.hierarchy.append(req.req_id, name, self._vllm_rows(req, layer, have, want))
                req.rows[name] = want

    # -- attention hook support ------------------------------------------------------------
    def attention_cache(self, layer: SparseLayer) -> tuple[torch.Tensor, int]:
        """The pool as the attention op's ``(cache_2d, block_size)``: one block of all rows."""
        pool = self.hierarchy.source(layer.name).pool
        return pool.storage.view(1, -1), pool.num_rows

    def rows_to_requests(self, block_table: torch.Tensor, layer: SparseLayer,
                         seq_lens: torch.Tensor, token_rows: torch.Tensor | None = None
                         ) -> list[str | None]:
        """Batch row -> admitted request id, matched by the block holding the request's
        newest token.  That block is live (never behind the device window), so it belongs
        to one running request only; a request's first block may have been freed and
        handed to another request (stale in the worker's block table).  The block -> request
        map is built once per step and (group, tokens per block): every layer asks."""
        tokens_per_block = layer.rows_per_block * layer.compress_ratio
        key = (layer.group, tokens_per_block)
        check = key not in self.newest
        if check:
            self.newest[key] = newest_blocks(self.requests.values(), *key)
        newest = self.newest[key]
        rows = min(block_table.shape[0], seq_lens.shape[0])
        cols = ((seq_lens[:rows].to(torch.int64) - 1).clamp(min=0) // tokens_per_block).cpu()
        cols = cols.clamp(max=block_table.shape[1] - 1)
        ids = block_table[:rows].cpu().gather(1, cols.view(-1, 1)).flatten().tolist()
        out = [newest.get(int(b)) for b in ids] + [None] * (block_table.shape[0] - rows)
        if check and token_rows is not None:
            self.check_identity(out, seq_lens, token_rows)
        return out

    def check_identity(self, rows_req: list[str | None], seq_lens: torch.Tensor,
                       token_rows: torch.Tensor) -> None:
        """Fails loudly rather than resolve one request's tokens against another's tables:
        every routed batch row is a distinct request whose sequence length and token count
        this step are the ones the scheduler sent for it."""
        counts = torch.bincount(token_rows.cpu().to(torch.int64), minlength=len(rows_req)).tolist()
        lens = seq_lens.cpu().tolist()
        seen: set[str] = set()
        for row, rid in enumerate(rows_req):
            if rid is None:
                continue
            req = self.requests[rid]
            want = req.num_computed_tokens + req.num_scheduled_tokens
            got = lens[row] if row < len(lens) else None
            if rid in seen or got != want or counts[row] != req.num_scheduled_tokens:
                raise RuntimeError(
                    f"DHiSparse: batch row {row} resolved to request {rid} but does not match it "
                    f"(sequence length {got} vs {want}, {counts[row]} tokens vs "
                    f"{req.num_scheduled_tokens} scheduled, seen twice: {rid in seen}); "
                    f"refusing to read another request's rows")
            seen.add(rid)

    def resolve_tokens(self, layer: SparseLayer, req_rows: torch.Tensor, topk: torch.Tensor,
                       rows_req: list[str | None]) -> torch.Tensor:
        """Per-token top-k rows -> pool rows.  topk [T, k] int32 -> [T, k] int64."""
        h = self.hierarchy
        parts = h.source(layer.name)
        # A request's tokens are contiguous in vLLM's batch: group n = n-th run of
        # equal rows, query j = position inside the run (anchor first, eq. 5).
        runs, tok_n, counts = torch.unique_consecutive(
            req_rows.cpu(), return_inverse=True, return_counts=True)
        starts = torch.cumsum(counts, 0) - counts  # [N]
        tok_j = torch.arange(req_rows.numel()) - starts[tok_n]
        req_ids = [rows_req[r] for r in runs.tolist()]
        reqs = [self.requests[r] for r in req_ids]
        n, kq, top_k = runs.numel(), int(counts.max()), topk.shape[1]
        sel = torch.full((n, kq, top_k), -1, dtype=torch.int32, device=topk.device)
        sel[tok_n, tok_j] = topk.to(torch.int32)
        committed = torch.tensor([r.rows.get(layer.name, 0) for r in reqs],
                                 dtype=torch.int32, device=sel.device).view(n, 1, 1)
        fresh = sel >= committed  # rows computed this step: not in the hierarchy yet
        cap = self.fresh_rows[layer.name]
        wants: dict[int, torch.Tensor] = {}
        for i, req in enumerate(reqs):
            if req.failed:
                continue
            with self._isolated(req):
                self._inject("resolve", req.req_id)
                if bool(fresh[i].any()):
                    want = torch.unique(sel[i][fresh[i]].to(torch.int64))
                    if want.numel() > cap:
                        raise RuntimeError(f"{want.numel()} rows computed this step exceed the "
                                           f"{cap} staging rows reserved for them")
                    wants[i] = want
        # A request failed in this step reads no row (its output is discarded with the
        # error); the others are resolved together.
        ok = torch.tensor([i for i, r in enumerate(reqs) if not r.failed], dtype=torch.int64)
        locs = torch.full((n, kq, top_k), -1, dtype=torch.int64, device=sel.device)
        if ok.numel():
            t0 = time.perf_counter()
            got, _ = h.resolve(layer.name, [req_ids[i] for i in ok.tolist()],
                               torch.where(fresh, -1, sel)[ok])
            if self.time_resolve:
                if sel.is_cuda:
                    torch.cuda.synchronize(sel.device)
                self.resolve_times.append(time.perf_counter() - t0)
            locs[ok] = got.to(torch.int64)
            self.selected_rows += int((sel[ok] >= 0).sum())
            self.fresh_selections += int(fresh[ok].sum())
        for i, want in wants.items():
            rid = req_ids[i]
            if reqs[i].failed:  # released meanwhile by the hierarchy
                continue
            staging = parts.pool.page_rows(parts.residency.request(rid).staging)
            dst = staging[staging.numel() - want.numel():].to(sel.device)
            parts.pool.write(dst, self._vllm_rows_at(reqs[i], layer, want))
            locs[i][fresh[i]] = dst[torch.searchsorted(want, sel[i][fresh[i]].to(torch.int64))]
        if self.corrupt_mapping:
            _corrupt_one(locs)
        return locs[tok_n, tok_j]

    def end_step(self) -> None:
        if self.hierarchy is not None:
            self.admit_completed_prefills()
            self.hierarchy.step()
            self._take_hierarchy_failures()
            if self.cfg.stats_file:
                write_json_atomic(self.cfg.stats_file, self.summary())
        self.newest.clear()  # admissions and failures changed the block -> request map

    def summary(self) -> dict:
        """Counters summed over sources (this step's rows count as direct: they are tail rows)."""
        st = self.hierarchy.stats()
        tot = dict(selected=0, direct=self.fresh_selections, hot=0, host=0, fetched=0,
                   bytes_fetched=0, verify_host_selections=0, verify_fetched=0, resolve_calls=0,
                   state_repairs=0)
        for src in st["sources"].values():
            r = src["resolver"]
            for key in ("direct", "hot", "host", "fetched", "bytes_fetched",
                        "verify_host_selections", "verify_fetched", "state_repairs"):
                tot[key] += r[key]
            tot["resolve_calls"] += r["calls"]
        tot["selected"] = tot["direct"] + tot["hot"] + tot["host"]
        tot.update(admissions=st["admissions"], admissions_waited=st["admissions_waited"],
                   finished=st["finished"], preempted=st["preempted"], failed=self.failed_total,
                   step=st["step"], admitted=st["admitted"],
                   device_pool_bytes=self.device_pool_bytes,
                   host_pool_bytes=sum(s["host_bytes_total"] for s in st["sources"].values()))
        return dict(totals=tot, sources=st["sources"])

    def take_failed(self) -> dict[str, str]:
        out, self.failed_unreported = self.failed_unreported, {}
        return out

    def get_kv_connector_stats(self):
        """Deltas since the previous call, for vLLM's metrics path (stats.py)."""
        return self.stats_collector.collect(self)


def newest_blocks(requests, group: int, tokens_per_block: int) -> dict[int, str]:
    """Block holding each admitted request's newest token (this step's) -> request id."""
    newest = {}
    for r in requests:
        blocks = r.block_ids[group] if r.admitted else None
        n = r.num_computed_tokens + r.num_scheduled_tokens
        if blocks and n > 0 and (n - 1) // tokens_per_block < len(blocks):
            newest[blocks[(n - 1) // tokens_per_block]] = r.req_id
    return newest


def _corrupt_one(locs: torch.Tensor) -> None:
    """TEST ONLY: point one selection at another selected row (proves E2E tests can fail)."""
    flat = locs.view(-1)
    valid = (flat >= 0).nonzero().flatten()
    if valid.numel() >= 2:
        a, b = int(valid[0]), int(valid[1])
        if int(flat[a]) != int(flat[b]):
            flat[a] = flat[b]


def write_json_atomic(path: str, data: dict) -> None:
    """Readers see the old file or the new one, never a partial write; the temp file is
    created exclusively (mkstemp) next to ``path``, so no other file is overwritten."""
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp",
                               dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
