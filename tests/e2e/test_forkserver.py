"""The fork server (forkserver.py) runs what a fresh ``python -m harness.offline_run``
process runs: the same outputs, bit for bit, and the same connector counters; a run past
its timeout is killed and the server serves the next run."""
import json
import subprocess

import pytest

from . import conftest
from .conftest import assert_same_outputs, run_offline

pytestmark = pytest.mark.e2e

ARGS = ("--prompt-lens", "600", "2600", "--max-tokens", "6",
        "--connector", json.dumps({"hot_cache_rows": 512, "optional_residency": False}))


def test_a_forked_run_equals_a_fresh_process(demo_model, monkeypatch):
    monkeypatch.setattr(conftest, "FORKSERVER", False)
    fresh = run_offline(demo_model, *ARGS)
    monkeypatch.setattr(conftest, "FORKSERVER", True)
    forked = run_offline(demo_model, *ARGS)
    assert_same_outputs(forked, fresh)
    got, want = forked["stats"]["totals"], fresh["stats"]["totals"]
    assert want["host"] > 0  # the small hot cache missed: the hierarchy served rows
    for key in ("selected", "direct", "hot", "host", "admissions", "finished"):
        assert got[key] == want[key], (key, got, want)


def test_a_run_past_its_timeout_is_killed_and_the_server_serves_on(demo_model):
    with pytest.raises(subprocess.TimeoutExpired):
        run_offline(demo_model, "--prompt-lens", "3000", "--max-tokens", "64", timeout=2)
    got = run_offline(demo_model, "--prompt-lens", "300", "--max-tokens", "2")
    assert len(got["outputs"]) == 1 and len(got["outputs"][0]["token_ids"]) == 2
