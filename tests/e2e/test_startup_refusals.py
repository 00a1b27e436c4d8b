"""Start-up mistakes are refused with an error that names the key or value and what is
allowed, before any request is served.

Configuration, model and platform refusals happen where vLLM builds the connector
(``refusal_probe.py`` builds vLLM's real engine config for the demo model); the pool
sizes are only known once vLLM profiles its memory, so a pool refusal starts an engine:
one here shows such a refusal stops start-up with its message (the sizing rules'
messages, ``device_pool_pages`` among them: ``tests/unit/test_pool_sizing.py``).
"""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from .conftest import INPROC, REPO

pytestmark = pytest.mark.e2e


def test_config_model_and_platform_refusals(demo_model, tmp_path):
    bare = tmp_path / "no_indexer"
    shutil.copytree(demo_model, bare)
    cfg = json.loads((bare / "config.json").read_text())
    del cfg["index_topk"]
    (bare / "config.json").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "tests", "e2e", "refusal_probe.py"),
                           demo_model, str(bare)], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    line = [x for x in proc.stdout.splitlines() if x.startswith("REFUSALS ")]
    assert line, proc.stdout[-2000:] + proc.stderr[-4000:]
    got = json.loads(line[0][len("REFUSALS "):])
    assert got["accepted"] == "accepted", got
    assert re.search(r"'host_pool_gib'\] = nan: must be a finite number", got["nan"]), got
    assert re.search(r"'host_pool_gib'\] = inf: must be a finite number", got["inf"]), got
    assert re.search(r"needs a model with a sparse-attention indexer \(config 'index_topk'\)",
                     got["no_indexer"]), got
    assert re.search(r"CUDA compute capability 8\.0 is not supported.*SM90 \(H100 / H200\)",
                     got["platform"]), got
    assert re.search(r"scheduler_cls is None, needs 'vllm_dhisparse\.integration\.engine_core\."
                     r"scheduler\.DHiSparseScheduler' \(--scheduler-cls\).*worker_cls is "
                     r"'vllm\.v1\.worker\.cpu_worker\.CPUWorker', needs", got["no_classes"]), got
    assert re.search(r"max_num_scheduled_tokens \(1024\) is smaller than max_model_len \(4096\) "
                     r"with chunked prefill off.*--max-num-scheduled-tokens to at least 4096",
                     got["step_budget"]), got


def test_pool_size_refusal_stops_start_up(demo_model):
    extra = {"host_pool_gib": 0.0001}
    needle = (r"'host_pool_gib'\] = 0.0001 holds \d+ rows per sparse layer, "
              r"fewer than one request of max_model_len 4096 needs")
    cmd = [sys.executable, "-m", "harness.offline_run", "--model", demo_model,
           "--prompt-lens", "300", "--max-tokens", "1", "--max-model-len", "4096",
           "--connector", json.dumps(extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=REPO,
                          env={**os.environ, **INPROC})
    assert proc.returncode != 0 and "DHISPARSE_RESULT" not in proc.stdout
    assert re.search(needle, proc.stderr), proc.stderr[-4000:]
