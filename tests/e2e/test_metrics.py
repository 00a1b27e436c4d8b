"""Residency metrics in vLLM's /metrics, and the Grafana dashboard against a real Prometheus.

One API server (connector on, ngram speculation so verification queries
happen, history on host so every resolver path is taken) and one Prometheus
scraping it every second are shared by the tests of this module.

First: the scraped counters are consistent (direct + hot + host =
selected rows, counted independently; bytes = distinct fetched rows x row
bytes) and equal the worker's own cumulative counters (no delta lost or
counted twice on the way through vLLM's stats path).
Second: every PromQL expression of every panel in grafana/dhisparse.json,
template variables substituted, returns series from Prometheus; promtool
accepts the shipped scrape config.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request

import pytest

from vllm_dhisparse.demo import free_port, server_args, stop_server, wait_healthy

from .conftest import REPO

pytestmark = pytest.mark.e2e

HIER = {"hot_cache_rows": 512, "optional_residency": False}
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}
# One prompt longer than the hot cache (2400 tokens = 600 compressed rows > B = 512) keeps
# host fetches going while ngram verification steps run (shared retrieval needs both);
# the others stay short: decode on this CPU is the slow part.
PROMPT_LENS = (2400, 900, 640)
MAX_TOKENS = (32, 16, 16)
ROW_BYTES = 584  # fp8_ds_mla row on CPU: 576 B data + 8 B scales (environment.md)
SCRAPE_S = 1
POLL_S = 0.1  # the plot command's own sampling (no Prometheus in between)
RATE_INTERVAL = "5s"  # what $__rate_interval becomes (>= 4 scrape intervals, like Grafana)
# DHISPARSE_DASHBOARD: check another dashboard file (e.g. a deliberately broken copy)
DASHBOARD = os.environ.get("DHISPARSE_DASHBOARD") or os.path.join(REPO, "grafana", "dhisparse.json")
SCRAPE_EXAMPLE = os.path.join(REPO, "grafana", "prometheus.yml")


# -- Prometheus ---------------------------------------------------------------------------
def ensure_prometheus() -> tuple[str, str]:
    """``(prometheus, promtool)`` paths; installs Debian's package when missing (CI is root)."""
    if not shutil.which("prometheus") or not shutil.which("promtool"):
        if os.environ.get("DHISPARSE_NO_PROMETHEUS_INSTALL"):
            pytest.skip("prometheus not on PATH and DHISPARSE_NO_PROMETHEUS_INSTALL is set")
        apt = ["apt-get", "install", "-y", "--no-install-recommends", "prometheus"]
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        if subprocess.run(apt, capture_output=True, env=env).returncode != 0:
            subprocess.run(["apt-get", "update"], capture_output=True, env=env)
            proc = subprocess.run(apt, capture_output=True, text=True, env=env)
            assert proc.returncode == 0, f"cannot install prometheus:\n{proc.stderr[-2000:]}"
    prom, tool = shutil.which("prometheus"), shutil.which("promtool")
    assert prom and tool, "prometheus installed but prometheus/promtool not on PATH"
    return prom, tool


def start_prometheus(prom: str, target: str, workdir) -> tuple[subprocess.Popen, str]:
    """Prometheus as a user starts it: examples/metrics.sh (config generated for ``target``)."""
    port = free_port()
    env = {**os.environ, "PROMETHEUS": prom, "TARGETS": target, "PROM_PORT": str(port),
           "SCRAPE_INTERVAL": f"{SCRAPE_S}s", "DATA_DIR": str(workdir / "prometheus")}
    log = open(workdir / "prometheus.log", "w")
    proc = subprocess.Popen(["bash", os.path.join(REPO, "examples", "metrics.sh")], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        assert proc.poll() is None, (workdir / "prometheus.log").read_text()[-3000:]
        try:
            with urllib.request.urlopen(url + "/-/ready", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError("prometheus not ready after 60 s")


def prom_api(url: str, path: str, **params) -> dict:
    q = urllib.parse.urlencode(params)
    with urllib.request.urlopen(f"{url}/api/v1/{path}?{q}", timeout=30) as r:
        body = json.load(r)
    assert body["status"] == "success", body
    return body["data"]


# -- vLLM ---------------------------------------------------------------------------------
def _prompt(n: int, seed: int) -> list[int]:
    from harness.offline_run import prompt_ids
    motif = prompt_ids(n, seed)[:24]  # a repeated motif: ngram drafts get proposed
    return (motif * (n // len(motif) + 1))[:n]


def _complete(url: str, model: str, ids: list[int], out: list, i: int) -> None:
    body = json.dumps({"model": model, "prompt": ids, "max_tokens": MAX_TOKENS[i],
                       "temperature": 0.0}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        out[i] = json.load(r)


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets (engines, models)."""
    from prometheus_client.parser import text_string_to_metric_families
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:dhisparse_"):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


@pytest.fixture(scope="module")
def served(demo_model, tmp_path_factory):
    prom_bin, _ = ensure_prometheus()
    tmp = tmp_path_factory.mktemp("metrics")
    stats = tmp / "stats.json"
    port = free_port()
    # started as a user starts it: examples/serve.sh (vllm-dhisparse serve + the connector)
    cmd = ["bash", os.path.join(REPO, "examples", "serve.sh"), *server_args(8192),
           "--speculative-config", json.dumps(SPEC)]
    env = {**os.environ, "MODEL": demo_model, "PORT": str(port),
           "KV_EXTRA": json.dumps({**HIER, "stats_file": str(stats)}),
           "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""),
           "VLLM_USE_V2_MODEL_RUNNER": "0"}  # ngram needs the V1 runner on CPU
    log = open(tmp / "server.log", "w")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env,
                              start_new_session=True)
    prom = None
    stop = threading.Event()
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        wait_healthy(url, server, 600)
        prom, prom_url = start_prometheus(prom_bin, f"127.0.0.1:{port}", tmp)
        t_start = time.time()
        from vllm_dhisparse.tools import plot_residency
        polled: list = []
        # Sampled often: requests stay admitted for a few seconds only on this CPU.
        poller = threading.Thread(target=lambda: polled.extend(plot_residency.poll(
            url + "/metrics", 1800, POLL_S, stop=stop)), daemon=True)
        poller.start()
        time.sleep(2 * SCRAPE_S)  # a sample before traffic: rates start from a known value
        answers: list = [None] * len(PROMPT_LENS)
        threads = [threading.Thread(target=_complete, args=(url, demo_model, _prompt(n, i), answers, i))
                   for i, n in enumerate(PROMPT_LENS)]
        for t in threads:
            t.start()
            time.sleep(1.0)  # staggered: admissions while others decode
        for t in threads:
            t.join()
        assert all(a is not None for a in answers), "a completion request failed"
        time.sleep(4 * SCRAPE_S)  # let Prometheus see the final values
        stop.set()
        poller.join()
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
        print(f"[metrics] healthy after {t_start - t0:.0f} s, requests took "
              f"{time.time() - t_start:.0f} s")
        yield dict(url=url, model=demo_model, instance=f"127.0.0.1:{port}", prom_url=prom_url,
                   metrics=text, stats=json.loads(stats.read_text()), t_start=t_start,
                   t_end=time.time(), n_requests=len(PROMPT_LENS), series=polled, tmp=tmp)
    except Exception:
        log.flush()
        print((tmp / "server.log").read_text()[-6000:], file=sys.stderr)
        raise
    finally:
        stop.set()
        if prom is not None:
            prom.terminate()
            try:
                prom.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom.kill()
        stop_server(server)


# -- counters ---------------------------------------------------------------------------
def test_scraped_counters_are_consistent(served):
    m = parse_metrics(served["metrics"])
    c = {k[len("vllm:dhisparse_"):-len("_total")]: v for k, v in m.items() if k.endswith("_total")}
    sel, direct, hot, host = (c["selected_rows"], c["selected_rows_direct"],
                              c["selected_rows_hot"], c["selected_rows_host"])
    assert sel > 0 and direct > 0 and hot > 0 and host > 0, c  # every path was taken
    assert direct + hot + host == sel, c
    assert c["rows_fetched"] > 0 and c["host_to_device_bytes"] == c["rows_fetched"] * ROW_BYTES, c
    # shared retrieval: verification queries selected fetched rows more than once
    assert c["verify_rows_fetched"] > 0, c
    assert c["verify_host_selections"] > c["verify_rows_fetched"], c
    assert c["verify_host_selections"] <= host and c["verify_rows_fetched"] <= c["rows_fetched"], c
    assert c["admissions"] >= served["n_requests"], c
    assert c["resolve_calls"] > 0
    assert m["vllm:dhisparse_resolve_seconds_count"] == c["resolve_calls"], m  # timed on CPU
    assert m["vllm:dhisparse_resolve_seconds_sum"] > 0
    # K_r: one sample per admitted request and decode step; verification steps have 1 + 3
    k_r = m["vllm:dhisparse_verify_queries_sum"] / m["vllm:dhisparse_verify_queries_count"]
    assert 1 < k_r <= 4, m
    assert m["vllm:dhisparse_draft_ring_rows"] == 0, m  # ngram: no drafter KV
    assert m["vllm:dhisparse_host_bytes_total"] > 0 and m["vllm:dhisparse_device_pages"] > 0, m
    # The Prometheus totals are the sums of per-step deltas; they must equal the
    # worker's cumulative counters (stats_file, written in the same step).
    t = served["stats"]["totals"]
    assert (c["selected_rows_direct"], c["selected_rows_hot"], c["selected_rows_host"],
            c["rows_fetched"], c["host_to_device_bytes"], c["verify_host_selections"],
            c["verify_rows_fetched"], c["resolve_calls"], c["admissions"]) == \
        (t["direct"], t["hot"], t["host"], t["fetched"], t["bytes_fetched"],
         t["verify_host_selections"], t["verify_fetched"], t["resolve_calls"], t["admissions"]), \
        (c, t)


# -- dashboard ---------------------------------------------------------------------------
def dashboard_queries(path: str = DASHBOARD) -> list[tuple[str, str]]:
    """``(panel title / refId, expr)`` of every target of every panel (rows included)."""
    with open(path) as f:
        dash = json.load(f)
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                out.append((f"{p.get('title')} / {t.get('refId')}", t["expr"]))
            walk(p.get("panels", []))
    walk(dash["panels"])
    return out


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name in sorted(variables, key=len, reverse=True):  # $__rate_interval before $instance
        expr = expr.replace("${" + name + "}", variables[name]).replace("$" + name, variables[name])
    assert "$" not in expr, f"unsubstituted template variable in {expr!r}"
    return expr


def test_every_dashboard_query_returns_series(served):
    variables = {"model_name": served["model"], "instance": served["instance"],
                 "__rate_interval": RATE_INTERVAL}
    queries = dashboard_queries()
    assert len(queries) >= 10

    def series(expr):
        return prom_api(served["prom_url"], "query_range", query=substitute(expr, variables),
                        start=f"{served['t_start']:.3f}", end=f"{served['t_end']:.3f}",
                        step=str(SCRAPE_S))["result"]
    # controls: the filters match what was scraped, and a misspelled name yields nothing
    assert series('vllm:num_requests_running{model_name=~"$model_name", instance=~"$instance"}')
    assert not series('vllm:dhisparse_no_such_metric{instance=~"$instance"}')
    empty = [(where, expr) for where, expr in queries if not series(expr)]
    assert not empty, "dashboard queries without series:\n" + "\n".join(
        f"  {w}: {e}" for w, e in empty)


def test_promtool_accepts_shipped_scrape_config():
    _, promtool = ensure_prometheus()
    proc = subprocess.run([promtool, "check", "config", SCRAPE_EXAMPLE], capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# -- the plot command on a live scrape -------------------------------------------------------
def test_plot_from_live_scrape(served):
    from vllm_dhisparse.tools import plot_residency
    series = served["series"]
    assert len(series) >= 5, series
    admitted = [(r["t"], r["admitted_requests"]) for r in series]
    assert max(a for _, a in admitted) >= 1, admitted
    assert max(r["eligible_history_rows"] for r in series) > 0, series
    assert series[-1]["selected_rows"] > series[0]["selected_rows"], series
    saved = served["tmp"] / "series.json"
    plot_residency.save_series(series, str(saved))
    out = served["tmp"] / "fig6.png"
    assert plot_residency.main(["--series", str(saved), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("DHISPARSE_ARTIFACTS"):  # keep the figure (CI artifacts)
        shutil.copy(out, os.path.join(os.environ["DHISPARSE_ARTIFACTS"], "fig6_live.png"))


# -- abort: released without any further request ----------------------------------------------
def test_abort_mid_decode_releases_at_once(served):
    """A streaming client that goes away mid-decode aborts its request; the hierarchy
    releases its pages and slot on the engine's own next step, with no other request in
    flight, and the engine serves the next request."""
    from vllm_dhisparse.tools.plot_residency import parse_exposition
    url, model = served["url"], served["model"]
    body = json.dumps({"model": model, "prompt": _prompt(2400, 7), "max_tokens": 400,
                       "temperature": 0.0, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})

    def admitted() -> float:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            return parse_exposition(r.read().decode())["admitted_requests"]
    r = urllib.request.urlopen(req, timeout=600)
    chunks = 0
    while chunks < 3:  # three tokens streamed: the request is admitted and decoding
        if r.readline().startswith(b"data: {"):
            chunks += 1
    deadline = time.time() + 30
    while admitted() < 1 and time.time() < deadline:
        time.sleep(0.1)
    assert admitted() >= 1
    r.close()  # the client leaves: vLLM aborts the request
    deadline = time.time() + 30
    while admitted() > 0 and time.time() < deadline:
        time.sleep(0.2)
    assert admitted() == 0
    stats = json.loads((served["tmp"] / "stats.json").read_text())["totals"]
    assert stats["admitted"] == 0 and stats["failed"] == 0, stats
    out: list = [None]
    _complete(url, model, _prompt(640, 8), out, 0)
    assert out[0]["choices"][0]["finish_reason"] == "length"
