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

Resolver call time: ``time.perf_counter`` around ``KVHierarchy.resolve`` in
``WorkerSide.resolve_tokens``.  On CUDA that would time kernel launches, not
work, unless synchronized; it is recorded only on CPU devices or when
``DHISPARSE_TIME_RESOLVE=1`` is set (which adds a ``torch.cuda.synchronize``).
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge, Histogram
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                  KVConnectorStats, PromMetric,
                                                                  PromMetricT)
from vllm.v1.metrics.utils import create_metric_per_engine

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from .worker_side import WorkerSide

TIME_RESOLVE_ENV = "DHISPARSE_TIME_RESOLVE"
INTERVAL_ENV = "DHISPARSE_STATS_INTERVAL_S"
MAX_TIME_SAMPLES = 4096  # per collection; the worker is drained every step


@dataclass(frozen=True)
class MetricDef:
    key: str  # key in the stats payload
    name: str  # Prometheus name (counters are exposed with a ``_total`` suffix)
    kind: str  # "counter" | "gauge" | "histogram"
    doc: str
    buckets: tuple[float, ...] = ()  # histograms only


def _c(key, doc):
    return MetricDef(key, f"vllm:dhisparse_{key}", "counter", doc)


def _g(key, doc):
    return MetricDef(key, f"vllm:dhisparse_{key}", "gauge", doc)


METRICS: tuple[MetricDef, ...] = (
    # -- resolver census (counters, deltas per interval) --
    _c("selected_rows", "Top-k row selections read through the hierarchy (all paths; "
                        "= direct + hot + host)."),
    _c("selected_rows_direct", "Selections resolved directly on device: tail rows, rows of this "
                               "step, optional history pages."),
    _c("selected_rows_hot", "Selections resolved through the per-request hot cache."),
    _c("selected_rows_host", "Selections whose row was fetched from host memory."),
    _c("rows_fetched", "Distinct rows copied host->device (a row selected by several verify "
                       "queries of one step is fetched once)."),
    _c("host_to_device_bytes", "Bytes copied host->device by the resolver (= rows_fetched x row "
                               "bytes)."),
    _c("verify_host_selections", "Host-path selections in multi-query (verification) resolves."),
    _c("verify_rows_fetched", "Distinct rows fetched in multi-query (verification) resolves; "
                              "verify_host_selections / verify_rows_fetched = shared retrieval."),
    _c("resolve_calls", "Resolver calls (one per sparse layer per step with admitted requests)."),
    _c("state_repairs", "Out-of-range resolver table entries degraded to empty (rows re-fetched "
                        "from host); 0 unless a table was corrupted."),
    # -- residency events (counters) --
    _c("reclaim_events", "Admissions that reclaimed the optional history of at least one "
                         "request (eq. 4)."),
    _c("requests_reclaimed", "Requests whose optional history was reclaimed."),
    _c("pages_reclaimed", "Optional / pending device pages returned to the pool by reclaim."),
    _c("pages_repopulated", "Optional-history pages copied back to device and published."),
    _c("host_pages_written", "Pages written to the host backing store (backups)."),
    _c("host_backups_deferred", "Imported pages kept on device without a host copy (backup "
                                "deferred until reclaim)."),
    _c("admissions", "Requests admitted into the hierarchy."),
    _c("admissions_waited", "Admission attempts that had to wait for device memory (or a slot)."),
    # -- state (gauges, latest values) --
    _g("admitted_requests", "Requests admitted into the hierarchy (allocated request slots)."),
    _g("eligible_history_rows", "Rows of complete imported-history pages that optional "
                                "residency may keep on device (coverage denominator)."),
    _g("ready_optional_rows", "Optional-history rows ready (published) on device (coverage "
                              "numerator)."),
    _g("optional_pages", "Optional-history device pages held (ready)."),
    _g("pending_pages", "Device pages being repopulated (copy in flight, not yet published)."),
    _g("required_pages", "Required device pages held (hot cache, tail)."),
    _g("reserve_pages", "Admission reserve M_res (pages kept free for admissions)."),
    _g("free_pages", "Free device pages of the hierarchy's pools."),
    _g("device_pages", "Device pages of the hierarchy's pools (M)."),
    _g("host_bytes_used", "Host backing store bytes reserved by admitted requests."),
    _g("host_bytes_total", "Host backing store capacity, bytes."),
    _g("staging_bytes", "Peak staging-arena bytes handed to layers at once in the last step "
                        "(verification misses beyond the hot cache, rows of the step); "
                        "at most M_stage."),
    _g("staging_arena_bytes", "Device bytes of the staging_arenas (chi arenas shared by the "
                              "sparse layers, allocated once)."),
    _c("arena_reuses", "Staging-arena takes by a layer after another layer of the same step "
                       "staged in that arena (layers reuse chi arenas)."),
    # -- speculative decoding (acceptance itself: vLLM's vllm:spec_decode_* counters) --
    _g("draft_ring_rows", "R_d (eq. 9): draft-KV rows a request holds at most in decode, "
                          "and in prefill without prefix caching; 0 without a DSpark / "
                          "DFlash2 drafter."),
    _g("staging_bound_bytes", "M_stage (eq. 11): chi x N x K_max x k x d_KV; "
                              "0 without a DSpark / DFlash2 drafter."),
    MetricDef("verify_queries", "vllm:dhisparse_verify_queries", "histogram",
              "K_r: queries of one admitted request in one decode step (anchor + drafts; 1 "
              "without speculation).", buckets=(1, 2, 3, 4, 5, 6, 7, 8)),
    # -- prefill/decode handoff (kv_producer / kv_consumer; zero on kv_both) --
    _c("handoffs_sent", "P/D producer: captured handoffs pulled by a decode instance."),
    _c("handoffs_expired", "P/D producer: handoffs freed because no decode instance pulled "
                           "them within handoff_lease_s."),
    _c("handoff_bytes_sent", "P/D producer: bytes of the handoffs pulled."),
    _c("handoffs_received", "P/D consumer: handoffs loaded and admitted into the hierarchy."),
    _c("handoffs_failed", "P/D consumer: loads that failed (kv_load_failure_policy applies)."),
    _c("handoff_bytes_received", "P/D consumer: bytes of the handoffs loaded."),
    _g("handoff_buffers_held", "P/D producer: captured handoffs waiting to be pulled."),
    MetricDef("handoff_seconds", "vllm:dhisparse_handoff_seconds", "histogram",
              "P/D consumer: one load, pull to blocks written (on the load thread).",
              buckets=(1e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)),
    # -- resolver latency --
    MetricDef("resolve_seconds", "vllm:dhisparse_resolve_seconds", "histogram",
              "Wall time of one KVHierarchy.resolve call (recorded on CPU, or with "
              f"{TIME_RESOLVE_ENV}=1).", buckets=(1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3,
                                                  5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)),
)
# counter key -> key of ``WorkerSide.summary()["totals"]`` it reports
SUMMARY_TOTALS = {
    "selected_rows_direct": "direct", "selected_rows_hot": "hot", "selected_rows_host": "host",
    "rows_fetched": "fetched", "host_to_device_bytes": "bytes_fetched",
    "verify_host_selections": "verify_host_selections", "verify_rows_fetched": "verify_fetched",
    "resolve_calls": "resolve_calls", "state_repairs": "state_repairs", "admissions": "admissions",
    "admissions_waited": "admissions_waited",
}
# counter key -> key of ``WorkerSide.summary()["handoff"]``
HANDOFF_TOTALS = {
    "handoffs_sent": "sent", "handoffs_expired": "expired", "handoff_bytes_sent": "bytes_sent",
    "handoffs_received": "received", "handoffs_failed": "failed",
    "handoff_bytes_received": "bytes_received",
}
COUNTERS = tuple(m for m in METRICS if m.kind == "counter")
GAUGES = tuple(m for m in METRICS if m.kind == "gauge")
HISTOGRAMS = tuple(m for m in METRICS if m.kind == "histogram")


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
class StatsCollector:
    """Turns the worker's cumulative counters into deltas since the previous ``collect``.

    Reading the resolver's device-side counters forces a host sync, so on CUDA
    collections are spaced by ``min_interval_s`` (default 1 s; env
    ``DHISPARSE_STATS_INTERVAL_S``); in between ``collect`` answers None and the
    deltas simply land in the next collection.  On CPU every step collects.
    """

    def __init__(self, min_interval_s: float | None = None):
        self._last: dict[str, int] = {}
        self._last_time = float("-inf")
        self.min_interval_s = min_interval_s

    @staticmethod
    def cumulative(worker: "WorkerSide") -> tuple[dict[str, int], dict[str, int]]:
        """``(counters, gauges)`` now, summed over sources.  Resolver and admission
        counters are ``WorkerSide.summary()``'s totals (one place sums them)."""
        h = worker.hierarchy
        summary = worker.summary()
        totals = summary["totals"]
        counters = dict.fromkeys((m.key for m in COUNTERS), 0)
        gauges = dict.fromkeys((m.key for m in GAUGES), 0)
        counters["selected_rows"] = worker.selected_rows
        for key, total in SUMMARY_TOTALS.items():
            counters[key] = totals[total]
        for name, src in summary["sources"].items():
            for key in ("reclaim_events", "requests_reclaimed", "pages_reclaimed",
                        "pages_repopulated", "host_pages_written", "host_backups_deferred"):
                counters[key] += src[key]
            gauges["eligible_history_rows"] += src["eligible_history_rows"]
            gauges["ready_optional_rows"] += src["ready_optional_rows"]
            gauges["optional_pages"] += src["optional_pages"]
            gauges["pending_pages"] += src["pending_pages"]
            gauges["required_pages"] += src["required_pages"]
            gauges["reserve_pages"] += src["reserve_pages"]
            gauges["free_pages"] += src["free_pages"]
            gauges["device_pages"] += src["device_pages"]
            gauges["host_bytes_used"] += src["host_bytes_used"]
            gauges["host_bytes_total"] += src["host_bytes_total"]
        staging = summary["staging"]
        gauges["staging_bytes"] = staging["staging_bytes"]
        gauges["staging_arena_bytes"] = staging["arena_bytes"]
        counters["arena_reuses"] = staging["arena_reuses"]
        gauges["admitted_requests"] = len(h.requests)
        pd = getattr(worker, "handoff", None)  # kv_producer / kv_consumer only
        handoff = pd.summary() if pd is not None else {}
        for key, total in HANDOFF_TOTALS.items():
            counters[key] = handoff.get(total, 0)
        gauges["handoff_buffers_held"] = handoff.get("held", 0)
        spec = worker.spec_sizes or {}
        gauges["draft_ring_rows"] = spec.get("draft_ring_rows", 0)
        gauges["staging_bound_bytes"] = spec.get("staging_bound_bytes", 0)
        return counters, gauges

    def collect(self, worker: "WorkerSide") -> DHiSparseConnectorStats | None:
        if worker.hierarchy is None:
            return None
        if self.min_interval_s is None:
            default = "0" if worker.device.type == "cpu" else "1"
            self.min_interval_s = float(os.environ.get(INTERVAL_ENV, default))
        now = time.monotonic()
        if now - self._last_time < self.min_interval_s:
            return None
        self._last_time = now
        counters, gauges = self.cumulative(worker)
        deltas = {k: v - self._last.get(k, 0) for k, v in counters.items()}
        assert all(d >= 0 for d in deltas.values()), f"counters went backwards: {deltas}"
        self._last = counters
        pd = getattr(worker, "handoff", None)
        loads = pd.counters.seconds if pd is not None else []
        samples = {"resolve_seconds": worker.resolve_times[-MAX_TIME_SAMPLES:],
                   "verify_queries": worker.verify_queries[-MAX_TIME_SAMPLES:],
                   "handoff_seconds": loads[-MAX_TIME_SAMPLES:]}
        worker.resolve_times.clear()
        worker.verify_queries.clear()
        loads.clear()
        return DHiSparseConnectorStats(data={
            "counters": {k: d for k, d in deltas.items() if d},
            "gauges": gauges,
            **samples,
        })


def summarize(worker: "WorkerSide") -> dict:
    """The worker's totals, summed over sources (this step's rows count as direct: they
    are tail rows), and the hierarchy's per-source state: what ``stats_file`` holds and
    what the Prometheus counters are deltas of."""
    st = worker.hierarchy.stats()
    tot = dict(selected=0, direct=worker.fresh_selections, hot=0, host=0, fetched=0,
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
               finished=st["finished"], preempted=st["preempted"], failed=worker.failed_total,
               step=st["step"], admitted=st["admitted"],
               device_pool_bytes=worker.device_pool_bytes,
               host_pool_bytes=sum(s["host_bytes_total"] for s in st["sources"].values()))
    tot["prompt_tokens_computed"] = worker.prompt_tokens_computed
    out = dict(totals=tot, sources=st["sources"], staging=st["staging"])
    if worker.handoff is not None:
        out["handoff"] = worker.handoff.summary()
    if worker.spec_sizes is not None:
        out["spec"] = worker.spec_sizes
    return out


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


def time_resolve_enabled(device_type: str) -> bool:
    flag = os.environ.get(TIME_RESOLVE_ENV)
    if flag is not None:
        return flag not in ("", "0", "false", "False")
    return device_type == "cpu"


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
