"""The per-step context the routed attention layers read (one per step, built by the worker).

``WorkerSide.begin_step`` builds a :class:`StepContext` once the step's requests are
known and their committed rows appended, and binds it (:func:`bind`); the routed
attention layer of every sparse layer reads it (:func:`current`) and goes
layer -> context -> ``KVHierarchy.resolve`` -> attention kernel, never back into the
worker.  ``end_step`` unbinds it.  A forward without a bound context (vLLM's warm-up
and profile runs, the connector off) takes vLLM's own path.

The context holds: the step's requests and their committed rows per source, the
routing plan of each KV cache group (built on the first layer's ask from that
forward's block tables, routing.py, and reused by the group's other layers), the
staging arenas (a layer holds one from its resolve until its attention returned) and
the counters it adds to.  Rows computed in this very step (the anchor's and the
drafts', eq. 7-8) are not committed yet: they are copied from vLLM's cache into the
request's rows of the layer's staging arena.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy

from .failures import Failures
from .model_probe import SparseLayer
from .routing import RoutingPlan, StepRouting
from .vllm_cache import VllmC4aCaches

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


@dataclass
class ServedCounters:
    """What the routed layers served, across steps (stats.py reads them)."""
    selected_rows: int = 0  # valid selections, counted apart from the resolver's census
    fresh_selections: int = 0  # selections of rows computed in their own step (direct)
    resolve_times: list[float] = field(default_factory=list)  # seconds per resolve call


class StepContext:
    def __init__(self, hierarchy: KVHierarchy, layers: dict[str, SparseLayer], requests: dict,
                 vllm_cache: VllmC4aCaches, failures: Failures, counters: ServedCounters,
                 fresh_rows: dict[str, int], time_resolve: bool):
        self.hierarchy = hierarchy
        self.layers = layers
        self.requests = requests  # request id -> TrackedRequest
        self.vllm_cache = vllm_cache
        self.failures = failures
        self.counters = counters
        self.fresh_rows = fresh_rows  # per source: arena columns for this step's rows
        self.time_resolve = time_resolve
        self.routing = StepRouting()

    def layer(self, name: str) -> SparseLayer | None:
        """The sparse layer ``name`` if the hierarchy serves it."""
        return self.layers.get(name)

    def plan(self, layer: SparseLayer, block_table: torch.Tensor, seq_lens: torch.Tensor,
             token_rows: torch.Tensor) -> RoutingPlan:
        """Which tokens of this forward the hierarchy serves, and whose (routing.py)."""
        return self.routing.plan(self.requests, layer.group,
                                 layer.rows_per_block * layer.compress_ratio, block_table,
                                 seq_lens, token_rows)

    def staging_arena(self, layer: SparseLayer):
        """Context manager: the staging arena ``layer`` holds from its resolve until its
        attention has returned (``KVHierarchy.staging_arena``)."""
        return self.hierarchy.staging_arena(layer.name)

    def storage(self, layer: SparseLayer) -> tuple[torch.Tensor, int]:
        """The storage the source's pool and staging arenas share, as the attention op's
        ``(cache_2d, block_size)``: one block of all rows, which locations index."""
        rows = self.hierarchy.source(layer.name).pool.device_rows
        return rows.storage.view(1, -1), rows.num_rows

    def fresh_selections(self, req, sel: torch.Tensor, fresh: torch.Tensor, has_fresh: bool,
                         cap: int) -> torch.Tensor | None:
        """Distinct rows of ``req`` computed this step that its queries select (None: none).
        sel, fresh [K, k]; runs for every request of the call, inside its isolation."""
        if not has_fresh:
            return None
        want = torch.unique(sel[fresh].to(torch.int64))
        if want.numel() > cap:
            raise RuntimeError(f"{want.numel()} rows computed this step exceed the "
                               f"{cap} staging arena rows planned for them")
        return want

    def resolve(self, layer: SparseLayer, plan: RoutingPlan, topk: torch.Tensor,
                arena) -> torch.Tensor:
        """Routed tokens' top-k rows -> storage rows.  topk [T_r, k] int32 -> [T_r, k] int64.

        ``arena`` (from ``staging_arena(layer)``, held until attention has read the rows):
        batch row i's overflow misses and this step's rows go to request i's arena rows.
        A request that fails here reads no row (location -1); the others are served."""
        h, isolated = self.hierarchy, self.failures.isolated
        pool = h.source(layer.name).pool
        req_ids, tok_n, tok_j = plan.req_ids, plan.tok_n, plan.tok_j
        reqs = [self.requests[r] for r in req_ids]
        n, kq, top_k = len(req_ids), plan.num_queries, topk.shape[1]
        sel = torch.full((n, kq, top_k), -1, dtype=torch.int32, device=topk.device)
        sel[tok_n, tok_j] = topk.to(torch.int32)  # [N, K, k] request-local rows
        committed = torch.tensor([r.rows.get(layer.name, 0) for r in reqs],
                                 dtype=torch.int32, device=sel.device).view(n, 1, 1)
        fresh = sel >= committed  # [N, K, k] rows computed this step: not in the hierarchy
        cap = self.fresh_rows[layer.name]
        wants: dict[int, torch.Tensor] = {}
        has_fresh = fresh.flatten(1).any(1).tolist()  # one host read for all requests
        for i, req in enumerate(reqs):
            if not req.failed:
                with isolated(req):
                    want = self.fresh_selections(req, sel[i], fresh[i], has_fresh[i], cap)
                    if want is not None:
                        wants[i] = want
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
                    with isolated(reqs[i]):
                        got, _ = h.resolve(layer.name, [req_ids[i]], committed_sel[i:i + 1],
                                           arena=arena, arena_rows=[i])
                        locs[i] = got[0].to(torch.int64)
                        resolved.append(i)
            if self.time_resolve:
                if sel.is_cuda:
                    torch.cuda.synchronize(sel.device)
                self.counters.resolve_times.append(time.perf_counter() - t0)
        for i, want in wants.items():
            if reqs[i].failed:  # failed above, or released meanwhile by the hierarchy
                continue
            with isolated(reqs[i]):
                dst = arena.fresh_rows(i, want.numel())  # [n] int64, request i's own rows
                pool.write(dst, self.vllm_cache.rows(layer, reqs[i].block_ids[layer.group], want))
                locs[i][fresh[i]] = dst[torch.searchsorted(want, sel[i][fresh[i]].to(torch.int64))]
        served = [i for i in ok if not reqs[i].failed]
        for i in set(ok) - set(served):
            locs[i] = -1
        # counted here, apart from the resolver's direct/hot/host census, which must agree:
        # valid committed selections of the requests resolved, and this step's rows (direct)
        fresh_served = int(fresh[served].sum())
        self.counters.selected_rows += int((committed_sel[resolved] >= 0).sum()) + fresh_served
        self.counters.fresh_selections += fresh_served
        return locs[tok_n, tok_j]


_CURRENT: StepContext | None = None


def bind(ctx: StepContext) -> None:
    global _CURRENT
    _CURRENT = ctx


def unbind() -> None:
    global _CURRENT
    _CURRENT = None


def current() -> StepContext | None:
    """The bound step's context; None outside a step of an engine with the connector."""
    return _CURRENT
