"""The kernel benchmarks without a test of their own stay runnable: each one's ``--smoke``
mode (tiny shapes, Triton's interpreter on CPU) runs and checks its results against the
torch reference.  Timings on CPU mean nothing; the check is what fails."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.parametrize("script,args,says", [
    ("bench_gather.py", ["--name", "{tmp}/g"], "CORRECTNESS: every gather matched"),
    ("bench_sglang.py", ["--name", "{tmp}/s"], ""),
    ("profile_resolve.py", [], "check exact match"),
    ("bench_resolve.py", ["--name", "{tmp}/r"], "CORRECTNESS: all configurations match"),
    # every resolve variant on the smaller SGLang cell and the no-miss cells
    ("tune_resolve.py", ["--batches", "2", "--out", "{tmp}"], "FAILURES: none"),
    ("tune_chunks.py", ["{tmp}/c.json"], "CORRECTNESS: every variant matches"),
    # the GPU one's resolve + gather checks at tiny sizes, one configuration and its
    # corrupted-tables call (gpu_fmla_decode / gpu_fmla_routed: test_fmla_*.py run --small)
    ("gpu_correctness.py", ["--out", "{tmp}/gc.json"], "1/1 configurations passed"),
])
def test_smoke_mode_runs_and_checks(tmp_path, script, args, says):
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    got = subprocess.run([sys.executable, str(BENCH / script), "--smoke",
                          *(a.format(tmp=tmp_path) for a in args)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert got.returncode == 0, got.stdout[-2000:] + got.stderr[-3000:]
    assert says in got.stdout, got.stdout[-2000:]
    if script == "bench_sglang.py":  # its JSON lists what did not match the reference
        doc = json.loads((tmp_path / "s.json").read_text())
        assert doc["correctness_failures"] == [] and doc["points"], doc["correctness_failures"]


def _numbers(doc, path=""):
    """Every number of a JSON document by its path."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _numbers(v, f"{path}/{k}")
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield from _numbers(v, f"{path}/{i}")
    elif isinstance(doc, (int, float)) and not isinstance(doc, bool):
        yield path, doc


def test_memory_accounting_equals_its_committed_result(tmp_path):
    """The per-session memory the README and docs quote is computed, not measured, so the
    committed result must still be what the sizing code gives, within 0.1 % a number."""
    out = tmp_path / "m.json"
    got = subprocess.run([sys.executable, str(BENCH / "memory_accounting.py"), "--out", str(out)],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert got.returncode == 0, got.stderr[-3000:]
    new = dict(_numbers({k: v for k, v in json.loads(out.read_text()).items() if k != "meta"}))
    committed = json.loads((BENCH / "results" / "memory_accounting.json").read_text())
    old = dict(_numbers({k: v for k, v in committed.items() if k != "meta"}))
    assert new.keys() == old.keys(), sorted(new.keys() ^ old.keys())
    off = {p: (old[p], new[p]) for p in new if abs(new[p] - old[p]) > 1e-3 * max(abs(old[p]), 1)}
    assert not off, off


def test_staging_memory_equals_its_committed_result():
    """The hierarchy's device bytes per engine configuration are counted, not timed: the
    committed ``staging_memory.json`` (its "after" side) must be what the code allocates."""
    sys.path.insert(0, str(BENCH))
    import staging_memory
    got = staging_memory.run_tree(None, str(BENCH.parent / "models" / "needle_v4"))
    committed = json.loads((BENCH / "results" / "staging_memory.json").read_text())["after"]
    keys = ("config", "sparse_layers", "max_num_seqs", "k_max", "device_bytes",
            "required_pages_per_request")
    assert [{k: g[k] for k in keys} for g in got] == [{k: c[k] for k in keys} for c in committed]
