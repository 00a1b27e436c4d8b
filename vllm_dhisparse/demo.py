"""The main job: the same prompt served without and with the DHiSparse connector.

    python -m vllm_dhisparse.demo                  # the trained passkey model, CPU
    python -m vllm_dhisparse.demo --model DIR      # your model (a GPU machine with vllm==0.33)

Steps, each announced: check the trained tiny DeepSeek-V4 in ``models/needle_v4``
against its SHA256SUMS (no downloads); build a prompt of about 7,200 tokens that hides a five-digit
pass key among distractor keys (vllm_dhisparse/needle.py) and asks for it at the end;
start vLLM's OpenAI-compatible server on 127.0.0.1 without the connector (RESIDENT
serving), send the prompt as one greedy ``/v1/completions`` request with logprobs, stop
it; start the same server with ``DHiSparseConnector``, send the same request, stop it;
then print both answers next to the pass key, compare them token by token and logprob by
logprob, and say where the rows attention read came from (selections resolved direct /
through the hot cache / from host, rows and bytes fetched from host).  Exit code 1 if
the answers differ.  With ``--model`` the prompt is a repeated sentence and the
comparison is the point.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # a clone, if run from one


def _say(msg: str) -> None:
    print(f"[dhisparse demo] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TRAINED = os.path.join(REPO, "models", "needle_v4")
NEEDLE_SEED, NEEDLE_DEPTH = 11, 0.35  # the demo's prompt: its key, distractors and filler


def build_demo_model(out: str) -> str:
    subprocess.run([sys.executable, "-m", "vllm_dhisparse.demo_build.model", "--out", out],
                   check=True)
    return out


def verified_model(path: str = TRAINED) -> str:
    """The committed trained model, every file its SHA256SUMS lists checked."""
    import hashlib
    sums = os.path.join(path, "SHA256SUMS")
    if not os.path.exists(sums):
        raise SystemExit(f"{sums} is missing: the trained model ships with the repository, "
                         f"not with the installed package. From a clone run `git checkout -- "
                         f"models`; elsewhere pass --random-model (built here) or --model DIR")
    with open(sums) as f:
        for line in filter(None, (ln.strip() for ln in f)):
            digest, name = line.split(maxsplit=1)
            file, h = os.path.join(path, name.lstrip("*")), hashlib.sha256()
            if not os.path.exists(file):
                raise SystemExit(f"{path}/{name} is missing; restore it with `git checkout -- "
                                 f"models`")
            with open(file, "rb") as g:
                for chunk in iter(lambda: g.read(1 << 20), b""):
                    h.update(chunk)
            if h.hexdigest() != digest:
                raise SystemExit(f"{path}/{name}: SHA-256 {h.hexdigest()} does not match "
                                 f"SHA256SUMS ({digest}); restore it with `git checkout -- "
                                 f"models`")
    return path


def passkey_prompt(model: str, tokens: int):
    """needle.py's prompt of about ``tokens`` tokens (the demo's seed)."""
    import random

    from vllm_dhisparse import needle
    return needle.make(needle.tokenizer(model), tokens, random.Random(NEEDLE_SEED),
                       depth=NEEDLE_DEPTH)


def server_command(model: str, port: int, extra: dict | None, max_model_len: int) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1; ``extra`` = the connector's extra config, or
    None for resident serving (the same server without the connector)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port)]
    if extra is not None:
        from vllm_dhisparse.engine_args import server_args as connector_args
        cmd += connector_args(extra)
    return cmd + server_args(max_model_len)


def server_args(max_model_len: int) -> list[str]:
    """The demo and test servers' engine arguments, both arms alike: vLLM's defaults on GPUs
    (CUDA graphs); on CPU eager, 256-token blocks and 1 GiB of KV memory (in bytes, since a
    fraction of RAM is less the worker's resident memory, which varies from machine to
    machine)."""
    args = ["--max-model-len", str(max_model_len), "--seed", "0"]
    if _on_cpu():
        args += ["--enforce-eager", "--block-size", "256", "--kv-cache-memory-bytes", "1G",
                 "--max-num-seqs", "8"]
    return args


def spec_args(model: str, preset: str, extra: dict) -> list[str]:
    """Builds the demo drafter next to ``model`` and returns the server's speculative
    arguments; ``extra`` (the connector's config) is told the preset (``spec`` key)."""
    from vllm_dhisparse.spec import SpecPreset
    drafter = os.path.join(os.path.dirname(os.path.abspath(model)), f"demo_{preset}_drafter")
    _say(f"building the {preset} demo drafter in {drafter}")
    subprocess.run([sys.executable, "-m", "vllm_dhisparse.demo_build.drafters", preset,
                    "--target", model, "--out", drafter], check=True)
    extra["spec"] = preset
    config = SpecPreset(preset, drafter, 3).speculative_config()
    return ["--speculative-config", json.dumps(config)]


def _on_cpu() -> bool:
    import torch
    return not torch.cuda.is_available()


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1)
    raise TimeoutError(f"server not healthy after {timeout_s:.0f} s")


def complete(url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "logprobs": 1}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's whole process group (its engine core runs in a child)."""
    import signal
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def serve_once(model: str, extra: dict | None, spec_cmd: list, env: dict, prompt: str,
               args, log_path: str, label: str) -> dict:
    """Starts one server (``extra`` None: without the connector), sends the prompt,
    stops it; returns the completion's first choice."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = server_command(model, port, extra, args.max_model_len) + spec_cmd
    _say(f"{label}: starting " + " ".join(cmd[:6]) + f" ... (log: {log_path})")
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    try:
        t0 = time.time()
        wait_healthy(url, proc, args.timeout)
        _say(f"{label}: server healthy after {time.time() - t0:.0f} s; sending the prompt")
        t0 = time.time()
        body = complete(url, model, prompt, args.max_tokens)
        choice = body["choices"][0]
        _say(f"{label}: answer after {time.time() - t0:.1f} s "
             f"({body['usage']['prompt_tokens']} prompt tokens): {choice['text']!r}")
        return choice
    except Exception:
        log.flush()
        with open(log_path) as f:
            print(f.read()[-4000:], file=sys.stderr)
        raise
    finally:
        stop_server(proc)


def compare(resident: dict, connector: dict) -> bool:
    """Says whether the two answers are the same tokens and logprobs; True if so."""
    a, b = resident["logprobs"], connector["logprobs"]
    same_tokens = a["tokens"] == b["tokens"]
    diffs = [abs(x - y) for x, y in zip(a["token_logprobs"], b["token_logprobs"])
             if x is not None and y is not None]
    worst = max(diffs, default=0.0)
    _say(f"compared: {len(a['tokens'])} tokens, "
         + ("identical" if same_tokens else "DIFFERENT") + " tokens; "
         + ("logprobs bit-identical" if worst == 0.0 else
            f"logprobs NOT bit-identical (largest difference {worst:.3g}, first at token "
            f"{next(i for i, d in enumerate(diffs) if d)})"))
    return same_tokens


def where_rows_came_from(stats: dict) -> None:
    t = stats["totals"]
    selected = t.get("direct", 0) + t.get("hot", 0) + t.get("host", 0)
    if selected:
        _say(f"rows attention read through the hierarchy: {selected} selections, "
             f"{t['direct'] / selected:.0%} direct (tail, resident history), "
             f"{t['hot'] / selected:.0%} hot cache, {t['host'] / selected:.0%} from host; "
             f"{t.get('fetched', 0)} rows ({t.get('bytes_fetched', 0)} bytes) copied from host")
    _say("connector counters: " + ", ".join(f"{k}={v}" for k, v in t.items()))
    if "spec" in stats:
        _say("speculation: " + ", ".join(f"{k}={v}" for k, v in stats["spec"].items()))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None,
                    help="model directory or name; default: the trained passkey model "
                         "(models/needle_v4)")
    ap.add_argument("--random-model", action="store_true",
                    help="the seeded random demo model instead (built in --demo-dir; its "
                         "text is noise)")
    ap.add_argument("--demo-dir", default=None,
                    help="where the random demo model is built (default: demo_model in the "
                         "repository when run from a clone, else in the current directory)")
    ap.add_argument("--prompt-tokens", type=int, default=7200,
                    help="length of the passkey prompt (the trained model)")
    ap.add_argument("--prompt-words", type=int, default=700,
                    help="length of the prompt for --model / --random-model, in words")
    ap.add_argument("--max-tokens", type=int, default=None,
                    help="tokens to generate (default: the pass key's, else 24)")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--extra-config", default='{"hot_cache_rows": 512, "optional_residency": false}',
                    help="kv_connector_extra_config JSON (see README for the keys)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for each server")
    ap.add_argument("--no-compare", action="store_true",
                    help="serve with the connector only (skip the RESIDENT server)")
    ap.add_argument("--spec", choices=("dflash2",), default=None,
                    help="speculative decoding with a seeded DFlash2 drafter built next to the "
                         "demo model (window 128, K = 3; Model Runner V2). Its drafts are noise "
                         "and get rejected: the demo shows the path, tests/e2e/"
                         "test_spec_hierarchy.py shows acceptance with the DSpark oracle")
    args = ap.parse_args(argv)

    model, needle = args.model, None
    if args.demo_dir is None:
        clone = os.path.exists(os.path.join(REPO, "setup.py"))
        args.demo_dir = os.path.join(REPO if clone else os.getcwd(), "demo_model")
    if model is None and args.random_model:
        _say(f"building the random demo model in {args.demo_dir}")
        model = build_demo_model(args.demo_dir)
    elif model is None:
        _say(f"checking the trained passkey model in {TRAINED} against its SHA256SUMS")
        model = verified_model()
        needle = passkey_prompt(model, args.prompt_tokens)
        _say(f"prompt: {len(needle.ids)} tokens of filler text with the pass key "
             f"{needle.answer.strip(' .')} at token {needle.needle_token} and 3 distractor "
             f"keys; it ends {needle.text[-60:]!r}")
    if args.max_tokens is None:
        args.max_tokens = len(needle.answer_ids) if needle else 24
    work = tempfile.mkdtemp(prefix="dhisparse-demo-")
    stats_file = os.path.join(work, "stats.json")
    extra = dict(json.loads(args.extra_config), stats_file=stats_file)
    # the same drafter in both arms; only the connector's config names the preset
    spec_cmd = spec_args(model, args.spec, extra) if args.spec else []
    env = dict(os.environ)
    if args.spec:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the only runner with DFlash2 / DSpark
    words = ("the hierarchy keeps every row of history in host memory and only the "
             "selected rows reach attention").split()
    prompt = needle.text if needle else " ".join(words[i % len(words)]
                                                 for i in range(args.prompt_words))
    resident = None
    if not args.no_compare:
        resident = serve_once(model, None, spec_cmd, env, prompt, args,
                              os.path.join(work, "server_resident.log"), "without the connector")
    connector = serve_once(model, extra, spec_cmd, env, prompt, args,
                           os.path.join(work, "server_connector.log"), "with DHiSparseConnector")
    if os.path.exists(stats_file):
        with open(stats_file) as f:
            where_rows_came_from(json.load(f))
    else:
        _say("no connector counters were written (no decode step went through the hierarchy)")
    if needle is not None:
        for label, choice in (("without the connector", resident), ("with the connector", connector)):
            if choice is not None:
                verdict = "the pass key" if choice["text"] == needle.answer else "NOT the pass key"
                _say(f"{label}: {choice['text']!r} is {verdict} ({needle.answer!r})")
    if resident is not None and not compare(resident, connector):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
