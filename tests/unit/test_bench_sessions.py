"""benchmarks/bench_sessions.py stays runnable: on CPU its smoke shapes admit sessions
into a byte budget, and the counts it finds are the ones the sizing model predicts
(the ledger counts the hierarchy's real tensors, so a change in what a session holds
on the device shows up here)."""
import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_sessions as B  # noqa: E402


def test_smoke_counts_match_the_sizing_model(tmp_path):
    host_buffer, check = B.HS.host_buffer, B.HH.check_host_memory
    out = tmp_path / "sessions"
    assert B.main(["--smoke", "--name", str(out)]) == 0
    r = json.loads(out.with_suffix(".json").read_text())
    assert r["resident_sessions"] == r["predicted_sessions"]["resident"] > 0
    assert r["hierarchy_sessions"] == r["predicted_sessions"]["adaptive"] > r["resident_sessions"]
    h = r["hierarchy"]
    assert h["device_bytes"] == h["sessions"] * r["predicted_bytes_per_session"]["adaptive"]
    assert h["metadata_bytes_per_session"] == r["predicted_metadata_bytes_per_session"]
    # the virtual host rows are the benchmark's own: nothing else sees them afterwards
    assert (B.HS.host_buffer, B.HH.check_host_memory) == (host_buffer, check)
