"""benchmarks/profile_hierarchy_load.py stays runnable: on CPU it profiles the smoke run's
burst admissions and drain steps and names the hierarchy's functions in both."""
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import profile_hierarchy_load as P  # noqa: E402


def test_smoke_profile_attributes_admissions_and_drain(tmp_path):
    out = tmp_path / "pl"
    assert P.main(["--smoke", "--name", str(out)]) == 0
    text = Path(f"{out}.txt").read_text()
    admission, drain = text.split("## drain, cumulative")
    assert "hierarchy.py" in admission and "(admit)" in admission
    assert "(step)" in drain and "## slowest drain step() calls" in drain
