"""vLLM's own engine serving the trained pass-key model resident (no connector) on a GPU.

    python scripts/gpu_engine.py [--model models/needle_v4] [--arms llm,serve] [--out DIR]

Needs a CUDA machine with vLLM 0.33, installed (``pip install vllm==0.33.0``) or staged
(``scripts/vllm_stage/``).  Each arm runs in its own process with its log kept:

* ``llm``: ``vllm.LLM(model)`` in a child process;
* ``serve``: ``vllm serve model`` on 127.0.0.1, asked through the OpenAI client.

Both run vLLM without general plugins (``VLLM_PLUGINS`` empty unless set: this package's,
if installed, stays out) with vLLM's GPU defaults (CUDA graphs, prefix caching, chunked
prefill) but a fixed KV budget (``--kv-bytes``), 16,384 positions and seed 0.  Per arm:
the start-up time (until ``LLM(...)`` returns / until ``/health`` answers), which CUDA
graph modes vLLM captured (its "Capturing CUDA graphs (..., FULL)" progress bars, which its
default log settings print), the pass key of
``make demo``'s prompt answered greedily with tokens and logprobs, and the output tokens/s
of a batch of ``--batch`` prompts of 1,000 random tokens x 64 output tokens.  The arms'
answers are compared token by token and logprob by logprob.

Writes ``OUT/gpu_engine.json`` (the model's checked SHA-256s, the engine settings, per arm
the device, date, commit, vLLM / torch versions; an arm run later into the same OUT with
the same model and settings joins it) and ``OUT/<arm>.log``.  ``--prompt-json`` gives the pass-key
prompt as token ids (``{"ids": [...], "answer": " 12345.", "answer_ids": [...]}``); without it
the prompt is built here (vllm_dhisparse/needle.py, the demo's seed; its filler text comes from
this Python's standard-library docstrings, so another Python builds another prompt:
``--write-prompt FILE`` here makes ``make demo``'s prompt for a GPU machine's other Python).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the package's demo helpers, installed or not
CAPTURE = re.compile(r"Capturing CUDA graphs \(([^)]*)\)")
OUTPUT_TOKENS, PROMPT_TOKENS = 64, 1000
WARM_TOKENS = 8  # a warm-up shorter than a KV block: no prefix-cache hit for a timed prompt


def vllm_alone() -> dict:
    """The arms' environment: vLLM without this package's plugin (which, installed, would
    register its DeepSeek-V4 class), unless VLLM_PLUGINS says otherwise."""
    return {**os.environ, "VLLM_PLUGINS": os.environ.get("VLLM_PLUGINS", "")}


def engine_kwargs(args) -> dict:
    return dict(max_model_len=16384, max_num_seqs=args.batch, seed=0,
                kv_cache_memory_bytes=args.kv_bytes)


def batch_prompts(n: int) -> list[list[int]]:
    import random
    rng = random.Random(1)
    return [[rng.randrange(3, 512) for _ in range(PROMPT_TOKENS)] for _ in range(n)]


def passkey(args) -> dict:
    if args.prompt_json:
        with open(args.prompt_json) as f:
            return json.load(f)
    from vllm_dhisparse.demo import passkey_prompt
    p = passkey_prompt(args.model, args.prompt_tokens)
    return {"ids": p.ids, "answer": p.answer, "answer_ids": p.answer_ids}


# ------------------------------------------------------------------ the LLM arm (child)
def llm_child(args) -> None:
    """Runs in its own process (vLLM keeps global state); prints ``RESULT {json}``."""
    t0 = time.time()
    from vllm import LLM, SamplingParams
    llm = LLM(model=args.model, **engine_kwargs(args))
    res = {"startup_s": round(time.time() - t0, 1),
           "cudagraph_mode": str(llm.llm_engine.vllm_config.compilation_config.cudagraph_mode)}
    key = passkey(args)
    greedy = SamplingParams(temperature=0.0, max_tokens=len(key["answer_ids"]), logprobs=1)
    out = llm.generate([{"prompt_token_ids": key["ids"]}], greedy)[0].outputs[0]
    res["passkey"] = answer_record(key, list(out.token_ids), out.text,
                                   [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
    prompts = [{"prompt_token_ids": p} for p in batch_prompts(args.batch)]
    fixed = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    warm = {"prompt_token_ids": prompts[0]["prompt_token_ids"][:WARM_TOKENS]}
    llm.generate([warm], SamplingParams(temperature=0.0, max_tokens=2))
    t0 = time.time()
    outs = llm.generate(prompts, fixed)
    res["batch"] = throughput(sum(len(o.outputs[0].token_ids) for o in outs), time.time() - t0,
                              args.batch)
    print("RESULT " + json.dumps(res), flush=True)


def answer_record(key: dict, tokens: list[int], text: str, logprobs: list[float]) -> dict:
    return {"prompt_tokens": len(key["ids"]), "expected": key["answer"], "text": text,
            "tokens": tokens, "logprobs": logprobs,
            "answered": tokens[:len(key["answer_ids"])] == key["answer_ids"]}


def throughput(tokens: int, seconds: float, prompts: int) -> dict:
    return {"prompts": prompts, "prompt_tokens": PROMPT_TOKENS, "output_tokens": tokens,
            "s": round(seconds, 3), "output_tokens_per_s": round(tokens / seconds, 1)}


def run_llm_arm(args, log_path: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child-llm", "--model", args.model,
           "--batch", str(args.batch), "--kv-bytes", str(args.kv_bytes),
           "--prompt-tokens", str(args.prompt_tokens)]
    if args.prompt_json:
        cmd += ["--prompt-json", args.prompt_json]
    from vllm_dhisparse.demo import stop_server
    with open(log_path, "w") as log:
        # its own session, so that a timeout stops vLLM's engine-core child with it
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=vllm_alone(),
                                start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            stop_server(proc)
    text = open(log_path, errors="replace").read()
    found = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"the LLM arm failed (exit {proc.returncode}, {args.timeout:.0f} s "
                         f"allowed); the end of {log_path}:\n{text[-3000:]}")
    return {**json.loads(found[-1][len("RESULT "):]), **captured(text)}


# ------------------------------------------------------------------ the serve arm
def run_serve_arm(args, log_path: str) -> dict:
    from vllm_dhisparse.demo import free_port, stop_server, wait_healthy
    port = free_port()
    kw = engine_kwargs(args)
    # `vllm serve`; through its module so that a staged vLLM (no console script) runs too
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", args.model,
           "--host", "127.0.0.1", "--port", str(port), "--seed", str(kw["seed"]),
           "--max-model-len", str(kw["max_model_len"]), "--max-num-seqs", str(kw["max_num_seqs"]),
           "--kv-cache-memory-bytes", str(kw["kv_cache_memory_bytes"])]
    log = open(log_path, "w")
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=vllm_alone())
    try:
        try:
            wait_healthy(f"http://127.0.0.1:{port}", proc, args.timeout)
        except (RuntimeError, TimeoutError) as e:
            tail = open(log_path, errors="replace").read()[-3000:]
            raise SystemExit(f"vllm serve: {e} ({log_path}):\n{tail}") from None
        res = {"startup_s": round(time.time() - t0, 1), "command": "vllm " + " ".join(cmd[3:])}
        from openai import OpenAI
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        key = passkey(args)
        c = client.completions.create(
            model=args.model, prompt=key["ids"], max_tokens=len(key["answer_ids"]),
            temperature=0.0, logprobs=1, extra_body={"return_tokens_as_token_ids": True})
        choice = c.choices[0]
        tokens = [int(t.split(":", 1)[1]) for t in choice.logprobs.tokens]
        res["passkey"] = answer_record(key, tokens, choice.text, choice.logprobs.token_logprobs)
        res["batch"] = serve_batch(client, args)
    finally:
        stop_server(proc)
        log.close()
    return {**res, **captured(open(log_path, errors="replace").read())}


def serve_batch(client, args) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    def one(ids):
        c = client.completions.create(model=args.model, prompt=ids, max_tokens=OUTPUT_TOKENS,
                                      temperature=0.0, extra_body={"ignore_eos": True})
        return c.usage.completion_tokens

    prompts = batch_prompts(args.batch)
    one(prompts[0][:WARM_TOKENS])
    t0 = time.time()
    with ThreadPoolExecutor(len(prompts)) as pool:
        tokens = sum(pool.map(one, prompts))
    return throughput(tokens, time.time() - t0, args.batch)


# ------------------------------------------------------------------ report
def captured(log_text: str) -> dict:
    """The CUDA graph modes vLLM's capture progress bars name, e.g. "decode, FULL"."""
    modes = sorted(set(CAPTURE.findall(log_text)))
    done = re.search(r"Graph capturing finished in (\d+) secs", log_text)
    return {"cuda_graphs_captured": modes,
            "full_cuda_graphs": any(m.split(",")[-1].strip() == "FULL" for m in modes),
            "graph_capture_s": int(done.group(1)) if done else None}


def meta() -> dict:
    import torch
    import vllm
    m = {"date_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
         "git_commit": os.environ.get("DHISPARSE_COMMIT") or git_commit(),
         "python": platform.python_version(), "torch": torch.__version__,
         "vllm": vllm.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        m["device"] = torch.cuda.get_device_name(0)
    try:
        m["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version",
                                      "--format=csv,noheader"], capture_output=True,
                                     text=True).stdout.strip()
    except OSError:
        pass
    return m


def model_sums(model: str) -> dict | None:
    """The model's SHA256SUMS (file -> digest), every file checked against it first: which
    bytes answered.  None for a model without SHA256SUMS (e.g. a hub name)."""
    path = os.path.join(model, "SHA256SUMS")
    if not os.path.exists(path):
        return None
    from vllm_dhisparse.demo import verified_model
    verified_model(model)
    with open(path) as f:
        return {name.strip().lstrip("*"): digest for digest, name in
                (ln.split(maxsplit=1) for ln in f if ln.strip())}


def git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or None
    except OSError:
        return None


def record(path: str, model: dict, engine: dict) -> dict:
    """The result file's content to add arms to: the existing one when its arms ran the same
    model bytes with the same engine settings, else a new one."""
    if os.path.exists(path):
        with open(path) as f:
            old = json.load(f)
        if old.get("model") == model and old.get("engine") == engine:
            return old
        print(f"[gpu_engine] {path} holds arms of another model or engine settings; starting "
              f"it anew", flush=True)
    return {"model": model, "engine": engine, "arms": {}}


def compare(arms: dict) -> dict | None:
    if "llm" not in arms or "serve" not in arms:
        return None
    a, b = arms["llm"]["passkey"], arms["serve"]["passkey"]
    return {"same_tokens": a["tokens"] == b["tokens"],
            "same_logprobs": a["logprobs"] == b["logprobs"],
            "max_abs_logprob_diff": max((abs(x - y) for x, y in zip(a["logprobs"],
                                                                     b["logprobs"])), default=0)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "needle_v4"))
    ap.add_argument("--arms", default="llm,serve", help="comma-separated: llm, serve")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu_engine_out"))
    ap.add_argument("--prompt-json", default=None, help="the pass-key prompt as token ids")
    ap.add_argument("--write-prompt", default=None, metavar="FILE",
                    help="write the pass-key prompt built here as --prompt-json's file and "
                         "exit (no GPU needed): the prompt of this Python for another machine")
    ap.add_argument("--prompt-tokens", type=int, default=7200, help="pass-key prompt length")
    ap.add_argument("--batch", type=int, default=8, help="prompts in the throughput batch")
    ap.add_argument("--kv-bytes", type=int, default=4 << 30, help="KV cache memory, bytes")
    ap.add_argument("--timeout", type=float, default=900, help="seconds per arm")
    ap.add_argument("--child-llm", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child_llm:
        llm_child(args)
        return 0
    if args.write_prompt:
        with open(args.write_prompt, "w") as f:
            json.dump(passkey(args), f)
        print(f"[gpu_engine] wrote {args.write_prompt}", flush=True)
        return 0
    arms = [a for a in args.arms.split(",") if a]
    unknown = sorted(set(arms) - {"llm", "serve"})
    if unknown:
        ap.error(f"--arms: unknown {unknown}; allowed: llm, serve")
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("gpu_engine.py needs a CUDA GPU (vLLM's GPU engine); on CPU run "
                         "`make demo`")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "gpu_engine.json")
    model = {"path": args.model, "sha256sums": model_sums(args.model)}
    engine = {**engine_kwargs(args), "batch_output_tokens": OUTPUT_TOKENS,
              "other": "vLLM's defaults"}
    result = record(path, model, engine)
    for arm in arms:
        log_path = os.path.join(args.out, f"{arm}.log")
        print(f"[gpu_engine] {arm}: starting (log: {log_path})", flush=True)
        run = run_llm_arm if arm == "llm" else run_serve_arm
        result["arms"][arm] = {"meta": meta(), **run(args, log_path)}
        r = result["arms"][arm]
        verdict = "the pass key" if r["passkey"]["answered"] else "NOT the pass key"
        print(f"[gpu_engine] {arm}: up in {r['startup_s']} s, graphs "
              f"{r['cuda_graphs_captured']}, answer {r['passkey']['text']!r} ({verdict}), "
              f"{r['batch']['output_tokens_per_s']} output tokens/s", flush=True)
        result["llm_vs_serve"] = compare(result["arms"])
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    print(f"[gpu_engine] wrote {path}", flush=True)
    ok = all(r["passkey"]["answered"] and r["full_cuda_graphs"] for r in result["arms"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
