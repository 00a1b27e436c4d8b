"""No vLLM run: dashboard names and the code's metrics agree.

* every ``vllm:dhisparse_*`` sample name the dashboard queries is one the code exposes;
* every metric the code defines is queried by a panel, or listed in
  grafana/README.md as deliberately unpanelled;
* the Prometheus metric objects are created only through the classes vLLM
  hands over, exactly the table's names, and ``observe`` routes deltas /
  gauges / samples to them; stats objects aggregate as vLLM expects.
"""
from __future__ import annotations

import json
import os
import re

import pytest

pytest.importorskip("vllm", reason="the metric classes subclass vLLM's KVConnectorStats")

from vllm_dhisparse.integration.metrics import stats as S  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(REPO, "grafana", "dhisparse.json")
README = os.path.join(REPO, "grafana", "README.md")
NAME = re.compile(r"vllm:[A-Za-z0-9_:]*hisparse[A-Za-z0-9_:]*")


def dashboard_exprs() -> list[str]:
    with open(DASHBOARD) as f:
        dash = json.load(f)
    exprs = []

    def walk(panels):
        for p in panels:
            exprs.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))
    walk(dash["panels"])
    for v in dash["templating"]["list"]:
        if v.get("type") == "query":
            exprs.append(v["query"])
    return exprs


def exposed() -> dict[str, S.MetricDef]:
    return {n: m for m in S.METRICS for n in S.exposed_names(m)}


def unpanelled() -> set[str]:
    """Names listed under the README's 'Deliberately unpanelled' heading."""
    text = open(README).read()
    section = text.split("## Deliberately unpanelled", 1)
    assert len(section) == 2, "grafana/README.md lost its '## Deliberately unpanelled' section"
    body = section[1].split("\n## ", 1)[0]
    return set(re.findall(r"`(vllm:dhisparse_[a-z0-9_]+)`", body))


def test_dashboard_names_exist_in_code():
    known = exposed()
    used = {n for e in dashboard_exprs() for n in NAME.findall(e)}
    assert used, "dashboard queries no vllm:dhisparse_* metric"
    bad = sorted(n for n in used if n not in known)
    assert not bad, (f"dashboard uses names the code does not expose: {bad}\n"
                     f"exposed: {sorted(known)}")


def test_every_code_metric_is_panelled_or_listed():
    panelled = {m.name for e in dashboard_exprs() for n in NAME.findall(e)
                if (m := exposed().get(n)) is not None}
    listed = unpanelled()
    defined = {m.name for m in S.METRICS}
    assert not (listed - defined), f"README lists unknown metrics: {sorted(listed - defined)}"
    missing = sorted(defined - panelled - listed)
    assert not missing, (f"metrics neither in a panel nor listed as deliberately unpanelled in "
                         f"grafana/README.md: {missing}")


def test_names_are_ours():
    for m in S.METRICS:
        assert m.name.startswith("vllm:dhisparse_"), m.name  # upstream owns vllm:hisparse_*
    for e in dashboard_exprs():
        for n in NAME.findall(e):
            assert n.startswith("vllm:dhisparse_"), f"{n} in {e}"


# -- the classes vLLM hands over ------------------------------------------------------------
class _Child:
    def __init__(self, parent, labels):
        self.parent, self.labels_ = parent, labels

    def inc(self, v=1):
        self.parent.values[self.labels_] = self.parent.values.get(self.labels_, 0) + v

    def set(self, v):
        self.parent.values[self.labels_] = v

    def observe(self, v):
        self.parent.values.setdefault(self.labels_, []).append(v)


def _fake(kind, created):
    class Fake:
        def __init__(self, name, documentation, labelnames, **kw):
            self.name, self.kind, self.labelnames, self.kw = name, kind, labelnames, kw
            self.values = {}
            created.append(self)

        def labels(self, *values):
            assert len(values) == len(self.labelnames)
            return _Child(self, tuple(values))
    return Fake


class _Cfg:
    kv_transfer_config = None


def _prom(created):
    from prometheus_client import Counter, Gauge, Histogram
    types = {Gauge: _fake("gauge", created), Counter: _fake("counter", created),
             Histogram: _fake("histogram", created)}
    return S.DHiSparsePromMetrics(_Cfg(), types, ["model_name", "engine"],
                                  {0: ["m", "0"], 1: ["m", "1"]})


def test_prom_metrics_created_through_given_classes():
    created = []
    _prom(created)
    assert sorted((c.name, c.kind) for c in created) == sorted((m.name, m.kind) for m in S.METRICS)
    for c in created:
        assert c.labelnames == ["model_name", "engine"]
        if c.kind == "gauge":
            assert c.kw.get("multiprocess_mode") == "mostrecent"


def test_observe_routes_counters_gauges_histogram():
    created = []
    prom = _prom(created)
    by = {c.name: c for c in created}
    a = S.DHiSparseConnectorStats(data={"counters": {"selected_rows": 5, "selected_rows_host": 2},
                                        "gauges": {"admitted_requests": 3},
                                        "resolve_seconds": [0.001]})
    b = S.DHiSparseConnectorStats(data={"counters": {"selected_rows": 4},
                                        "gauges": {"admitted_requests": 1},
                                        "resolve_seconds": [0.002, 0.003]})
    agg = S.DHiSparseConnectorStats().aggregate(a).aggregate(b)
    assert agg.data["counters"] == {"selected_rows": 9, "selected_rows_host": 2}
    assert agg.data["gauges"] == {"admitted_requests": 1}  # latest value
    assert agg.data["resolve_seconds"] == [0.001, 0.002, 0.003]
    assert agg.reduce()["DHiSparse host-fetched share %"] == round(100 * 2 / 9, 2)
    prom.observe(json.loads(json.dumps(agg.to_dict())), engine_idx=1)  # survives serialization
    prom.observe(a.to_dict(), engine_idx=1)
    assert by["vllm:dhisparse_selected_rows"].values == {("m", "1"): 14}
    assert by["vllm:dhisparse_admitted_requests"].values == {("m", "1"): 3}
    assert by["vllm:dhisparse_resolve_seconds"].values == {("m", "1"): [0.001, 0.002, 0.003, 0.001]}
    assert S.DHiSparseConnectorStats().is_empty() and not agg.is_empty()
    agg.reset()
    assert agg.is_empty()


def test_collector_reports_deltas(monkeypatch):
    """Cumulative worker counters -> per-collection deltas; gauges are latest values."""
    col = S.StatsCollector(min_interval_s=0)
    state = {"c": {m.key: 0 for m in S.COUNTERS}, "g": {m.key: 0 for m in S.GAUGES}}
    monkeypatch.setattr(S.StatsCollector, "cumulative",
                        staticmethod(lambda summary: (dict(state["c"]), dict(state["g"]))))

    class W:
        hierarchy = object()
        samples = [{"resolve_seconds": [0.5], "verify_queries": [4, 1], "handoff_seconds": []}]

        def summary(self):
            return {}

        def take_samples(self):
            return self.samples.pop() if self.samples else \
                {"resolve_seconds": [], "verify_queries": [], "handoff_seconds": []}
    state["c"]["selected_rows"], state["g"]["free_pages"] = 10, 7
    first = col.collect(W())
    state["c"]["selected_rows"], state["g"]["free_pages"] = 25, 3
    second = col.collect(W())
    third = col.collect(W())
    assert first.data["counters"] == {"selected_rows": 10} and first.data["resolve_seconds"] == [0.5]
    assert first.data["verify_queries"] == [4, 1] and second.data["verify_queries"] == []
    assert second.data["counters"] == {"selected_rows": 15} and second.data["resolve_seconds"] == []
    assert second.data["gauges"]["free_pages"] == 3
    assert third.data["counters"] == {}


def test_a_metric_path_the_summary_lacks_is_an_error_unless_it_is_a_role_section():
    summary = {"totals": {"selected": 3}, "sources": {"a": {"free_pages": 2},
                                                      "b": {"free_pages": 5}}}
    assert S.read(summary, ("totals", "selected")) == 3
    assert S.read(summary, ("sources", "*", "free_pages")) == 7
    assert S.read(summary, ("handoff", "received")) == 0  # no P/D role in this engine
    for typo in (("totals", "selectd"), ("sources", "*", "free_page"), ("stagng", "x")):
        with pytest.raises(KeyError, match=typo[-1] if typo[-1] != "x" else typo[0]):
            S.read(summary, typo)
