"""Load step (paper 4.3.1, scaled down): offered concurrency low -> high -> low, residency on vs off.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/load_step.py --model /tmp/demo_v4 \\
        --out benchmarks/results/load_step

runs both arms (each in its own process, same build, same deterministic
arrival schedule) and writes ``<out>.json`` (per-second series of both arms,
outputs, summary), ``<out>.csv`` and ``<out>.png`` (the paper's Figure 6:
allocated request slots, coverage, host-fetched share).

Arrivals are step-based (deterministic): in phase *p* a new request (a
``--prompt-len``-token prompt, ``--max-tokens`` greedy tokens) is added
whenever fewer than ``concurrency[p]`` are unfinished; a phase lasts
``--phase-steps`` engine steps.  The hierarchy's device pool is sized
(``device_pool_pages``) so that the optional history of one or two requests
fits but not that of the high phase: coverage must fall under pressure and
recover after; with residency off history always lives on host.

Series columns (sampled after every step, then reduced to one row per
second of wall time): ``running`` (vLLM's running requests),
``admitted_requests`` (hierarchy slots allocated), ``coverage`` (ready
optional history / eligible history), ``host_share`` (host-fetched selected
rows / all selected rows in that second).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # harness/


def run_arm(args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from harness.offline_run import prompt_ids, running_requests
    from vllm_dhisparse import engine_args

    extra = dict(hot_cache_rows=args.hot_cache_rows, optional_residency=args.arm == "on",
                 device_pool_pages=args.device_pool_pages,
                 repopulate_pages_per_step=args.repopulate)
    llm = LLM(model=args.model, enforce_eager=True, block_size=256, max_model_len=args.max_model_len,
              max_num_seqs=args.max_num_seqs, kv_cache_memory_bytes=args.kv_cache_bytes, seed=0,
              enable_prefix_caching=False, enable_chunked_prefill=False,
              **engine_args(extra))
    worker = get_kv_transfer_group().dhisparse_worker
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1, seed=0)
    phases = [int(c) for c in args.concurrency]
    samples, outputs, unfinished = [], {}, set()
    next_id, step, t0 = 0, 0, time.time()
    for phase, conc in enumerate(phases):
        for _ in range(args.phase_steps):
            while len(unfinished) < conc:
                rid = f"q{next_id:03d}"
                engine.add_request(rid, {"prompt_token_ids": prompt_ids(args.prompt_len, next_id)}, sp)
                unfinished.add(rid)
                next_id += 1
            for out in engine.step():
                if out.finished:
                    c = out.outputs[0]
                    outputs[out.request_id] = dict(token_ids=list(c.token_ids),
                                                   finish_reason=c.finish_reason)
                    unfinished.discard(out.request_id)
            step += 1
            s = worker.summary()
            tot = s["totals"]
            src = s["sources"].values()
            samples.append(dict(
                t=round(time.time() - t0, 3), step=step, phase=phase, offered=conc,
                running=running_requests(llm), admitted_requests=len(worker.hierarchy.requests),
                ready_optional_rows=sum(x["ready_optional_rows"] for x in src),
                eligible_history_rows=sum(x["eligible_history_rows"] for x in src),
                selected_rows=tot["selected"], selected_rows_host=tot["host"]))
    while engine.has_unfinished_requests():  # drain (not part of the series)
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                outputs[out.request_id] = dict(token_ids=list(c.token_ids), finish_reason=c.finish_reason)
    return dict(arm=args.arm, samples=samples, outputs=outputs, config=extra)


def per_second(samples: list[dict]) -> list[dict]:
    """One row per wall-clock second: last gauge values, host share of that second's selections."""
    rows, prev = [], None
    by_sec: dict[int, dict] = {}
    for s in samples:
        by_sec[int(s["t"])] = s
    for sec in sorted(by_sec):
        s = by_sec[sec]
        d_sel = s["selected_rows"] - (prev["selected_rows"] if prev else 0)
        d_host = s["selected_rows_host"] - (prev["selected_rows_host"] if prev else 0)
        rows.append(dict(t=sec, phase=s["phase"], offered=s["offered"], running=s["running"],
                         admitted_requests=s["admitted_requests"],
                         coverage=(s["ready_optional_rows"] / s["eligible_history_rows"]
                                   if s["eligible_history_rows"] else None),
                         host_share=(d_host / d_sel if d_sel else None),
                         selected=d_sel, host=d_host))
        prev = s
    return rows


def phase_stats(samples: list[dict]) -> dict:
    out = {}
    for ph in sorted({s["phase"] for s in samples}):
        xs = [s for s in samples if s["phase"] == ph]
        first, last = xs[0], xs[-1]
        i = samples.index(first)
        base = samples[i - 1] if i else dict(selected_rows=0, selected_rows_host=0)
        sel = last["selected_rows"] - base["selected_rows"]
        host = last["selected_rows_host"] - base["selected_rows_host"]
        covs = [s["ready_optional_rows"] / s["eligible_history_rows"] for s in xs
                if s["eligible_history_rows"]]
        out[ph] = dict(offered=first["offered"], steps=len(xs), host_share=host / sel if sel else None,
                       selected=sel, host=host, min_coverage=min(covs) if covs else None,
                       last_coverage=covs[-1] if covs else None,
                       max_admitted=max(s["admitted_requests"] for s in xs),
                       max_running=max(s["running"] or 0 for s in xs))
    return out


def plot(result: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(3, 1, figsize=(8, 7), sharex=True)
    for arm, style in (("on", "-"), ("off", "--")):
        rows = result["arms"][arm]["per_second"]
        t = [r["t"] for r in rows]
        axes[0].plot(t, [r["admitted_requests"] for r in rows], style, label=f"residency {arm}")
        axes[1].plot(t, [100 * r["coverage"] if r["coverage"] is not None else float("nan") for r in rows],
                     style, label=f"residency {arm}")
        axes[2].plot(t, [100 * r["host_share"] if r["host_share"] is not None else float("nan")
                         for r in rows], style, label=f"residency {arm}")
    axes[0].set_ylabel("allocated\nrequest slots")
    axes[1].set_ylabel("coverage %")
    axes[2].set_ylabel("host-fetched\nshare %")
    axes[2].set_xlabel("time (s)")
    for ax in axes:
        ax.grid(alpha=.3)
        ax.legend(loc="upper right", fontsize=8)
    conc = "→".join(result["concurrency"])
    fig.suptitle(f"Load step {conc} concurrent requests (demo DeepSeek-V4, CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", default=os.path.join(HERE, "results", "load_step"))
    ap.add_argument("--arm", choices=("on", "off"), help=argparse.SUPPRESS)
    ap.add_argument("--arm-out", help=argparse.SUPPRESS)
    ap.add_argument("--concurrency", nargs="+", default=["1", "5", "1"])
    ap.add_argument("--phase-steps", type=int, default=40)
    ap.add_argument("--prompt-len", type=int, default=2600)
    ap.add_argument("--max-tokens", type=int, default=30)
    ap.add_argument("--hot-cache-rows", type=int, default=512)
    ap.add_argument("--device-pool-pages", type=int, default=86,
                    help="per source: 6 x 11 required pages + 20 optional (2 of 10-page histories)")
    ap.add_argument("--repopulate", type=int, default=4)
    ap.add_argument("--max-num-seqs", type=int, default=6)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--kv-cache-bytes", type=int, default=2 * 2**30,
                    help="vLLM's KV memory in bytes (default 2 GiB; on CPU a fraction of RAM "
                         "would be less the worker's resident memory, which varies by machine)")
    args = ap.parse_args(argv)
    if args.arm:
        with open(args.arm_out, "w") as f:
            json.dump(run_arm(args), f)
        return 0
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    arms = {}
    for arm in ("on", "off"):
        tmp = f"{args.out}.{arm}.tmp.json"
        cmd = [sys.executable, os.path.abspath(__file__), "--arm", arm, "--arm-out", tmp,
               *[a for a in (argv or sys.argv[1:])]]
        t = time.time()
        subprocess.run(cmd, check=True, env=env)
        with open(tmp) as f:
            arms[arm] = json.load(f)
        os.remove(tmp)
        arms[arm]["wall_s"] = time.time() - t
        arms[arm]["per_second"] = per_second(arms[arm]["samples"])
        arms[arm]["phases"] = phase_stats(arms[arm]["samples"])
    same = arms["on"]["outputs"] == arms["off"]["outputs"]
    ph_on, ph_off = arms["on"]["phases"], arms["off"]["phases"]
    summary = dict(outputs_identical_on_vs_off=same, phases={
        ph: dict(host_share_on=ph_on[ph]["host_share"], host_share_off=ph_off[ph]["host_share"],
                 min_coverage_on=ph_on[ph]["min_coverage"], last_coverage_on=ph_on[ph]["last_coverage"],
                 max_admitted=ph_on[ph]["max_admitted"]) for ph in ph_on})
    result = dict(concurrency=args.concurrency, args=vars(args), summary=summary, arms=arms)
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    with open(args.out + ".csv", "w") as f:
        f.write("arm,t,phase,offered,running,admitted_requests,coverage,host_share\n")
        for arm in ("on", "off"):
            for r in arms[arm]["per_second"]:
                f.write(f"{arm},{r['t']},{r['phase']},{r['offered']},{r['running']},"
                        f"{r['admitted_requests']},{r['coverage']},{r['host_share']}\n")
    plot(result, args.out + ".png")
    print(json.dumps(summary, indent=1))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
