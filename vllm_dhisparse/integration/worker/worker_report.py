"""The worker half's report: its totals and the hierarchy's per-source state as one dict
(what ``stats_file`` holds and the metrics of stats.py read, by the paths of its table),
and the histogram samples collected since the last collection."""
from __future__ import annotations

from typing import Any

from ..metrics.stats import MAX_TIME_SAMPLES


class WorkerReport:
    """Mixed into the connector's worker half (worker_side.py), whose state it reads."""
    hierarchy: Any  # KVHierarchy
    served: Any  # ServedCounters of the routed layers
    failures: Any  # Failures, or None before the KV caches are registered
    handoff: Any  # the P/D worker half, or None
    verify_queries: list
    device_pool_bytes: int
    prompt_tokens_computed: int
    spec_sizes: dict | None

    def summary(self) -> dict:
        """The worker's totals, summed over sources, and the hierarchy's per-source state:
        what ``stats_file`` holds and what the metrics read.  ``selected`` is counted by the
        routed layers apart from the resolver's census (``direct + hot + host``, this
        step's rows counting as direct: they are tail rows); the two must agree."""
        st = self.hierarchy.stats()
        served = self.served
        tot = dict(selected=served.selected_rows, direct=served.fresh_selections, hot=0, host=0,
                   fetched=0, bytes_fetched=0, verify_host_selections=0, verify_fetched=0,
                   resolve_calls=0, state_repairs=0)
        for src in st["sources"].values():
            r = src["resolver"]
            for key in ("direct", "hot", "host", "fetched", "bytes_fetched",
                        "verify_host_selections", "verify_fetched", "state_repairs"):
                tot[key] += r[key]
            tot["resolve_calls"] += r["calls"]
        tot.update(admissions=st["admissions"], admissions_waited=st["admissions_waited"],
                   finished=st["finished"], preempted=st["preempted"],
                   failed=self.failures.total if self.failures is not None else 0,
                   step=st["step"], admitted=st["admitted"],
                   device_pool_bytes=self.device_pool_bytes,
                   host_pool_bytes=sum(s["host_bytes_total"] for s in st["sources"].values()))
        tot["prompt_tokens_computed"] = self.prompt_tokens_computed
        out = dict(totals=tot, sources=st["sources"], staging=st["staging"])
        if self.handoff is not None:
            out["handoff"] = self.handoff.summary()
        if getattr(self, "host_prefix", None) is not None:
            out["host_prefix"] = self.host_prefix.summary()
        if self.spec_sizes is not None:
            out["spec"] = self.spec_sizes
        return out

    def take_samples(self) -> dict[str, list]:
        """Each histogram's samples since the last call (the worker's lists are drained)."""
        pd = getattr(self, "handoff", None)
        lists = {"resolve_seconds": self.served.resolve_times,
                 "verify_queries": self.verify_queries,
                 "handoff_seconds": pd.counters.seconds if pd is not None else []}
        out = {k: v[-MAX_TIME_SAMPLES:] for k, v in lists.items()}
        for v in lists.values():
            v.clear()
        return out
