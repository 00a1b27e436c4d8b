"""Where a decode step's time goes on CPU, resident serving against the connector.

    python benchmarks/cpu_step_parts.py --out benchmarks/results/cpu_step_parts
    python benchmarks/cpu_step_parts.py --smoke   # CI: short run, every committed part timed

Each arm runs ``harness.offline_run`` (one request, ``--prompt-len``
tokens, ``--max-tokens`` greedy tokens) in its own process with vLLM's engine in that
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), and times every call of a list of
methods: vLLM's model runner and scheduler, the c4a attention layer (upstream's and the
routed one), the CPU attention op itself, and the connector's per-step parts
(``WorkerSide``, ``StepContext``, ``KVHierarchy``).  The timers wrap the methods with
their signatures kept, so the connector's start-up checks of vLLM's targets still pass;
they measure, they change nothing the engine computes.  The connector arm writes no
``stats_file`` (a server does not either).

Writes ``<out>.json`` (device, date, commit; per arm and part: calls, median and total
ms) and ``<out>.png`` (per-step medians side by side).  Prefill calls of the attention
layers are kept apart (``T>1``) from decode calls (``T=1``).  The history of the prompt
stays resident (the default hot cache holds all its c4a rows), as in
``cpu_server.py``'s latency phase.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # harness/

# (module, class, method): the parts timed in both arms (a class the arm lacks is skipped)
PARTS = [
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "execute_model"),
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner", "sample_tokens"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "schedule"),
    ("vllm.v1.core.sched.scheduler", "Scheduler", "update_from_output"),
    ("vllm_dhisparse.integration.worker.worker_side", "WorkerSide", "begin_step"),
    ("vllm_dhisparse.integration.worker.worker_side", "WorkerSide", "end_step"),
    ("vllm_dhisparse.integration.worker.worker_side", "WorkerSide", "get_kv_connector_stats"),
    ("vllm_dhisparse.integration.engine_core.scheduler_side", "SchedulerSide",
     "build_connector_meta"),
    ("vllm_dhisparse.integration.layers.step_context", "StepContext", "plan"),
    ("vllm_dhisparse.integration.layers.step_context", "StepContext", "resolve"),
    ("vllm_dhisparse.hierarchy.hierarchy", "KVHierarchy", "resolve"),
    ("vllm_dhisparse.hierarchy.hierarchy", "KVHierarchy", "step"),
]
ATTENTION = [  # split by layer kind and prefill / decode
    ("vllm.models.deepseek_v4.cpu.cpu_sparse", "DeepseekV4CPUAttention", "forward_mqa",
     "upstream attention"),
    ("vllm_dhisparse.integration.layers.cpu_attention", "RoutedDeepseekV4CPUAttention",
     "forward_mqa", "routed attention"),
]


def _timed(f, record, key_of):
    @functools.wraps(f)  # the connector's start-up checks read the signature
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            record(key_of(*args), time.perf_counter() - t0)
    return wrapper


def run_arm(argv: list[str], out: str) -> None:
    """In the child process: wrap the parts, run offline_run, dump the samples."""
    samples: dict[str, list[float]] = {}

    def record(key, dt):
        samples.setdefault(key, []).append(dt)

    for mod, cls, meth in PARTS:
        try:
            owner = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):
            continue
        setattr(owner, meth, _timed(getattr(owner, meth), record,
                                    lambda *a, k=f"{cls}.{meth}": k))
    for mod, cls, meth, label in ATTENTION:
        owner = getattr(importlib.import_module(mod), cls)
        setattr(owner, meth, _timed(
            owner.__dict__[meth], record,
            lambda self, q, *a, label=label: f"{label} c{self.compress_ratio} "
                                             f"{'T=1' if q.shape[0] == 1 else 'T>1'}"))
    import torch
    import vllm._custom_ops  # noqa: F401  (vLLM's own library first, as the plugin loads it)

    from vllm_dhisparse.eager_v4 import register_missing_ops
    register_missing_ops()  # without AVX512-BF16 the op is the package's eager one
    ns = torch.ops._C  # the CPU attention op, called by both layers
    op = ns.flash_mla_with_kvcache_cpu
    setattr(ns, "flash_mla_with_kvcache_cpu",
            _timed(op, record, lambda *a: "attention op"))
    from harness import offline_run
    try:
        offline_run.main(argv)
    finally:
        with open(out, "w") as f:
            json.dump(samples, f)


def summarize(samples: dict) -> dict:
    return {k: dict(calls=len(v), median_ms=statistics.median(v) * 1e3, total_ms=sum(v) * 1e3)
            for k, v in sorted(samples.items())}


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    arms = result["arms"]
    keys = sorted(set(arms["resident"]) | set(arms["connector"]),
                  key=lambda k: -max(arms[a].get(k, {}).get("median_ms", 0) for a in arms))
    keys = [k for k in keys if "T>1" not in k]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(keys) + 1.5))
    y = range(len(keys))
    for i, arm in enumerate(("resident", "connector")):
        ax.barh([v + 0.4 * i for v in y], [arms[arm].get(k, {}).get("median_ms", 0) for k in keys],
                height=0.4, label=arm)
    ax.set_yticks([v + 0.2 for v in y])
    ax.set_yticklabels(keys, fontsize=8)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("median ms per call")
    ax.legend()
    ax.set_title(f"decode step parts on {result['device']}, {result['date']}, {result['commit']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="results stem: <out>.json, <out>.png")
    ap.add_argument("--model", default=str(ROOT / "demo_model"),
                    help="model directory (default: the demo model, `make demo` builds it)")
    ap.add_argument("--prompt-len", type=int, default=1800)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--connector", default='{"hot_cache_rows": 512, "stats_file": ""}',
                    help="the connector arm's kv_connector_extra_config (JSON)")
    ap.add_argument("--smoke", action="store_true",
                    help="a 600-token prompt and 4 tokens; checks that each arm timed every "
                         "part the ledger's latest result timed (results to a temp folder)")
    ap.add_argument("--arm-child", nargs=2, metavar=("SAMPLES", "ARGS"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.arm_child:
        run_arm(json.loads(args.arm_child[1]), args.arm_child[0])
        return 0
    if args.smoke:  # explicit flags still win over the smoke's shape
        ap.set_defaults(prompt_len=600, max_tokens=4,
                        out=os.path.join(tempfile.mkdtemp(prefix="step-parts-"), "smoke"))
        args = ap.parse_args(argv)
    if not args.out:
        ap.error("--out is required")
    if not os.path.isdir(args.model):
        ap.error(f"--model {args.model}: no such directory (build the demo model with "
                 f"`python -m vllm_dhisparse.demo_build.model --out demo_model`)")
    base = ["--model", args.model, "--prompt-lens", str(args.prompt_len), "--max-tokens",
            str(args.max_tokens), "--max-model-len", str(args.prompt_len + args.max_tokens + 64),
            "--kv-cache-bytes", str(10**9)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    arms = {}
    for arm, extra in (("resident", []), ("connector", ["--connector", args.connector])):
        with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as tmp:
            samples = tmp.name
        print(f"[{arm}] running offline_run in its own process ...", flush=True)
        proc = subprocess.run([sys.executable, __file__, "--arm-child", samples,
                               json.dumps(base + extra)], env=env, cwd=ROOT,
                              capture_output=True, text=True)
        if proc.returncode:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            raise SystemExit(f"the {arm} arm failed (exit {proc.returncode})")
        with open(samples) as f:
            arms[arm] = summarize(json.load(f))
        os.unlink(samples)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    result = dict(device=f"cpu ({platform.processor() or platform.machine()}, "
                         f"{os.cpu_count()} cores)",
                  date=datetime.date.today().isoformat(), commit=commit,
                  config=dict(prompt_len=args.prompt_len, max_tokens=args.max_tokens,
                              connector=json.loads(args.connector)),
                  arms=arms)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(f"{args.out}.json", "w") as f:
        json.dump(result, f, indent=1)
    plot(result, f"{args.out}.png")
    print(f"{'part':45s} {'resident':>10s} {'connector':>10s}  (median ms per call)")
    for k in sorted(set(arms["resident"]) | set(arms["connector"])):
        r, c = arms["resident"].get(k), arms["connector"].get(k)
        print(f"{k:45s} {r['median_ms'] if r else float('nan'):10.3f} "
              f"{c['median_ms'] if c else float('nan'):10.3f}")
    print(f"wrote {args.out}.json, {args.out}.png")
    if args.smoke:
        missing = smoke_check(arms)
        print("CHECK: " + ("; ".join(missing) if missing else
                           "every part of the ledger's latest result was timed"))
        return 1 if missing else 0
    return 0


def smoke_check(arms: dict) -> list[str]:
    """The parts the ledger's latest result timed that an arm of this run did not: a part
    that stopped being called, or a method that moved (its timer then wraps nothing)."""
    from benchmarks import ledger
    rec, doc = ledger.latest_result("cpu_step_parts", "cpu")
    committed = doc["arms"]
    return [f"{arm}: {', '.join(sorted(set(committed[arm]) - set(arms[arm])))} "
            f"(timed in {rec['files'][0]})"
            for arm in ("resident", "connector") if set(committed[arm]) - set(arms[arm])]


if __name__ == "__main__":
    raise SystemExit(main())
