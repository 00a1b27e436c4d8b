"""The OpenAI-compatible server with the connector returns what the same server returns
without it (RESIDENT serving): text and per-token logprobs, under vLLM's default
scheduling (prefix caching and chunked prefill as the platform sets them).

Two requests, one after the other (a server batches concurrent requests as they
happen to arrive, and vLLM's dense layers are not batch-invariant on CPU): a
2400-token prompt (600 compressed rows, more than B = k = 512, so host fetches
happen) and a 700-token one.
"""
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from vllm_dhisparse.demo import free_port, server_command, server_env, stop_server, wait_healthy

from .conftest import REPO

pytestmark = pytest.mark.e2e

HIER = {"hot_cache_rows": 512, "optional_residency": False}
PROMPTS = ((2400, 0), (700, 1))  # (length, seed)
MAX_TOKENS = 10


def serve_and_ask(model: str, extra: dict | None, tmp_path, name: str) -> list[dict]:
    from vllm_dhisparse.tools.offline_run import prompt_ids
    port = free_port()
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen(server_command(model, port, extra, 8192), stdout=log,
                            stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True,
                            env=server_env())  # both arms on one thread count
    answers: list = [None] * len(PROMPTS)

    def ask(i, n, seed):
        body = json.dumps({"model": model, "prompt": prompt_ids(n, seed),
                           "max_tokens": MAX_TOKENS, "temperature": 0.0,
                           "logprobs": 1}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            answers[i] = json.load(r)["choices"][0]
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 600)
        for i, (n, seed) in enumerate(PROMPTS):
            ask(i, n, seed)
        return answers
    except Exception:
        log.flush()
        print(open(tmp_path / f"{name}.log").read()[-5000:], file=sys.stderr)
        raise
    finally:
        stop_server(proc)


def test_completions_match_resident_server(demo_model, tmp_path):
    resident = serve_and_ask(demo_model, None, tmp_path, "resident")
    stats = tmp_path / "stats.json"
    got = serve_and_ask(demo_model, {**HIER, "stats_file": str(stats)}, tmp_path, "connector")
    for i, (g, w) in enumerate(zip(got, resident)):
        assert g["text"] == w["text"], (i, g["text"], w["text"])
        assert g["logprobs"]["token_logprobs"] == w["logprobs"]["token_logprobs"], \
            (i, g["logprobs"]["token_logprobs"], w["logprobs"]["token_logprobs"])
    totals = json.loads(stats.read_text())["totals"]
    assert totals["host"] > 0 and totals["admissions"] == len(PROMPTS), totals
