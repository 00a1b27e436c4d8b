"""CI smoke of benchmarks/load_step.py (the full run is committed under
benchmarks/results/load_step.{json,csv,png}).

Offered concurrency 1 -> 3 -> 1, residency on vs off, same build, same step-based
arrivals.  Outputs must be identical between the arms; with residency on the
low phases fetch (far) fewer selected rows from host than with it off; coverage
falls below 1 under pressure and is back at 1 at the end.
"""
import json
import os
import subprocess
import sys

import pytest

from .conftest import REPO

pytestmark = pytest.mark.e2e


def test_load_step_smoke(demo_model, tmp_path):
    out = str(tmp_path / "load_step")
    cmd = [sys.executable, os.path.join(REPO, "benchmarks", "load_step.py"), "--model", demo_model,
           "--out", out, "--concurrency", "1", "3", "1", "--phase-steps", "10",
           "--prompt-len", "2200", "--max-tokens", "8", "--max-num-seqs", "3",
           "--device-pool-pages", "43"]  # 3 x 11 required + 10 optional (one 9-page history)
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.load(open(out + ".json"))
    s = res["summary"]
    assert s["outputs_identical_on_vs_off"]
    low = s["phases"]["0"]
    assert low["host_share_off"] and low["host_share_off"] >= 5 * (low["host_share_on"] or 0), s
    assert s["phases"]["1"]["min_coverage_on"] < 1, s
    assert res["arms"]["on"]["phases"]["2"]["last_coverage"] == 1, s
    assert os.path.getsize(out + ".png") > 0
