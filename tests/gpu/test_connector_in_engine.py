"""The connector inside vLLM's GPU engine against resident serving (``make test-gpu``).

Runs ``scripts/gpu_connector.py``: the four engines with vLLM's GPU defaults (FULL
CUDA graphs), and connector engines, eager and with FULL graphs, that audit every routed
decode call (eager or replayed) against upstream's decode on vLLM's blocks; the calls that
serve requests must all be bitwise (vLLM's warm-up batches, before any request, are counted
apart: the routed decode serves no request there and reads no row); and a connector engine
with host prefix hits, whose loaded KV must equal vLLM's own blocks byte for byte.  vLLM's
GPU engine is not bitwise between two runs of one batch on DeepSeek-V4 (benchmarks/METHODS.md,
"vLLM is not bitwise against itself"), so the connector's tokens must equal resident's only
where resident's equal resident's; the audit must be bitwise in every call.  Needs a CUDA GPU (SM90 / SM100) and vLLM 0.33; skipped elsewhere.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

from vllm_dhisparse.integration.support import AUDITED_SPEC

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(REPO, "scripts", "gpu_connector.py")

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="needs a CUDA GPU of compute capability 9.x or 10.x")]


@pytest.fixture(scope="module", autouse=True)
def vllm_033():
    vllm = pytest.importorskip("vllm")
    if not vllm.__version__.startswith("0.33"):
        pytest.skip(f"needs vLLM 0.33, found {vllm.__version__}")


def run(out, *args) -> dict:
    proc = subprocess.run([sys.executable, SCRIPT, "--out", str(out), *args],
                          capture_output=True, text=True, timeout=900, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((out / "gpu_connector.json").read_text())


def test_connector_against_resident_with_cuda_graphs(tmp_path):
    doc = run(tmp_path)
    arms, cmp = doc["arms"], doc["comparisons"]
    assert not [a for a, r in arms.items() if "error" in r], arms
    if cmp["resident_vs_itself"]["identical"]:  # like with like, where vLLM is bitwise
        bad = {s: c for pair in ("connector_vs_resident", "serve_connector_vs_resident")
               for s, c in cmp[pair].items() if not c["identical"]}
        assert not bad, bad
    census = arms["connector"]["scenarios"]["batch"]["census"]
    assert census["host"] >= 0.3 * (census["direct"] + census["hot"] + census["host"]), census
    assert arms["connector"]["scenarios"]["passkey"]["answered"]
    assert arms["serve-connector"]["passkey_answered"]


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "full_graphs"])
def test_every_routed_decode_call_equals_upstreams_in_the_engine(tmp_path, graphs):
    extra = {"hot_cache_rows": 512, "optional_residency": False, "device_window_tokens": 0}
    doc = run(tmp_path, "--arms", "connector", "--audit", "--extra", json.dumps(extra),
              *([] if graphs else ["--eager"]))
    arm = doc["arms"]["connector"]
    audit, census = arm["audit_serving"], arm["scenarios"]["batch"]["census"]
    assert arm["routed_selected_at_start"] == 0  # warm-up: the routed decode served no token
    if graphs:  # the graphs replay the check with the decodes
        assert arm["audit"]["captured_calls"] > 0 and audit["replayed_calls"] > 0, arm["audit"]
    assert audit["calls"] > 0 and audit["equal"] == audit["calls"], audit
    assert census["host"] >= 0.3 * (census["direct"] + census["hot"] + census["host"]), census


def test_a_host_prefix_hit_loads_the_bytes_vllm_computed(tmp_path):
    """With vLLM's GPU defaults: a prompt's KV loaded from its host entry after vLLM's prefix
    cache lost it equals, block by block and row by row, what vLLM's prefill wrote for
    those tokens (scripts/gpu_host_prefix_bytes.py); a second turn loads from host."""
    extra = {"hot_cache_rows": 512, "optional_residency": False, "host_prefix_gib": 2}
    doc = run(tmp_path, "--arms", "connector", "--scenarios", "host_prefix_bytes,host_prefix",
              "--extra", json.dumps(extra))
    scen = doc["arms"]["connector"]["scenarios"]
    got = scen["host_prefix_bytes"]
    assert got["loaded_equal_computed"], got
    assert got["compared"]["c4a"]["units"] > 0 and got["compared"]["sliding"]["units"] > 0, got
    assert scen["host_prefix"]["host_prefix"]["tokens_loaded"] > 0, scen["host_prefix"]


@pytest.mark.parametrize("method", AUDITED_SPEC)
def test_speculative_verification_calls_equal_upstreams_in_the_engine(tmp_path, method):
    """Speculative decoding with vLLM's GPU defaults (Model Runner V2's speculators; DSpark
    with the demo's drafter, scripts/gpu_spec.py): every verification step routes 1 + K
    queries per request, and every routed decode call, eager or replayed from a FULL graph,
    equals upstream's decode on vLLM's blocks bit for bit.  The engine runs the package's
    own connector class, so its start-up check must accept the setup
    (``support.AUDITED_SPEC``); a method not audited yet is audited with
    ``gpu_connector.py --unaudited`` (scripts/gpu_measure.py) before it joins that list."""
    extra = {"hot_cache_rows": 512, "optional_residency": False, "device_window_tokens": 0}
    doc = run(tmp_path, "--arms", "connector", "--audit", "--spec", method,
              "--scenarios", "batch,preempt,abort", "--extra", json.dumps(extra))
    arm = doc["arms"]["connector"]
    assert "error" not in arm, arm
    assert not {s: r["error"] for s, r in arm["scenarios"].items() if "error" in r}
    audit, spec = arm["audit_serving"], arm["spec_counters"]
    assert audit["calls"] > 0 and audit["equal"] == audit["calls"], audit
    assert audit["replayed_calls"] > 0, audit
    # a call verifies 1 + K queries per decoding request (a short last prompt chunk, which
    # vLLM also classes as a decode, fewer): on average far more than one per call
    assert audit["tokens"] >= 2 * audit["calls"], audit
    assert spec["num_drafts"] > 0 and spec["num_draft_tokens"] == 3 * spec["num_drafts"], spec
    # drafts both accepted and rejected went through verification
    assert 0 < spec["num_accepted_tokens"] < spec["num_draft_tokens"], spec
