"""Sessions and output tokens/s in the same HBM: resident serving against the connector.

    python benchmarks/gpu_capacity.py [--out DIR] [--kv-bytes B] [--rate R] [--arrive-s S]

Needs a CUDA machine (SM90 / SM100) with vLLM 0.33 (installed or staged,
scripts/vllm_stage/).  The model is the demo model's architecture with random weights
(``load_format="dummy"``) and positions up to 135,168, so that 32K, 64K and 128K-token
prompts fit.  Both arms run one after the other in one call, each in its own process,
with vLLM's GPU defaults and the same ``kv_cache_memory_bytes``: requests arrive at a
steady ``--rate`` for ``--arrive-s`` seconds (prompt lengths cycling 32K / 64K / 128K,
``--out-tokens`` output tokens each, ignore_eos), then the engine drains until
``--arm-s``.  Per arm: concurrent decoding requests over time (vLLM's running queue,
requests past their prompt), output tokens/s over the arrival window and overall,
TTFT and inter-token latency percentiles, and for the connector the share of
selections fetched from host.

Writes OUT/gpu_capacity.json (device, date, commit, versions) and OUT/gpu_capacity.png.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "scripts"))
LENGTHS = (32768, 65536, 131072)
MAX_LEN = 135168
EXTRA = {"host_pool_gib": 6.0}  # every running request's history fits the host pool
BINS = ((1, 4), (5, 8), (9, 16), (17, 24), (25, 32), (33, 48), (49, 64), (65, 96), (97, 128))


def model_dir(src: str, max_len: int, shape: str = "demo") -> str:
    """``src``'s architecture in ``shape``'s layer plan (benchmarks/common.py) with positions
    up to ``max_len`` and no weights (dummy load)."""
    from benchmarks.common import layer_plan, model_config_copy

    def longer(cfg: dict) -> None:
        layer_plan(shape, cfg)
        cfg["max_position_embeddings"] = max_len
        cfg["rope_scaling"] = dict(cfg["rope_scaling"], factor=max_len / cfg["rope_scaling"][
            "original_max_position_embeddings"])
    return model_config_copy(src, "capacity-model-", longer)


def layout(cfg) -> dict:
    """vLLM's KV pool: every block id, whatever its group, costs ``block_stride`` bytes;
    a group's block covers ``block_size`` tokens (sliding-window groups keep a few)."""
    strides = sorted({getattr(t, "block_stride", None) for t in cfg.kv_cache_tensors} - {None})
    return dict(num_blocks=cfg.num_blocks, block_stride=strides,
                groups=[dict(spec=type(g.kv_cache_spec).__name__, layers=len(g.layer_names),
                             block_size=g.kv_cache_spec.block_size,
                             sliding_window=getattr(g.kv_cache_spec, "sliding_window", None))
                        for g in cfg.kv_cache_groups])


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def child(args) -> None:
    import torch
    from vllm import LLM, SamplingParams
    from harness.offline_run import in_process_scheduler
    kw = dict(model=args.model, load_format="dummy", max_model_len=args.max_len,
              max_num_seqs=args.max_seqs, seed=0, gpu_memory_utilization=0.15,
              kv_cache_memory_bytes=args.kv_bytes)
    if args.max_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_batched_tokens
    kw.update(json.loads(args.engine_args))
    if args.connector:
        from gpu_measure import engine_args
        kw.update(engine_args(json.loads(args.connector), unaudited=args.unaudited))
    llm = LLM(**kw)
    engine, sched = llm.llm_engine, in_process_scheduler(llm)
    kv_layout = layout(sched.kv_cache_config)
    g = torch.Generator().manual_seed(0)
    n_req = int(args.rate * args.arrive_s)
    prompts = [torch.randint(3, 512, (int(LENGTHS[i % len(LENGTHS)] * args.scale),),
                             generator=g).tolist() for i in range(n_req)]
    params = SamplingParams(temperature=0.0, max_tokens=args.out_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0][:16]}], SamplingParams(max_tokens=2))
    preempted = [0]
    upstream_preempt = sched._preempt_request

    def counted_preempt(*a, **kw):  # vLLM's scheduler preempts when blocks run out
        preempted[0] += 1
        return upstream_preempt(*a, **kw)
    sched._preempt_request = counted_preempt
    t0 = time.perf_counter()
    arrival, first, last, seen, itl, ended = {}, {}, {}, {}, [], set()
    timeline, added, total_out = [], 0, 0
    decode_steps: dict[int, list[float]] = {}  # decoding requests -> pure decode step times
    while time.perf_counter() - t0 < args.arm_s:
        now = time.perf_counter() - t0
        while added < n_req and added / args.rate <= now:
            rid = f"c{added}"
            engine.add_request(rid, {"prompt_token_ids": prompts[added]}, params)
            arrival[rid] = time.perf_counter()
            added += 1
        if not engine.has_unfinished_requests():
            if added >= n_req:
                break
            time.sleep(0.001)
            continue
        # a step with no request in prefill, before or after it, is a pure decode step
        pure_before = not sched.waiting and all(
            r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
        t_step = time.perf_counter()
        outs = engine.step()
        t = time.perf_counter()
        for o in outs:
            if o.finished:
                ended.add(o.request_id)
            n = len(o.outputs[0].token_ids)
            new = n - seen.get(o.request_id, 0)
            if new <= 0:
                continue
            if o.request_id not in first:
                first[o.request_id] = t
            else:
                itl.extend([(t - last[o.request_id]) / new] * new)
            last[o.request_id], seen[o.request_id] = t, n
            total_out += new
        decoding = sum(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
        if pure_before and decoding == len(sched.running) and not sched.waiting and decoding:
            decode_steps.setdefault(decoding, []).append(t - t_step)
        timeline.append((round(t - t0, 4), decoding, len(sched.running), len(sched.waiting),
                         total_out, round(sched.kv_cache_manager.usage, 4), preempted[0]))
    dur = time.perf_counter() - t0
    in_window = [x for x in timeline if x[0] <= args.arrive_s]
    ttft = [first[r] - arrival[r] for r in first]
    res = dict(requests_sent=added, requests_started=len(first),
               requests_finished=sum(seen.get(r, 0) >= args.out_tokens for r in arrival),
               requests_ended=len(ended),  # for any reason
               output_tokens=total_out, seconds=round(dur, 2),
               # prompt tokens of the requests that reached their first token, over the whole
               # arm: admissions as much as prefill speed bound it
               admitted_prompt_tokens_per_s=round(
                   sum(len(prompts[int(r[1:])]) for r in first) / dur),
               output_tokens_per_s=round(total_out / dur, 1),
               output_tokens_per_s_arrival_window=round(
                   in_window[-1][4] / in_window[-1][0], 1) if in_window else None,
               max_decoding=max((x[1] for x in timeline), default=0),
               mean_decoding_second_half=round(sum(x[1] for x in in_window[len(in_window) // 2:])
                                               / max(1, len(in_window) - len(in_window) // 2), 1),
               ttft_s={q: pct(ttft, q) for q in (0.5, 0.9, 0.99)},
               itl_ms={q: (pct(itl, q) or 0) * 1e3 for q in (0.5, 0.9, 0.99)},
               max_kv_usage=max((x[5] for x in timeline), default=0.0),
               preemptions=preempted[0],
               # median pure-decode step per concurrency bin: latency at equal concurrency
               decode_step_ms={f"{lo}-{hi}": round(pct(xs, 0.5) * 1e3, 2) for lo, hi, xs in (
                   (lo, hi, [d for n, ds in decode_steps.items() if lo <= n <= hi for d in ds])
                   for lo, hi in BINS) if xs},
               decode_steps_per_bin={f"{lo}-{hi}": sum(len(ds) for n, ds in decode_steps.items()
                                                       if lo <= n <= hi) for lo, hi in BINS},
               kv_layout=kv_layout, timeline=timeline[::max(1, len(timeline) // 400)])
    from gpu_connector import worker_summary
    tot = worker_summary()
    if tot is not None:
        sel = tot["direct"] + tot["hot"] + tot["host"]
        res["host_share"] = round(tot["host"] / sel, 4) if sel else None
        res["census"] = {k: tot[k] for k in ("direct", "hot", "host", "admissions",
                                             "admissions_waited", "failed")}
    print("RESULT " + json.dumps(res), flush=True)


def main(argv=None) -> int:
    from benchmarks.common import SHAPES
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "needle_v4"),
                    help="a model directory whose config and tokenizer are used")
    ap.add_argument("--out", default="/tmp/gpu_capacity")
    ap.add_argument("--kv-bytes", type=int, default=3 << 29,
                    help="kv_cache_memory_bytes of both arms (default 1.5 GiB: vLLM needs "
                         "~1.2 GiB for one 132K request in prefill)")
    ap.add_argument("--max-len", type=int, default=MAX_LEN, help="max_model_len (positions)")
    ap.add_argument("--max-seqs", type=int, default=96)
    ap.add_argument("--rate", type=float, default=0.5,
                    help="requests per second (below the prefill rate, so memory binds)")
    ap.add_argument("--arrive-s", type=float, default=150.0)
    ap.add_argument("--arm-s", type=float, default=170.0, help="seconds each arm runs at most")
    ap.add_argument("--out-tokens", type=int, default=2048)
    ap.add_argument("--scale", type=float, default=1.0, help="prompt lengths times this")
    ap.add_argument("--extra", default=json.dumps(EXTRA))
    ap.add_argument("--arms", default="resident,connector")
    ap.add_argument("--shape", default="demo", choices=SHAPES,
                    help="the layer plan (benchmarks/common.py layer_plan): the demo's 3 layers, "
                         "or DeepSeek-V4-Flash's 43 on the demo's dimensions")
    ap.add_argument("--max-batched-tokens", type=int, default=0,
                    help="max_num_batched_tokens of both arms (0: vLLM's default); a prefill "
                         "chunk holds a block of each 4-token compressor-state group per 4 "
                         "tokens, each a whole block stride, for its step")
    ap.add_argument("--engine-args", default="{}", metavar="JSON",
                    help="more vllm.LLM arguments for both arms, e.g. "
                         "'{\"scheduler_reserve_full_isl\": false}' (admit a prompt on its "
                         "first chunk instead of its whole prefill)")
    ap.add_argument("--unaudited", action="store_true",
                    help="the connector through scripts/gpu_measure.py's subclass, which lets "
                         "through what the package still refuses on CUDA (history_block_tokens)")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only draw the plot of a result file (beside it, .png)")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="combine the arms of result files with equal settings into OUT")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--connector", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f), args.replot[:-len(".json")] + ".png")
        return 0
    if args.merge:
        return merge(args.merge, args.out)
    longest = int(max(LENGTHS) * args.scale) + args.out_tokens
    if longest > args.max_len:
        ap.error(f"--max-len {args.max_len} is shorter than the longest prompt "
                 f"({int(max(LENGTHS) * args.scale)} tokens at --scale {args.scale:g}) plus "
                 f"--out-tokens {args.out_tokens}: vLLM would end those requests early")
    try:
        engine_args = json.loads(args.engine_args)
    except json.JSONDecodeError as e:
        ap.error(f"--engine-args is not JSON ({e}): give an object of vllm.LLM arguments")
    if not isinstance(engine_args, dict):
        ap.error(f"--engine-args {args.engine_args}: give a JSON object of vllm.LLM arguments")
    if args.child:
        child(args)
        return 0
    from gpu_connector import arm_env
    from gpu_engine import meta
    os.makedirs(args.out, exist_ok=True)
    model = model_dir(args.model, args.max_len, args.shape)
    results = {}
    for arm in args.arms.split(","):
        cmd = [sys.executable, os.path.abspath(__file__), "--child", "--model", model]
        for k in ("kv_bytes", "max_len", "max_seqs", "rate", "arrive_s", "arm_s", "out_tokens",
                  "scale", "max_batched_tokens"):
            cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
        cmd += ["--unaudited"] if args.unaudited else []
        cmd += ["--engine-args", args.engine_args]
        if arm == "connector":
            cmd += ["--connector", args.extra]
        log = os.path.join(args.out, f"capacity_{arm}.log")
        with open(log, "w") as f:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT,
                                  env=arm_env(arm == "connector", in_process=True),
                                  timeout=args.arm_s + 400)
        text = open(log, errors="replace").read()
        found = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
        results[arm] = json.loads(found[-1][7:]) if found else dict(
            error=f"exit {proc.returncode}", log_tail=text[-3000:])
        print(arm, json.dumps({k: v for k, v in results[arm].items() if k != "timeline"}),
              flush=True)
    doc = dict(meta=meta(), kv_cache_memory_bytes=args.kv_bytes, lengths=LENGTHS,
               rate=args.rate, arrive_s=args.arrive_s, out_tokens=args.out_tokens,
               max_num_seqs=args.max_seqs, shape=args.shape,
               max_num_batched_tokens=args.max_batched_tokens or None,
               max_len=args.max_len, scale=args.scale, arm_s=args.arm_s,
               engine_args=json.loads(args.engine_args), unaudited=args.unaudited,
               extra_config=json.loads(args.extra), arms=results)
    return write_result(doc, args.out)


def write_result(doc: dict, out: str) -> int:
    """OUT/gpu_capacity.json with the arms' ratios, and its plot."""
    add_ratios(doc)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_capacity.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, os.path.join(out, "gpu_capacity.png"))
    print("SUMMARY " + json.dumps(doc.get("ratios")), flush=True)
    return 0


def add_ratios(doc: dict) -> None:
    r, c = doc["arms"].get("resident", {}), doc["arms"].get("connector", {})
    if r.get("max_decoding") and c.get("max_decoding"):
        doc["ratios"] = dict(
            max_decoding=round(c["max_decoding"] / r["max_decoding"], 2),
            output_tokens_per_s=round(c["output_tokens_per_s"] / r["output_tokens_per_s"], 2),
            # connector / resident median pure-decode step where both ran that concurrency
            decode_step_at_equal_concurrency={
                b: round(c["decode_step_ms"][b] / r["decode_step_ms"][b], 3)
                for b in r.get("decode_step_ms", {}) if b in c.get("decode_step_ms", {})})


MERGE_SAME = ("kv_cache_memory_bytes", "lengths", "rate", "arrive_s", "out_tokens",
              "max_num_seqs", "shape", "max_num_batched_tokens", "engine_args", "max_len",
              "scale", "arm_s", "unaudited")
MERGE_SAME_META = ("device", "driver", "vllm", "torch", "cuda")


def merge(paths: list[str], out: str) -> int:
    """One result from arms run by separate calls on the same machine (a call's time limit
    can be shorter than two arms): their settings, machine and versions must be equal, and
    each arm must come from one file."""
    docs = []
    for p in paths:
        with open(p) as f:
            docs.append(json.load(f))
    first = docs[0]
    seen = {a: paths[0] for a in first["arms"]}
    for path, d in zip(paths[1:], docs[1:]):
        differ = [(k, first.get(k), d.get(k)) for k in MERGE_SAME if d.get(k) != first.get(k)]
        differ += [(f"meta.{k}", first["meta"].get(k), d["meta"].get(k))
                   for k in MERGE_SAME_META if d["meta"].get(k) != first["meta"].get(k)]
        both = "connector" in d["arms"] and "connector" in first["arms"]
        if both and d.get("extra_config") != first.get("extra_config"):  # resident ignores it
            differ.append(("extra_config", first.get("extra_config"), d.get("extra_config")))
        if differ:
            raise SystemExit(f"--merge: {path} differs from {paths[0]}: " + "; ".join(
                f"{k} {b!r} against {a!r}" for k, a, b in differ))
        for arm in d["arms"]:
            if arm in seen:
                raise SystemExit(f"--merge: arm {arm!r} is in both {seen[arm]} and {path}")
            seen[arm] = path
    with_connector = [d for d in docs if "connector" in d["arms"]] or docs
    doc = dict(first, extra_config=with_connector[0].get("extra_config"),
               arms={a: v for d in docs for a, v in d["arms"].items()},
               merged_from=[dict(meta=d["meta"], arms=list(d["arms"])) for d in docs])
    return write_result(doc, out)


def plot(doc: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, (ax, ax2) = plt.subplots(2, 1, figsize=(7, 5.5), sharex=True)
    for arm, r in doc["arms"].items():
        tl = r.get("timeline") or []
        ax.plot([x[0] for x in tl], [x[1] for x in tl], label=arm)
        if tl and len(tl[0]) > 5:  # vLLM's KV block usage
            ax2.plot([x[0] for x in tl], [x[5] for x in tl], label=arm)
    ax.set_ylabel("decoding requests")
    ax.set_title(f"same KV budget ({doc['kv_cache_memory_bytes'] / 2**30:.2f} GiB), "
                 f"{doc['rate']} req/s of 32K/64K/128K tokens")
    ax.legend()
    ax2.set_xlabel("s")
    ax2.set_ylabel("vLLM KV usage")
    ax2.set_ylim(0, 1.05)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
