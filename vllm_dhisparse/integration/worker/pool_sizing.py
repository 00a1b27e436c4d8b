"""How big the hierarchy's pools are, and where their device bytes come from.

Per sparse (c4a) layer, one source:

* **device pool** (pages of ``rows_per_block`` rows, one vLLM block's worth):
  the *floor* is what ``max_num_seqs`` running requests require -- each a hot
  cache of ``B`` rows and ``tail_pages`` tail pages -- plus
  ``admission_reserve_pages``.  ``device_pool_pages = 0`` (auto) gives the
  floor plus as many pages again for optional history (one hot cache's worth
  per running request); an explicit value must be at least the floor.
* **host pool**: ``host_pool_gib`` split evenly over the sparse layers.

Shared by the sources: ``staging_arenas`` (chi) verification arenas of
``max_num_seqs x (K_max * k - B + fresh)`` rows, where ``fresh`` bounds the
rows a step reads past a request's committed ones (:func:`fresh_rows`; eq. 11;
hierarchy/staging_arena.py).

The device pools are counted **inside** the KV memory the operator gives vLLM
(``--kv-cache-memory-bytes``, or the share from ``--gpu-memory-utilization``):
the connector's worker (worker.py) takes them off in ``determine_available_memory``,
so vLLM's own blocks get what is left (:func:`take_budget`).  :func:`plan_pools` makes
one :class:`PoolPlan` per process for the same inputs: the budget taken there (before
vLLM's KV cache config exists), the worker's check against the KV cache config and the
worker half's ``register_kv_caches`` read the same plan object.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from vllm.logger import init_logger

from vllm_dhisparse.config import DHiSparseConfig
from vllm_dhisparse.hierarchy.sizing import hot_cache_pages, required_pages, staging_bytes
from vllm_dhisparse.hierarchy.specs import SourceSpec, StagingSpec, device_bytes, storage_groups

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

GIB = 2**30


@dataclass(frozen=True)
class LayerShape:
    """What sizing needs of one sparse layer."""
    name: str
    compress_ratio: int
    top_k: int
    row_bytes: int
    rows_per_block: int
    plane_bytes: tuple[int, ...]


@dataclass(frozen=True)
class SourcePlan:
    spec: SourceSpec
    fresh_rows: int  # arena columns for rows past the committed ones (fresh_rows())
    overflow_rows: int  # arena columns for verification misses beyond B: K_max * k - B
    floor_pages: int


def fresh_rows(max_queries: int, ratio: int) -> int:
    """Rows a decode step reads past a request's committed ones, at most: those its
    1 + K queries complete, and with asynchronous scheduling also those of the previous
    step's K drafts, uncommitted until verified (admission.py): up to 2q - 1 tokens past
    the committed ones, the first of them anywhere inside a row."""
    this_step = -(-max_queries // ratio) + 1  # + 1: the queries may straddle a row edge
    with_unverified = (2 * max_queries - 1 + ratio - 1) // ratio
    return max(this_step, with_unverified)


def plan_staging(cfg: DHiSparseConfig, plans: list[SourcePlan]) -> StagingSpec | None:
    """The arenas the sources share: chi x N x (overflow + fresh) rows."""
    if not plans:
        return None
    if cfg.staging_arenas > len(plans):
        raise ValueError(f"kv_connector_extra_config['staging_arenas'] = {cfg.staging_arenas} "
                         f"exceeds the {len(plans)} sparse layers; allowed 1..{len(plans)}")
    columns = max(p.overflow_rows for p in plans) + max(p.fresh_rows for p in plans)
    return StagingSpec(arenas=cfg.staging_arenas, columns=columns)


def plan_sources(cfg: DHiSparseConfig, layers: list, max_model_len: int, max_num_seqs: int,
                 max_queries: int) -> list[SourcePlan]:
    """One :class:`SourcePlan` per layer (anything with :class:`LayerShape`'s fields);
    raises ``ValueError`` naming the key when a pool cannot hold what it must."""
    plans = []
    for layer in layers:
        layer_rows = -(-max_model_len // layer.compress_ratio) + 1
        hot = cfg.hot_cache_rows_for(layer.top_k)
        fresh = fresh_rows(max_queries, layer.compress_ratio)
        overflow = max(0, max_queries * layer.top_k - hot)
        page = layer.rows_per_block
        per_req_pages = required_pages(hot, page, cfg.tail_pages)
        host_rows = int(cfg.host_pool_gib * GIB) // (layer.row_bytes * len(layers))
        if host_rows < layer_rows:
            raise ValueError(
                f"kv_connector_extra_config['host_pool_gib'] = {cfg.host_pool_gib} holds "
                f"{host_rows} rows per sparse layer, fewer than one request of max_model_len "
                f"{max_model_len} needs ({layer_rows}); raise host_pool_gib")
        if cfg.device_window_tokens and host_rows < max_num_seqs * layer_rows:
            raise ValueError(
                f"kv_connector_extra_config['host_pool_gib'] = {cfg.host_pool_gib} holds "
                f"{host_rows} rows per sparse layer; with device_window_tokens > 0 every "
                f"running request's history must fit the host pool ({max_num_seqs} x "
                f"{layer_rows} rows); raise host_pool_gib or lower max_num_seqs")
        floor = max_num_seqs * per_req_pages + cfg.admission_reserve_pages
        device_pages = cfg.device_pool_pages or floor + max_num_seqs * hot_cache_pages(hot, page)
        if device_pages < floor:
            raise ValueError(
                f"kv_connector_extra_config['device_pool_pages'] = {device_pages} is below what "
                f"max_num_seqs={max_num_seqs} running requests require ({per_req_pages} "
                f"pages each: hot cache, tail) plus admission_reserve_pages "
                f"{cfg.admission_reserve_pages}; allowed >= {floor} (or 0 = auto)")
        plans.append(SourcePlan(SourceSpec(
            name=layer.name, row_bytes=layer.row_bytes, page_size=page, device_pages=device_pages,
            host_rows=host_rows, hot_cache_rows=hot, tail_pages=cfg.tail_pages,
            max_req_slots=max_num_seqs, max_rows=layer_rows,
            plane_bytes=layer.plane_bytes), fresh, overflow, floor))
    return plans


def device_pool_bytes(plans: list[SourcePlan], staging: StagingSpec | None) -> int:
    """Device bytes of the pools and the arenas (what ``KVHierarchy`` allocates)."""
    return device_bytes([p.spec for p in plans], staging)


def staging_sizes(plans: list[SourcePlan], staging: StagingSpec | None, layers: list,
                  k_max: int) -> dict:
    """Verification staging: the arenas' bytes next to eq. 11's bound
    ``M_stage = chi * N * K_max * k * d_KV`` for the widest source."""
    n = plans[0].spec.max_req_slots if plans else 0
    chi = staging.arenas if staging else 0
    groups = storage_groups([p.spec for p in plans], staging)
    arena = sum(g.arena_rows * sum(g.layout) for g in groups)
    widest = max((layer.top_k * layer.row_bytes for layer in layers), default=0)
    # arenas_allocated: chi per storage (a model split into several storages has more)
    return dict(staging_arenas=chi, arenas_allocated=sum(g.arenas for g in groups),
                staging_reserved_bytes=arena,
                staging_bound_bytes=staging_bytes(chi, n, k_max, 1, widest))


@dataclass(frozen=True)
class PoolPlan:
    """Every source's pool and the staging arenas they share."""
    sources: tuple[SourcePlan, ...]
    staging: StagingSpec | None

    @property
    def device_bytes(self) -> int:
        return device_pool_bytes(list(self.sources), self.staging)


def layer_shape(layer) -> LayerShape:
    """What sizing reads of a sparse layer (a SparseLayer, a LayerShape)."""
    return LayerShape(layer.name, layer.compress_ratio, layer.top_k, layer.row_bytes,
                      layer.rows_per_block, tuple(layer.plane_bytes))


def plan_pools(cfg: DHiSparseConfig, layers: list, max_model_len: int, max_num_seqs: int,
               max_queries: int) -> PoolPlan:
    """The pools of ``layers``; the same object for the same inputs within a process."""
    return _plan(cfg, tuple(layer_shape(layer) for layer in layers), max_model_len,
                 max_num_seqs, max_queries)


@functools.lru_cache(maxsize=8)
def _plan(cfg, shapes, max_model_len, max_num_seqs, max_queries) -> PoolPlan:
    sources = plan_sources(cfg, list(shapes), max_model_len, max_num_seqs, max_queries)
    return PoolPlan(tuple(sources), plan_staging(cfg, sources))


def engine_plan(vllm_config, cfg: DHiSparseConfig, layers: list) -> PoolPlan:
    """:func:`plan_pools` with the engine's limits."""
    return plan_pools(cfg, layers, vllm_config.model_config.max_model_len,
                      vllm_config.scheduler_config.max_num_seqs, max_queries(vllm_config))


def check_budgeted(need: int, taken: int) -> None:
    """The pools about to be allocated are the ones taken off vLLM's budget."""
    if need != taken:
        raise RuntimeError(
            f"DHiSparse: the device pools need {need} B but {taken} B were taken off vLLM's "
            f"KV budget (the c4a block size of vLLM's KV cache config differs from "
            f"cache_config.block_size)")


def max_queries(vllm_config) -> int:
    """Queries per request and step: the anchor plus the speculative tokens."""
    spec = vllm_config.speculative_config
    return 1 + (spec.num_speculative_tokens if spec is not None else 0)


def budget_layers(vllm_config) -> list[LayerShape]:
    """The sparse layers of the loaded model, before vLLM's KV cache config exists:
    c4a blocks hold ``block_size`` tokens, ``block_size / 4`` rows."""
    from ..layers.model_probe import (FP8_DS_MLA_PLANE_BYTES, FP8_DS_MLA_ROW_BYTES,
                                      iter_sparse_modules)
    block = vllm_config.cache_config.block_size
    return [LayerShape(name, module.compress_ratio, int(module.topk_indices_buffer.shape[1]),
                       FP8_DS_MLA_ROW_BYTES, block // module.compress_ratio, FP8_DS_MLA_PLANE_BYTES)
            for name, module in iter_sparse_modules(vllm_config)]


def take_budget(vllm_config, cfg: DHiSparseConfig, available: int) -> tuple[int, int]:
    """``(vLLM's share, the pools' share)`` of vLLM's KV budget (the worker's
    ``determine_available_memory``; the worker keeps the second for ``check_budgeted``)."""
    pools = engine_plan(vllm_config, cfg, budget_layers(vllm_config)).device_bytes
    if pools >= available:
        raise ValueError(
            f"DHiSparseConnector: the hierarchy's device pools need {pools / GIB:.3f} GiB of "
            f"the {available / GIB:.3f} GiB KV budget, leaving nothing for vLLM's blocks; "
            f"raise --kv-cache-memory-bytes (or --gpu-memory-utilization), or lower "
            f"max_num_seqs / kv_connector_extra_config['device_pool_pages'] / "
            f"kv_connector_extra_config['staging_arenas']")
    logger.info("DHiSparse: %.3f GiB of the %.3f GiB KV budget go to the hierarchy's "
                "device pools, %.3f GiB to vLLM's blocks", pools / GIB, available / GIB,
                (available - pools) / GIB)
    return available - pools, pools
