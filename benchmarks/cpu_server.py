"""The whole server on CPU, resident serving vs the connector: decode latency at low load
and capacity at a fixed KV budget (vLLM's OpenAI server, the demo model).

    python benchmarks/cpu_server.py --out benchmarks/results/cpu_server [--phases ...]
    python benchmarks/cpu_server.py --smoke --out /tmp/cs    # CI: both phases, tiny shapes

Phases (one server per arm on 127.0.0.1, same engine arguments):

* ``latency`` (both servers up, the arms alternating within each round): 1 and then 4
  concurrent streamed requests (``--latency-prompt`` tokens,
  ``--latency-tokens`` greedy tokens, ``ignore_eos``), history resident (the prompt's c4a
  rows fit the hot cache), ``--rounds`` rounds; the median gap between two tokens of a
  stream while every stream of its round decodes (other requests' prefill chunks would
  land in the gaps before), per arm, and the ratio; each request's first-to-last-token
  latency is kept next to it.
* ``capacity``: for each ``--capacity`` prompt length and KV budget, ``--requests``
  requests submitted at once to a server with that much KV memory (both arms: vLLM's
  blocks, and with the connector also the hierarchy's device pools, inside it);
  ``vllm:num_requests_running`` polled from ``/metrics`` every 0.2 s (its maximum), and
  output tokens per second over the whole batch.

Writes ``<out>.json`` (device, date, commit, every measurement) and ``<out>.png``.
Prompts are random token ids, distinct per request (no prefix hits).
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from vllm_dhisparse import demo  # noqa: E402
from vllm_dhisparse.engine_args import server_args as connector_args  # noqa: E402

RUNNING = re.compile(r"^vllm:num_requests_running\{[^}]*\}\s+([0-9.e+]+)", re.M)


def prompt_ids(n: int, seed: int) -> list[int]:
    import random
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(n)]  # 0-2 are the special tokens


class Server:
    """vLLM's OpenAI server for one arm (``extra`` None: resident serving)."""

    def __init__(self, model: str, extra: dict | None, *, max_model_len: int, kv_bytes: int,
                 max_num_seqs: int, log: Path):
        self.model, self.port = model, demo.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--seed", "0",
               "--max-model-len", str(max_model_len), "--enforce-eager", "--block-size", "256",
               "--kv-cache-memory-bytes", str(kv_bytes), "--max-num-seqs", str(max_num_seqs)]
        if extra is not None:
            cmd += connector_args(extra)
        self.log = open(log, "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def __enter__(self):
        try:
            demo.wait_healthy(self.url, self.proc, 600)
        except Exception:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc):
        demo.stop_server(self.proc)
        self.log.close()

    def post(self, body: dict):
        req = urllib.request.Request(self.url + "/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        return urllib.request.urlopen(req, timeout=3600)

    def stream(self, ids: list[int], max_tokens: int) -> dict:
        """One streamed greedy request: token count and the times its chunks arrived."""
        body = dict(model=self.model, prompt=ids, max_tokens=max_tokens, temperature=0.0,
                    ignore_eos=True, stream=True, stream_options={"include_usage": True})
        times, usage, t0 = [], None, time.perf_counter()
        with self.post(body) as r:
            for line in r:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    usage = chunk["usage"]
        tokens = usage["completion_tokens"] if usage else len(times)
        itl = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else None
        return dict(tokens=tokens, chunks=len(times), first_s=times[0] - t0 if times else None,
                    itl_s=itl, times=times)

    def complete(self, ids: list[int], max_tokens: int) -> int:
        body = dict(model=self.model, prompt=ids, max_tokens=max_tokens, temperature=0.0,
                    ignore_eos=True)
        with self.post(body) as r:
            return json.load(r)["usage"]["completion_tokens"]

    def running(self) -> int:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            m = RUNNING.search(r.read().decode())
        return int(float(m.group(1))) if m else 0


def concurrently(fn, args: list) -> list:
    out = [None] * len(args)
    errors = []

    def run(i, a):
        try:
            out[i] = fn(*a)
        except Exception as e:  # noqa: BLE001 -- reported after the join
            errors.append(e)
    threads = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def latency(args, arms: dict, logs: Path, servers: dict | None = None) -> dict:
    """Both arms' servers up at once, the arms taking turns within every round (same
    prompts), so that a slow spell of the machine falls on both.  ``servers``: ones
    already up (the smoke's, shared with its capacity phase)."""
    res = {arm: {} for arm in arms}
    with contextlib.ExitStack() as stack:
        servers = servers or {arm: stack.enter_context(Server(
            args.model, extra, max_model_len=args.latency_prompt + args.latency_tokens + 8,
            kv_bytes=args.latency_kv_bytes, max_num_seqs=8, log=logs / f"latency_{arm}.log"))
            for arm, extra in arms.items()}
        for s in servers.values():
            s.stream(prompt_ids(args.latency_prompt, 999), 4)  # warm-up
        for n in (1, 4):
            itls = {arm: [] for arm in arms}
            gaps = {arm: [] for arm in arms}
            tokens = {arm: [] for arm in arms}
            for r in range(args.rounds):
                for arm, s in servers.items():
                    got = concurrently(s.stream, [(prompt_ids(args.latency_prompt, 1000 * r + i),
                                                   args.latency_tokens) for i in range(n)])
                    itls[arm] += [g["itl_s"] for g in got]
                    tokens[arm] += [g["tokens"] for g in got]
                    gaps[arm] += decode_gaps([g["times"] for g in got])
            for arm in arms:
                if not gaps[arm]:
                    raise RuntimeError(f"{arm}: the {n} streams of a round never decoded at "
                                       f"once; raise --latency-tokens")
                res[arm][f"concurrency_{n}"] = dict(itl_s=itls[arm], gaps_s=gaps[arm],
                                                    tokens=tokens[arm],
                                                    median_gap_s=statistics.median(gaps[arm]))
                print(f"  {arm} latency x{n}: median {1e3 * statistics.median(gaps[arm]):.1f} "
                      f"ms/token over {len(gaps[arm])} gaps while all {n} decode (first to last "
                      f"token: {1e3 * statistics.median(itls[arm]):.1f})", flush=True)
    return res


def decode_gaps(times: list[list[float]]) -> list[float]:
    """Seconds between consecutive tokens of each stream while every stream of the round
    decodes (after the last first token, before the first last token): a decode step of
    n requests, without the other requests' prefill chunks in it."""
    if not all(times):
        return []
    start, end = max(t[0] for t in times), min(t[-1] for t in times)
    return [b - a for t in times for a, b in zip(t, t[1:]) if a >= start and b <= end]


def capacity(args, arm: str, extra, prompt: int, kv_bytes: int, logs: Path,
             server: Server | None = None) -> dict:
    """``server``: one already up with ``kv_bytes`` of KV memory (the smoke's: main checks
    that its budget is this one)."""
    with contextlib.ExitStack() as stack:
        s = server or stack.enter_context(Server(
            args.model, extra, max_model_len=prompt + args.capacity_tokens + 8,
            kv_bytes=kv_bytes, max_num_seqs=args.requests,
            log=logs / f"capacity{prompt}_{arm}.log"))
        seen, done = [], threading.Event()

        def poll():
            while not done.is_set():
                try:
                    seen.append(s.running())
                except OSError:
                    pass
                done.wait(0.2)
        poller = threading.Thread(target=poll)
        poller.start()
        t0 = time.perf_counter()
        try:
            tokens = concurrently(s.complete, [(prompt_ids(prompt, 50_000 + i), args.capacity_tokens)
                                               for i in range(args.requests)])
        finally:
            done.set()
            poller.join()
        wall = time.perf_counter() - t0
    out = dict(kv_bytes=kv_bytes, max_running=max(seen, default=0), output_tokens=sum(tokens),
               wall_s=wall,
               output_tokens_per_s=sum(tokens) / wall, running_samples=len(seen))
    print(f"  {arm} capacity {prompt}: max running {out['max_running']}, "
          f"{out['output_tokens_per_s']:.2f} output tokens/s", flush=True)
    return out


def plot(res: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    arms = ("resident", "connector")
    lat = res.get("latency", {})
    if lat:
        for j, n in enumerate((1, 4)):
            # median_gap_s: gaps while every stream decodes; earlier files: first to last token
            cells = [lat[a][f"concurrency_{n}"] for a in arms]
            vals = [1e3 * c.get("median_gap_s", c.get("median_itl_s")) for c in cells]
            for k, (arm, v) in enumerate(zip(arms, vals)):
                ax[0].bar(j * 3 + k, v, color=["tab:gray", "tab:blue"][k],
                          label=arm if j == 0 else None)
                ax[0].annotate(f"{v:.1f}", (j * 3 + k, v), ha="center", va="bottom")
        ax[0].set_xticks([0.5, 3.5], ["1 request", "4 requests"])
        ax[0].set_ylabel("median inter-token latency (ms)")
        ax[0].set_title("decode latency, history resident")
        ax[0].legend(loc="upper left")
    else:
        ax[0].axis("off")
    cap = res.get("capacity", {})
    prompts = sorted(cap, key=int)
    for i, (key, label) in enumerate((("max_running", "max running requests"),
                                      ("output_tokens_per_s", "output tokens / s"))):
        a = ax[1 + i]
        if not prompts:
            a.axis("off")
            continue
        for k, arm in enumerate(arms):
            a.bar([j * 3 + k for j in range(len(prompts))],
                  [cap[p][arm][key] for p in prompts], color=["tab:gray", "tab:blue"][k],
                  label=arm)
        a.set_xticks([j * 3 + 0.5 for j in range(len(prompts))],
                     [f"{p} tokens\n{cap[p]['resident'].get('kv_bytes', 0) / 1e6:.0f} MB KV"
                      for p in prompts])
        a.set_title(f"{label}, {res['config']['requests']} requests at once")
        a.legend()
    fig.suptitle(f"vLLM server on {res['device']}, {res['date']}, {res['commit']}")
    fig.tight_layout()
    fig.savefig(png, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results stem: <out>.json, <out>.png")
    ap.add_argument("--model", default=str(ROOT / "demo_model"),
                    help="model directory (default: the demo model, built if missing)")
    ap.add_argument("--phases", default="latency,capacity", help="latency, capacity")
    ap.add_argument("--rounds", type=int, default=5,
                    help="latency rounds per concurrency (the arms alternate within each)")
    ap.add_argument("--latency-prompt", type=int, default=1800,
                    help="prompt tokens of the latency phase (c4a rows within the hot cache)")
    ap.add_argument("--latency-tokens", type=int, default=64)
    ap.add_argument("--latency-kv-bytes", type=int, default=1 << 30)
    ap.add_argument("--capacity", default="7000:100000000,16000:200000000",
                    help="PROMPT_TOKENS:KV_BYTES,...: the capacity runs (per prompt length a "
                         "budget near the least resident serving starts with, so that it runs "
                         "fewer than --requests; the demo model's positions end at 16,384)")
    ap.add_argument("--capacity-tokens", type=int, default=96,
                    help="output tokens per request: long enough that requests decode "
                         "together (prefill holds every block in both arms)")
    ap.add_argument("--requests", type=int, default=10)
    ap.add_argument("--connector", default='{"hot_cache_rows": 512}',
                    help="the connector arm's kv_connector_extra_config (JSON)")
    ap.add_argument("--plot", metavar="JSON", help="draw a committed results file and exit")
    ap.add_argument("--smoke", action="store_true", help="one latency round of 200-token "
                    "prompts and one 300-token capacity run of 3 requests; exit 1 unless "
                    "every request got all its tokens")
    args = ap.parse_args(argv)
    if args.smoke:  # its shapes, under any flag given explicitly
        ap.set_defaults(rounds=1, latency_prompt=200, latency_tokens=16,
                        latency_kv_bytes=100_000_000, capacity="300:100000000",
                        capacity_tokens=8, requests=3)
        args = ap.parse_args(argv)
        if set(args.phases.split(",")) != {"latency", "capacity"}:
            ap.error("--smoke runs and checks both phases: drop --phases")
        if any(int(c.split(":")[1]) != args.latency_kv_bytes for c in args.capacity.split(",")):
            ap.error(f"--smoke serves both phases from one server per arm: give --capacity "
                     f"the KV bytes of --latency-kv-bytes ({args.latency_kv_bytes})")
    if args.plot:
        plot(json.loads(Path(args.plot).read_text()), args.out + ".png")
        return 0
    if not (Path(args.model) / "config.json").exists():
        demo.build_demo_model(args.model)
    extra = json.loads(args.connector)
    logs = Path(args.out + "_logs")
    logs.mkdir(parents=True, exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    res = dict(device=f"CPU {platform.machine()}, {os.cpu_count()} cores",
               date=datetime.date.today().isoformat(), commit=commit,
               config={k: v for k, v in vars(args).items() if k not in ("plot",)})
    phases = set(args.phases.split(","))
    arms = {"resident": None, "connector": extra}
    with contextlib.ExitStack() as stack:
        # the smoke checks that both phases run, not what they measure: one server per arm
        # serves both, the two starting side by side (a server start is most of a smoke's
        # time on CPU)
        shared = {arm: Server(
            args.model, e, max_model_len=max(
                [args.latency_prompt + args.latency_tokens] + [
                    int(c.split(":")[0]) + args.capacity_tokens
                    for c in args.capacity.split(",")]) + 8,
            kv_bytes=args.latency_kv_bytes, max_num_seqs=max(8, args.requests),
            log=logs / f"smoke_{arm}.log") for arm, e in arms.items()} if args.smoke else {}
        for server in shared.values():
            stack.push(server)  # stopped on the way out, started or not
        for server in shared.values():
            demo.wait_healthy(server.url, server.proc, 600)
        run_phases(args, res, phases, arms, logs, shared)
    Path(args.out + ".json").write_text(json.dumps(res, indent=1))
    plot(res, args.out + ".png")
    print("wrote", args.out + ".json", args.out + ".png")
    if args.smoke:
        short = [f"{arm} capacity {p}" for p, arms in res["capacity"].items()
                 for arm, r in arms.items()
                 if r["output_tokens"] != args.requests * args.capacity_tokens]
        short += [f"{arm} latency x{n}" for arm, r in res["latency"].items()
                  if arm in ("resident", "connector") for n in (1, 4)
                  if any(t != args.latency_tokens for t in r[f"concurrency_{n}"]["tokens"])]
        print("CHECK: " + (f"requests short of their tokens: {', '.join(short)}" if short
                           else "every request got all its tokens"))
        return 1 if short else 0
    return 0


def run_phases(args, res: dict, phases: set, arms: dict, logs: Path, shared: dict) -> None:
    if "latency" in phases:
        res["latency"] = latency(args, arms, logs, shared or None)
        for n in (1, 4):
            key = f"concurrency_{n}"
            res["latency"][f"ratio_{n}"] = (res["latency"]["connector"][key]["median_gap_s"]
                                            / res["latency"]["resident"][key]["median_gap_s"])
    if "capacity" in phases:
        res["capacity"] = {}
        for item in args.capacity.split(","):
            prompt, kv_bytes = (int(x) for x in item.split(":"))
            res["capacity"][str(prompt)] = {arm: capacity(args, arm, e, prompt, kv_bytes, logs,
                                                          shared.get(arm))
                                            for arm, e in arms.items()}
            Path(args.out + ".json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    sys.exit(main())
