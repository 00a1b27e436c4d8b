"""Connector metrics through vLLM's own path: worker stats -> scheduler -> Prometheus.

Flow (vLLM 0.32/0.33): after every forward the model runner calls
``DHiSparseConnector.get_kv_connector_stats()``; the worker answers a
:class:`DHiSparseConnectorStats` holding what changed *since its last answer*
(counters as deltas, gauges as latest values, resolver call times as samples).
vLLM aggregates the objects of all workers (``aggregate``), ships
``to_dict()`` to the front-end, and hands it to
:class:`DHiSparsePromMetrics.observe`, which increments counters, sets gauges
and observes the histogram.  Metrics are created only through the metric
classes vLLM passes in (``prometheus_client`` ones, or the Ray wrappers), so
the Ray metrics path works too.

All names live under ``vllm:dhisparse_*`` (never upstream's ``vllm:hisparse_*``).
Values are summed over the hierarchy's sources (one per sparse layer).  Counter
semantics: ``direct + hot + host = selected`` (each valid top-k selection is
resolved by exactly one path; rows computed in the current step count as
direct: they are tail rows) and ``host_to_device_bytes = rows_fetched x row
bytes`` (distinct rows copied, not selections).  Coverage is
``ready_optional_rows / eligible_history_rows``, computed in PromQL.

One table, :data:`METRICS`, declares every metric: its kind, its help text and where
its value is read in the worker's summary (``summarize``, also what ``stats_file``
holds): ``("totals", key)``, ``("sources", "*", key)`` summed over sources,
``("staging", key)``, ``("handoff", key)``, ``("spec", key)``.  Histograms take the
samples the worker collected since the last collection (``take_samples``).  Adding a
metric for a value the summary has is one line.

Resolver call time: ``time.perf_counter`` around ``KVHierarchy.resolve`` in
``StepContext.resolve``.  On CUDA that would time kernel launches, not work, unless
synchronized: it is recorded with ``resolve_timing`` ``on`` (which adds a
``torch.cuda.synchronize``), or ``auto`` on CPU.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats, PromMetric,
                                                                  PromMetricT)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

MAX_TIME_SAMPLES = 4096  # per collection; the worker is drained every step


@dataclass(frozen=True)
class MetricDef:
    key: str  # key in the stats payload
    name: str  # Prometheus name (counters are exposed with a ``_total`` suffix)
    kind: str  # "counter" | "gauge" | "histogram"
    doc: str
    path: tuple[str, ...] = ()  # where summarize() holds the value ("*": sum over sources)
    buckets: tuple[float, ...] = ()  # histograms only


def _c(key, doc, *path):
    return MetricDef(key, f"vllm:dhisparse_{key}", "counter", doc, path or ("totals", key))


def _g(key, doc, *path):
    return MetricDef(key, f"vllm:dhisparse_{key}", "gauge", doc, path or ("totals", key))


def _src(key):
    return ("sources", "*", key)


def _h(key, doc, buckets):
    return MetricDef(key, f"vllm:dhisparse_{key}", "histogram", doc, (), tuple(buckets))


METRICS: tuple[MetricDef, ...] = (
    # -- resolver census (counters, deltas per interval) --
    _c("selected_rows", "Top-k row selections read through the hierarchy (all paths; "
                        "= direct + hot + host).", "totals", "selected"),
    _c("selected_rows_direct", "Selections resolved directly on device: tail rows, rows of this "
                               "step, optional history pages.", "totals", "direct"),
    _c("selected_rows_hot", "Selections resolved through the per-request hot cache.",
       "totals", "hot"),
    _c("selected_rows_host", "Selections whose row was fetched from host memory.",
       "totals", "host"),
    _c("rows_fetched", "Distinct rows copied host->device (a row selected by several verify "
                       "queries of one step is fetched once).", "totals", "fetched"),
    _c("host_to_device_bytes", "Bytes copied host->device by the resolver (= rows_fetched x row "
                               "bytes).", "totals", "bytes_fetched"),
    _c("verify_host_selections", "Host-path selections in multi-query (verification) resolves."),
    _c("verify_rows_fetched", "Distinct rows fetched in multi-query (verification) resolves; "
                              "verify_host_selections / verify_rows_fetched = shared retrieval.",
       "totals", "verify_fetched"),
    _c("resolve_calls", "Resolver calls (one per sparse layer per step with admitted requests)."),
    _c("state_repairs", "Out-of-range resolver table entries degraded to empty (rows re-fetched "
                        "from host); 0 unless a table was corrupted."),
    # -- residency events (counters) --
    _c("reclaim_events", "Admissions that reclaimed the optional history of at least one "
                         "request (eq. 4).", *_src("reclaim_events")),
    _c("requests_reclaimed", "Requests whose optional history was reclaimed.",
       *_src("requests_reclaimed")),
    _c("pages_reclaimed", "Optional / pending device pages returned to the pool by reclaim.",
       *_src("pages_reclaimed")),
    _c("pages_repopulated", "Optional-history pages copied back to device and published.",
       *_src("pages_repopulated")),
    _c("host_pages_written", "Pages written to the host backing store (backups).",
       *_src("host_pages_written")),
    _c("host_backups_deferred", "Imported pages kept on device without a host copy (backup "
                                "deferred until reclaim).", *_src("host_backups_deferred")),
    _c("admissions", "Requests admitted into the hierarchy."),
    _c("admissions_waited", "Admission attempts that had to wait for device memory (or a "
                            "request slot)."),
    # -- state (gauges, latest values) --
    _g("admitted_requests", "Requests admitted into the hierarchy (allocated request slots).",
       "totals", "admitted"),
    _g("eligible_history_rows", "Rows of complete imported-history pages that optional "
                                "residency may keep on device (coverage denominator).",
       *_src("eligible_history_rows")),
    _g("ready_optional_rows", "Optional-history rows ready (published) on device (coverage "
                              "numerator).", *_src("ready_optional_rows")),
    _g("optional_pages", "Optional-history device pages held (ready).", *_src("optional_pages")),
    _g("pending_pages", "Device pages being repopulated (copy in flight, not yet published).",
       *_src("pending_pages")),
    _g("required_pages", "Required device pages held (hot cache, tail).", *_src("required_pages")),
    _g("reserve_pages", "Admission reserve M_res (pages kept free for admissions).",
       *_src("reserve_pages")),
    _g("free_pages", "Free device pages of the hierarchy's pools.", *_src("free_pages")),
    _g("device_pages", "Device pages of the hierarchy's pools (M).", *_src("device_pages")),
    _g("host_bytes_used", "Host backing store bytes reserved by admitted requests.",
       *_src("host_bytes_used")),
    _g("host_bytes_total", "Host backing store capacity, bytes.", *_src("host_bytes_total")),
    _g("staging_bytes", "Peak staging-arena bytes handed to layers at once in the last step "
                        "(verification misses beyond the hot cache, rows of the step); "
                        "at most M_stage.", "staging", "staging_bytes"),
    _g("staging_arena_bytes", "Device bytes of the staging_arenas (chi arenas shared by the "
                              "sparse layers, allocated once).", "staging", "arena_bytes"),
    _c("arena_reuses", "Staging-arena takes by a layer after another layer of the same step "
                       "staged in that arena (layers reuse chi arenas).", "staging", "arena_reuses"),
    # -- speculative decoding (acceptance itself: vLLM's vllm:spec_decode_* counters) --
    _g("draft_ring_rows", "R_d (eq. 9): draft-KV rows a request holds at most in decode, "
                          "and in prefill without prefix caching; 0 without a DSpark / "
                          "DFlash2 drafter.", "spec", "draft_ring_rows"),
    _g("staging_bound_bytes", "M_stage (eq. 11): chi x N x K_max x k x d_KV; "
                              "0 without a DSpark / DFlash2 drafter.", "spec", "staging_bound_bytes"),
    _h("verify_queries", "K_r: queries of one admitted request in one decode step (anchor + "
                         "drafts; 1 without speculation).", (1, 2, 3, 4, 5, 6, 7, 8)),
    # -- prefill/decode handoff (kv_producer / kv_consumer; zero on kv_both) --
    _c("handoffs_sent", "P/D producer: captured handoffs pulled by a decode instance.",
       "handoff", "sent"),
    _c("handoffs_expired", "P/D producer: handoffs freed because no decode instance pulled "
                           "them within handoff_lease_s.", "handoff", "expired"),
    _c("handoff_bytes_sent", "P/D producer: bytes of the handoffs pulled.", "handoff", "bytes_sent"),
    _c("handoffs_received", "P/D consumer: handoffs loaded and admitted into the hierarchy.",
       "handoff", "received"),
    _c("handoffs_failed", "P/D consumer: loads that failed (kv_load_failure_policy applies).",
       "handoff", "failed"),
    _c("handoff_bytes_received", "P/D consumer: bytes of the handoffs loaded.",
       "handoff", "bytes_received"),
    _g("handoff_buffers_held", "P/D producer: captured handoffs waiting to be pulled.",
       "handoff", "held"),
    _h("handoff_seconds", "P/D consumer: one load, pull to blocks written (on the load thread).",
       (1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)),
    # -- prefix hits from host memory (host_prefix_gib; zero when off) --
    _c("host_prefix_hits", "Requests whose prompt began with a host prefix entry, loaded "
                           "instead of computed.", "host_prefix", "loads"),
    _c("host_prefix_hit_tokens", "Prompt tokens loaded from host prefix entries.",
       "host_prefix", "tokens_loaded"),
    _c("host_prefix_captures", "Host prefix entries captured from finished or preempted "
                               "requests.", "host_prefix", "captured"),
    _c("host_prefix_evictions", "Host prefix entries freed (least recently used first, "
                                "within host_prefix_gib).", "host_prefix", "evicted"),
    _c("host_prefix_failures", "Host prefix captures or loads that failed (the entry is "
                               "forgotten; a failed load applies kv_load_failure_policy).",
       "host_prefix", "failed"),
    _g("host_prefix_entries", "Host prefix entries held.", "host_prefix", "entries"),
    _g("host_prefix_bytes", "Host bytes of the prefix entries held.", "host_prefix",
       "bytes_held"),
    # -- resolver latency --
    _h("resolve_seconds", "Wall time of one KVHierarchy.resolve call (recorded with "
                          "resolve_timing on, or auto on CPU).",
       (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5,
        1.0)),
)
COUNTERS = tuple(m for m in METRICS if m.kind == "counter")
GAUGES = tuple(m for m in METRICS if m.kind == "gauge")
HISTOGRAMS = tuple(m for m in METRICS if m.kind == "histogram")


ROLE_SECTIONS = ("handoff", "spec", "host_prefix")  # summary sections only some engines have


def read(summary: dict, path: tuple[str, ...]) -> int | float:
    """The value at ``path`` of the worker's summary (worker_report.py); ``"*"`` sums over
    the entries of that level (the sources).  A role's section the engine does not have
    (no P/D role, no speculation) reads 0; any other missing key is a ``KeyError`` naming
    the path, never a silent 0."""
    if path and path[0] in ROLE_SECTIONS and path[0] not in summary:
        return 0
    node = summary
    for i, part in enumerate(path):
        if part == "*":
            return sum(read(v, path[i + 1:]) for v in node.values())
        if not isinstance(node, dict) or part not in node:
            raise KeyError(f"the worker's summary has no {'/'.join(path[:i + 1])!r} "
                           f"(metric path {'/'.join(path)!r})")
        node = node[part]
    return node


def exposed_names(m: MetricDef) -> tuple[str, ...]:
    """Sample names Prometheus scrapes for ``m`` (what a dashboard may query)."""
    if m.kind == "counter":
        return (m.name + "_total",)
    if m.kind == "histogram":
        return tuple(m.name + s for s in ("_bucket", "_sum", "_count"))
    return (m.name,)


# -- stats object (travels worker -> scheduler -> front-end) -------------------------------
@dataclass
class DHiSparseConnectorStats(KVConnectorStats):
    """``data = {"counters": {key: delta}, "gauges": {key: value}, HISTOGRAM_KEY: [sample, ...]}``
    (one sample list per histogram: ``resolve_seconds``, ``verify_queries``).

    Plain dicts / lists of numbers: serializable across vLLM's process boundaries.
    """

    def __post_init__(self):
        if not self.data:
            self.reset()

    def reset(self):
        self.data = {"counters": {}, "gauges": {}, **{m.key: [] for m in HISTOGRAMS}}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        if other.is_empty():
            return self
        assert isinstance(other, DHiSparseConnectorStats), type(other)
        counters = self.data["counters"]
        for k, v in other.data["counters"].items():
            counters[k] = counters.get(k, 0) + v
        self.data["gauges"].update(other.data["gauges"])  # latest value wins
        for m in HISTOGRAMS:
            self.data.setdefault(m.key, []).extend(other.data.get(m.key, []))
        return self

    def reduce(self) -> dict[str, int | float]:
        c, g = self.data["counters"], self.data["gauges"]
        out: dict[str, int | float] = {
            f"DHiSparse {k}": c.get(k, 0)
            for k in ("selected_rows", "selected_rows_host", "rows_fetched", "host_to_device_bytes")}
        if g.get("eligible_history_rows"):
            out["DHiSparse coverage %"] = round(
                100 * g.get("ready_optional_rows", 0) / g["eligible_history_rows"], 1)
        if c.get("selected_rows"):
            out["DHiSparse host-fetched share %"] = round(
                100 * c.get("selected_rows_host", 0) / c["selected_rows"], 2)
        return out

    def is_empty(self) -> bool:
        return not (self.data["counters"] or self.data["gauges"]
                    or any(self.data.get(m.key) for m in HISTOGRAMS))


# -- worker side: cumulative hierarchy counters -> per-interval deltas ------------------------
class MetricsSource(Protocol):
    """What the collector reads of the connector's worker half (worker_side.py)."""
    hierarchy: Any  # None until the KV caches are registered
    device: Any  # torch.device

    def summary(self) -> dict:
        """Totals summed over sources and per-source state (the paths of METRICS)."""

    def take_samples(self) -> dict[str, list]:
        """Each histogram's samples since the last call, at most MAX_TIME_SAMPLES each."""


class StatsCollector:
    """Turns the worker's cumulative counters into deltas since the previous ``collect``.

    Reading the resolver's device-side counters forces a host sync, so on CUDA
    collections are spaced by ``min_interval_s`` (``stats_interval_s``: default 1 s on
    CUDA, 0 on CPU); in between ``collect`` answers None and the deltas simply land in
    the next collection.  ``force``: collect now (the engine goes idle, and no step may
    come to carry them).
    """

    def __init__(self, min_interval_s: float | None = None):
        self._last: dict[str, int] = {}
        self._last_time = float("-inf")
        self.min_interval_s = min_interval_s

    @staticmethod
    def cumulative(summary: dict) -> tuple[dict[str, int], dict[str, int]]:
        """``(counters, gauges)`` now: every metric of the table read from the worker's
        summary (one place sums over sources)."""
        return ({m.key: read(summary, m.path) for m in COUNTERS},
                {m.key: read(summary, m.path) for m in GAUGES})

    def collect(self, worker: MetricsSource, force: bool = False
                ) -> DHiSparseConnectorStats | None:
        if worker.hierarchy is None:
            return None
        if self.min_interval_s is None:
            self.min_interval_s = 0.0 if worker.device.type == "cpu" else 1.0
        now = time.monotonic()
        if now - self._last_time < self.min_interval_s and not force:
            return None
        self._last_time = now
        counters, gauges = self.cumulative(worker.summary())
        deltas = {k: v - self._last.get(k, 0) for k, v in counters.items()}
        assert all(d >= 0 for d in deltas.values()), f"counters went backwards: {deltas}"
        self._last = counters
        samples = worker.take_samples()
        assert set(samples) == {m.key for m in HISTOGRAMS}, sorted(samples)
        return DHiSparseConnectorStats(data={
            "counters": {k: d for k, d in deltas.items() if d},
            "gauges": gauges,
            **samples,
        })


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


# -- front-end: Prometheus metrics ----------------------------------------------------------
class DHiSparsePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: "VllmConfig",
                 metric_types: dict[type[PromMetric], type[PromMetricT]],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters: dict[str, dict[int, Any]] = {}
        self.gauges: dict[str, dict[int, Any]] = {}
        self.histograms: dict[str, dict[int, Any]] = {}
        for m in COUNTERS:
            metric = self._counter_cls(name=m.name, documentation=m.doc, labelnames=labelnames)
            self.counters[m.key] = create_metric_per_engine(metric, per_engine_labelvalues)
        for m in GAUGES:
            metric = self._gauge_cls(name=m.name, documentation=m.doc, labelnames=labelnames,
                                     multiprocess_mode="mostrecent")
            self.gauges[m.key] = create_metric_per_engine(metric, per_engine_labelvalues)
        for m in HISTOGRAMS:
            metric = self._histogram_cls(name=m.name, documentation=m.doc, labelnames=labelnames,
                                         buckets=list(m.buckets))
            self.histograms[m.key] = create_metric_per_engine(metric, per_engine_labelvalues)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for key, value in transfer_stats_data.get("counters", {}).items():
            self.counters[key][engine_idx].inc(value)
        for key, value in transfer_stats_data.get("gauges", {}).items():
            self.gauges[key][engine_idx].set(value)
        for m in HISTOGRAMS:
            for value in transfer_stats_data.get(m.key, []):
                self.histograms[m.key][engine_idx].observe(value)


assert len({m.name for m in METRICS}) == len(METRICS), "duplicate metric names"
assert all(m.name.startswith("vllm:dhisparse_") for m in METRICS)
# Keep the unused imports meaningful: the default classes vLLM passes without Ray.
DEFAULT_METRIC_TYPES = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
