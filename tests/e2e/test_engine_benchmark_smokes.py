"""The engine benchmarks stay runnable: ``kv_layout``, ``multi_turn``, ``cpu_server``,
``needle``, ``cpu_step_parts`` and ``spec_memory`` each in its ``--smoke`` mode (tiny
shapes), all at once.

They start vLLM (two engines, three engines, two servers, three engines, two, two), and
``cpu_server``'s servers use one core each and wait on their starts much of the time, so
running them side by side costs less than one after another.  Each smoke checks something
and exits 1 when it does not hold: ``kv_layout`` its layout against the ledger's latest
result (strides and groups, exact: vLLM's bookkeeping, not a timing), ``multi_turn`` every
arm's tokens against resident serving's, ``cpu_server`` that every request got all its
tokens, ``needle`` that resident serving answers a 4K-token pass-key prompt, the
connector's tokens and logprobs equal resident's and the scrambled-map control does not
answer, ``cpu_step_parts`` that each arm timed every part the ledger's latest result timed
(a part no longer called, or a method that moved, fails it), ``spec_memory`` that DFlash2
with the hierarchy gives resident's tokens, its draft ring holds at most R_d / p blocks per
request and its staging stays within M_stage.  Timings on CI's CPU mean
nothing and are not read.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from .conftest import REPO

pytestmark = pytest.mark.e2e

BENCH = os.path.join(REPO, "benchmarks")


def test_engine_benchmark_smokes(demo_model, tmp_path):
    runs = {
        "kv_layout": ([], "the layout equals the ledger's latest kv_layout result"),
        "multi_turn": (["--model", demo_model, "--out", str(tmp_path / "mt")],
                       "every arm's tokens equal resident serving's"),
        "cpu_server": (["--model", demo_model, "--out", str(tmp_path / "cs")],
                       "every request got all its tokens"),
        "needle": (["--out", str(tmp_path / "needle" / "n")],
                   "resident answers, the connector equals it, the control falls"),
        "cpu_step_parts": (["--model", demo_model],
                           "every part of the ledger's latest result was timed"),
        "spec_memory": (["--model", demo_model, "--out", str(tmp_path / "sm")],
                        "tokens equal, the draft ring and staging within their bounds"),
    }
    procs, failed = {}, {}
    deadline = time.monotonic() + 1500
    try:
        for name, (args, _) in runs.items():
            with open(tmp_path / f"{name}.log", "w") as log:  # the child keeps its own copy
                procs[name] = subprocess.Popen(
                    [sys.executable, os.path.join(BENCH, f"{name}.py"), "--smoke", *args],
                    stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path, start_new_session=True)
        for name, proc in procs.items():
            try:
                rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                rc = "timeout"
            text = (tmp_path / f"{name}.log").read_text()
            if rc != 0 or f"CHECK: {runs[name][1]}" not in text:
                failed[name] = f"rc {rc}\n{text[-3000:]}"
    finally:
        # SIGINT first: cpu_server stops its servers (their own sessions) on the way out
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert not failed, "\n\n".join(f"{k}: {v}" for k, v in failed.items())
    for stem in ("mt", "cs", "needle/n", "sm"):
        assert (tmp_path / f"{stem}.json").stat().st_size > 0
        assert (tmp_path / f"{stem}.png").stat().st_size > 0
