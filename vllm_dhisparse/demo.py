"""The main job: serve a model with the DHiSparse connector and send it one request.

    python -m vllm_dhisparse.demo                  # built-in tiny DeepSeek-V4 model, CPU
    python -m vllm_dhisparse.demo --model DIR      # your model (a GPU machine with vllm==0.33)

Steps, each announced: build the demo model (no downloads), start vLLM's
OpenAI-compatible server on 127.0.0.1 with ``DHiSparseConnector``, wait for
it to be healthy, send one ``/v1/completions`` request, print the answer and
the connector's counters (selections resolved direct / hot / host, rows and
bytes fetched from host), stop the server.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _say(msg: str) -> None:
    print(f"[dhisparse demo] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build_demo_model(out: str) -> str:
    script = os.path.join(REPO, "scripts", "build_demo_model.py")
    subprocess.run([sys.executable, script, "--out", out], check=True)
    return out


def server_command(model: str, port: int, extra: dict | None, max_model_len: int) -> list[str]:
    """vLLM's OpenAI server on 127.0.0.1; ``extra`` = the connector's extra config, or
    None for resident serving (the same server without the connector)."""
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
           "--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(max_model_len),
           "--seed", "0"]
    if extra is not None:
        transfer = {"kv_connector": "DHiSparseConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": extra}
        cmd += ["--kv-transfer-config", json.dumps(transfer)]
    if _on_cpu():
        cmd += ["--enforce-eager", "--block-size", "256", "--gpu-memory-utilization", "0.2",
                "--max-num-seqs", "8"]
    return cmd


def spec_args(model: str, preset: str, extra: dict) -> list[str]:
    """Builds the demo drafter next to ``model`` and returns the server's speculative
    arguments; ``extra`` (the connector's config) is told the preset (``spec`` key)."""
    from vllm_dhisparse.spec import SpecPreset
    drafter = os.path.join(os.path.dirname(os.path.abspath(model)), f"demo_{preset}_drafter")
    _say(f"building the {preset} demo drafter in {drafter}")
    subprocess.run([sys.executable, os.path.join(REPO, "scripts", "build_demo_drafters.py"),
                    preset, "--target", model, "--out", drafter], check=True)
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
                       "temperature": 0.0}).encode()
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model directory or name; default: built-in demo model")
    ap.add_argument("--demo-dir", default=os.path.join(REPO, "demo_model"),
                    help="where the built-in demo model is built (default: ./demo_model)")
    ap.add_argument("--prompt-words", type=int, default=700,
                    help="length of the demo prompt in words (long enough for host fetches)")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--extra-config", default='{"hot_cache_rows": 512, "optional_residency": false}',
                    help="kv_connector_extra_config JSON (see README for the keys)")
    ap.add_argument("--timeout", type=float, default=900, help="seconds to wait for the server")
    ap.add_argument("--spec", choices=("dflash2",), default=None,
                    help="speculative decoding with a seeded DFlash2 drafter built next to the "
                         "demo model (window 128, K = 3; Model Runner V2). Its drafts are noise "
                         "and get rejected: the demo shows the path, tests/e2e/"
                         "test_spec_hierarchy.py shows acceptance with the DSpark oracle")
    args = ap.parse_args(argv)

    model = args.model
    if model is None:
        _say(f"building the demo model in {args.demo_dir}")
        model = build_demo_model(args.demo_dir)
    stats_file = os.path.join(tempfile.mkdtemp(prefix="dhisparse-demo-"), "stats.json")
    extra = dict(json.loads(args.extra_config), stats_file=stats_file)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    spec_cmd = spec_args(model, args.spec, extra) if args.spec else []
    cmd = server_command(model, port, extra, args.max_model_len) + spec_cmd
    env = dict(os.environ)
    if args.spec:
        env["VLLM_USE_V2_MODEL_RUNNER"] = "1"  # the only runner with DFlash2 / DSpark
    _say("starting: " + " ".join(cmd[:6]) + " ... (log: server.log)")
    log = open(os.path.join(os.path.dirname(stats_file), "server.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=env)
    try:
        t0 = time.time()
        wait_healthy(url, proc, args.timeout)
        _say(f"server healthy after {time.time() - t0:.0f} s at {url}")
        words = ("the hierarchy keeps every row of history in host memory and only the "
                 "selected rows reach attention").split()
        prompt = " ".join(words[i % len(words)] for i in range(args.prompt_words))
        _say(f"sending one /v1/completions request ({args.prompt_words} words)")
        t0 = time.time()
        answer = complete(url, model, prompt, args.max_tokens)
        _say(f"answer after {time.time() - t0:.1f} s: {answer['choices'][0]['text']!r}")
        time.sleep(0.5)
        if os.path.exists(stats_file):
            with open(stats_file) as f:
                stats = json.load(f)
            _say("connector counters: " + ", ".join(f"{k}={v}" for k, v in stats["totals"].items()))
            if "spec" in stats:
                _say("speculation: " + ", ".join(f"{k}={v}" for k, v in stats["spec"].items()))
        else:
            _say("no connector counters were written (no decode step went through the hierarchy)")
        return 0
    except Exception:
        log.flush()
        with open(log.name) as f:
            tail = f.read()[-4000:]
        print(tail, file=sys.stderr)
        raise
    finally:
        stop_server(proc)


if __name__ == "__main__":
    sys.exit(main())
