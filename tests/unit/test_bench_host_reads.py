"""benchmarks/bench_host_reads.py stays runnable: on CPU every kind of host memory is
allocated and every gathered byte is checked (timing needs the GPU)."""
import json
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import bench_host_reads as B  # noqa: E402


def test_smoke_run_checks_every_kind(tmp_path):
    out = tmp_path / "hr"
    assert B.main(["--smoke", "--name", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    assert [k["kind"] for k in result["kinds"]] == list(B.KINDS)
    assert all(k["errors"] == [] and len(k["cells"]) == 2 for k in result["kinds"])


def test_misses_stay_inside_their_request_extent_in_host_order():
    src = B.misses(n_rows=800, requests=8, batch=4, rows=5, seed=0)  # extents of 100 rows
    assert src.shape == (4, 5)
    for i, row in enumerate(src.tolist()):
        first = (i * 8 // 4) * 100
        assert row == sorted(row) and len(set(row)) == 5
        assert all(first <= r < first + 100 for r in row)
    assert torch.equal(src, B.misses(800, 8, 4, 5, seed=0))
