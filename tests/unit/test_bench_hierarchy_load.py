"""benchmarks/bench_hierarchy_load.py stays runnable and checks what it times: on CPU its
smoke shapes go through a burst that reclaims and a drain that repopulates, and a
reclaim that loses rows fails the run."""
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_hierarchy_load as B  # noqa: E402


def test_smoke_run_reclaims_then_repopulates(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "hl"
    assert B.main(["--smoke", "--name", str(out)]) == 0
    r = json.loads(out.with_suffix(".json").read_text())
    assert r["errors"] == []
    assert len(r["admissions"]) == r["config"]["burst"]
    assert all(a["pages_reclaimed"] > 0 and a["bytes_to_host"] > 0 for a in r["admissions"])
    cov = r["coverage"]
    assert cov["after_burst"] < cov["base"] <= cov["end"]
    assert r["drain_steps_to_recover"] is not None
    assert sum(x["pages_repopulated"] for x in r["records"] if x["phase"] == "drain") > 0
    phases = {x["phase"] for x in r["records"] if x["checked"]}
    assert phases == {"base", "burst", "drain"}  # every phase has checked steps


def test_a_reclaim_that_skips_its_backups_fails_the_run(tmp_path, monkeypatch):
    """Deferred backups skipped: the victims' rows are read from host rows never written."""
    pytest.importorskip("matplotlib")
    from vllm_dhisparse.hierarchy.residency import ResidencyManager
    monkeypatch.setattr(ResidencyManager, "_unbacked", lambda self, rec: [])
    assert B.main(["--smoke", "--name", str(tmp_path / "hl")]) == 1
    r = json.loads((tmp_path / "hl.json").read_text())
    assert any("wrong bytes" in e for e in r["errors"]), r["errors"]
