"""Residency over time as the paper's Figure 6: allocated request slots, coverage %, host-fetched share %.

    # poll a live server's /metrics every second for 5 minutes, save the series and the plot
    python -m vllm_dhisparse.tools.plot_residency --url http://127.0.0.1:8000/metrics \\
        --duration 300 --interval 1 --save-series run.json --out fig6.png
    # plot a saved series (JSON from --save-series, or CSV with the same columns)
    python -m vllm_dhisparse.tools.plot_residency --series run.json --out fig6.png

A series is a list of samples, each ``{"t": seconds, <column>: value, ...}`` with
the columns in ``COLUMNS`` (gauges as scraped, counters cumulative).  Coverage
is ready / eligible optional-history rows at each sample; the host-fetched
share is Δhost / Δselected rows between consecutive samples (over
``--window`` samples), i.e. the share of *all* selected rows served from host.
Needs matplotlib (``pip install -e .[plot]``).
"""
from __future__ import annotations

import argparse
import csv
import json
import sys
import time
import urllib.request

# column -> sample name in /metrics (summed over label sets)
COLUMNS = {
    "admitted_requests": "vllm:dhisparse_admitted_requests",
    "ready_optional_rows": "vllm:dhisparse_ready_optional_rows",
    "eligible_history_rows": "vllm:dhisparse_eligible_history_rows",
    "selected_rows": "vllm:dhisparse_selected_rows_total",
    "selected_rows_host": "vllm:dhisparse_selected_rows_host_total",
}


def parse_exposition(text: str, model_name: str | None = None) -> dict[str, float]:
    """One sample of ``COLUMNS`` from Prometheus text (summed over engines / models)."""
    from prometheus_client.parser import text_string_to_metric_families
    wanted = {v: k for k, v in COLUMNS.items()}
    out = dict.fromkeys(COLUMNS, 0.0)
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            col = wanted.get(s.name)
            if col is None or (model_name and s.labels.get("model_name") != model_name):
                continue
            out[col] += s.value
    return out


def poll(url: str, duration_s: float, interval_s: float, model_name: str | None = None,
         log=sys.stderr, stop=None) -> list[dict]:
    """Scrapes ``url`` every ``interval_s`` for ``duration_s`` (or until ``stop.is_set()``)."""
    series, t0 = [], time.time()
    while True:
        now = time.time()
        try:
            with urllib.request.urlopen(url, timeout=10) as r:
                sample = parse_exposition(r.read().decode(), model_name)
            series.append({"t": round(now - t0, 3), **sample})
        except OSError as e:
            print(f"[plot_residency] scrape failed at t={now - t0:.0f}s: {e}", file=log)
        if now - t0 >= duration_s or (stop is not None and stop.is_set()):
            return series
        time.sleep(max(0.0, interval_s - (time.time() - now)))


def load_series(path: str) -> list[dict]:
    if path.endswith(".csv"):
        with open(path, newline="") as f:
            rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    else:
        with open(path) as f:
            rows = json.load(f)
        if isinstance(rows, dict):
            rows = rows["series"]
    missing = sorted({"t", *COLUMNS} - set(rows[0])) if rows else ["(no samples)"]
    if missing:
        raise ValueError(f"{path}: series lacks columns {missing}; expected t, {', '.join(COLUMNS)}")
    return sorted(rows, key=lambda r: r["t"])


def save_series(series: list[dict], path: str) -> None:
    if path.endswith(".csv"):
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=["t", *COLUMNS])
            w.writeheader()
            w.writerows(series)
    else:
        with open(path, "w") as f:
            json.dump(series, f, indent=1)


def derive(series: list[dict], window: int = 1) -> dict[str, list]:
    """Time, allocated request slots, coverage % (None where nothing is eligible), host
    share % (None when idle)."""
    t = [r["t"] for r in series]
    req_slots = [r["admitted_requests"] for r in series]
    coverage = [100.0 * r["ready_optional_rows"] / r["eligible_history_rows"]
                if r["eligible_history_rows"] > 0 else None for r in series]
    share = [None] * len(series)
    for i in range(window, len(series)):
        sel = series[i]["selected_rows"] - series[i - window]["selected_rows"]
        host = series[i]["selected_rows_host"] - series[i - window]["selected_rows_host"]
        if sel > 0:
            share[i] = 100.0 * host / sel
    return dict(t=t, req_slots=req_slots, coverage=coverage, share=share)


def plot(series: list[dict], out: str, title: str = "", window: int = 1) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = derive(series, window)
    fig, axes = plt.subplots(3, 1, figsize=(7, 6.5), sharex=True)
    panels = [("req_slots", "allocated\nrequest slots", "tab:blue", None),
              ("coverage", "coverage (%)", "tab:green", (0, 105)),
              ("share", "host-fetched\nshare (%)", "tab:red", None)]
    for ax, (key, label, color, ylim) in zip(axes, panels):
        pts = [(t, v) for t, v in zip(d["t"], d[key]) if v is not None]
        if key == "req_slots":
            ax.step([p[0] for p in pts], [p[1] for p in pts], where="post", color=color, lw=1.5)
        else:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], color=color, lw=1.5, marker=".", ms=3)
        if not pts:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                    color="gray")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        if ylim:
            ax.set_ylim(*ylim)
        else:
            ax.set_ylim(bottom=0)
    axes[-1].set_xlabel("time (s)")
    if title:
        axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--url", help="a vLLM server's /metrics URL to poll")
    src.add_argument("--series", help="a saved series (.json or .csv)")
    ap.add_argument("--duration", type=float, default=60, help="seconds to poll (--url)")
    ap.add_argument("--interval", type=float, default=1.0, help="seconds between scrapes (--url)")
    ap.add_argument("--model-name", default=None, help="only samples with this model_name label")
    ap.add_argument("--save-series", default=None, help="write the polled series (.json or .csv)")
    ap.add_argument("--window", type=int, default=1,
                    help="samples over which the host-fetched share is computed")
    ap.add_argument("--title", default="")
    ap.add_argument("--out", default="residency.png", help="PNG to write")
    args = ap.parse_args(argv)
    if args.window < 1:
        ap.error("--window must be >= 1")
    if args.url:
        series = poll(args.url, args.duration, args.interval, args.model_name)
        if args.save_series:
            save_series(series, args.save_series)
    else:
        series = load_series(args.series)
    if not series:
        print("[plot_residency] no samples", file=sys.stderr)
        return 1
    plot(series, args.out, args.title, args.window)
    print(f"[plot_residency] {len(series)} samples -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
