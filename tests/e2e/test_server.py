"""Issue 3, acceptance 2: the OpenAI-compatible server with the connector returns the offline text."""
import json
import os
import subprocess
import sys
import urllib.request

import pytest

from vllm_dhisparse.demo import free_port, server_command, stop_server, wait_healthy

from .conftest import REPO, run_offline

pytestmark = pytest.mark.e2e

HIER = {"hot_cache_rows": 512, "optional_residency": False}


def test_completions_match_offline(demo_model, tmp_path):
    offline = run_offline(demo_model, "--prompt-lens", "700", "--max-tokens", "10",
                          "--connector", json.dumps(HIER))
    from vllm_dhisparse.tools.offline_run import prompt_ids
    ids = prompt_ids(700, 0)
    stats = tmp_path / "stats.json"
    port = free_port()
    cmd = server_command(demo_model, port, {**HIER, "stats_file": str(stats)}, 8192)
    log = open(tmp_path / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                            start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, 600)
        body = json.dumps({"model": demo_model, "prompt": ids, "max_tokens": 10,
                           "temperature": 0.0}).encode()
        req = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            answer = json.load(r)
    except Exception:
        log.flush()
        print(open(tmp_path / "server.log").read()[-5000:], file=sys.stderr)
        raise
    finally:
        stop_server(proc)
    assert answer["choices"][0]["text"] == offline["outputs"][0]["text"]
    totals = json.loads(stats.read_text())["totals"]
    assert totals["host"] > 0 and totals["admissions"] == 1, totals
