"""benchmarks/bench_hierarchy_step.py stays runnable: its smoke shapes on CPU check every
location before they time anything, and a wrong location is reported (exit 1)."""
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_hierarchy_step as B  # noqa: E402


@pytest.mark.parametrize("validate", ["call", "step"])
def test_smoke_run_checks_then_reports(tmp_path, validate):
    pytest.importorskip("matplotlib")
    out = tmp_path / "hs"
    assert B.main(["--smoke", "--batches", "2", "--validate", validate, "--name", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    (point,) = result["points"]
    assert point["errors"] == [] and point["bytes_fetched_per_step"] > 0
    frac = point["resolved_fraction"]
    assert frac["direct"] > 0 and frac["hot"] > 0 and frac["host"] > 0


def test_a_wrong_location_fails_the_run(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    read = B.KVHierarchy.source

    def shifted(self, name):  # every location one row off: the check must say so
        parts = read(self, name)
        pool = parts.pool
        if not getattr(pool, "_shifted", False):
            original = pool.read
            pool.read = lambda locs: original(locs ^ 1)
            pool._shifted = True
        return parts
    monkeypatch.setattr(B.KVHierarchy, "source", shifted)
    assert B.main(["--smoke", "--batches", "2", "--name", str(tmp_path / "hs")]) == 1


def test_invalid_selections_fail_a_run_that_checks_once_per_step(tmp_path, monkeypatch):
    """--validate step resolves without the per-call check: a selection past its
    request's length must still fail the run (through the per-step count)."""
    pytest.importorskip("matplotlib")
    make = B.selections

    def past_the_end(cfg, plan, n_rows, *a):
        sel = make(cfg, plan, n_rows, *a)
        sel[0, 0, 0] = n_rows + 1000
        return sel
    monkeypatch.setattr(B, "selections", past_the_end)
    assert B.main(["--smoke", "--batches", "2", "--validate", "step",
                   "--name", str(tmp_path / "hs")]) == 1
