"""The connector inside vLLM's GPU engine, exact against resident serving (``make test-gpu``).

Runs ``scripts/gpu_connector.py`` (four engines: resident and connector through ``LLM`` and
through ``vllm serve``) and asserts every scenario's tokens and logprobs equal resident's,
bit for bit, and vLLM's equal to themselves.  Needs a CUDA GPU (SM90 / SM100) and vLLM 0.33;
skipped elsewhere (the H200's result is committed under benchmarks/results/).
"""
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="needs a CUDA GPU of compute capability 9.x or 10.x")]


def test_connector_equals_resident_in_every_scenario(tmp_path):
    vllm = pytest.importorskip("vllm")
    if not vllm.__version__.startswith("0.33"):
        pytest.skip(f"needs vLLM 0.33, found {vllm.__version__}")
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gpu_connector.py"),
                           "--out", str(tmp_path)], capture_output=True, text=True,
                          timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads((tmp_path / "gpu_connector.json").read_text())
    cmp = doc["comparisons"]
    assert cmp["resident_vs_itself"]["identical"], cmp["resident_vs_itself"]
    for pair in ("connector_vs_resident", "serve_connector_vs_resident"):
        bad = {s: c for s, c in cmp[pair].items() if not c["identical"]}
        assert not bad, (pair, bad)
    census = doc["arms"]["connector"]["scenarios"]["batch"]["census"]
    assert census["host"] >= 0.3 * (census["direct"] + census["hot"] + census["host"]), census
    assert doc["arms"]["connector"]["scenarios"]["passkey"]["answered"]
