"""DSpark and DFlash2 (vLLM's Model Runner V2 speculators) over the hierarchy.

Arms, one engine each, four requests of 600-7000 tokens (three from the first step, the
fourth from step 4, sharing a prefix with the third): resident serving
without speculation (the oracle for tokens), resident + DSpark, hierarchy + DSpark and
hierarchy + DFlash2 (that the comparison can fail is shown once, with a corrupted location,
in test_offline_exact.py).  The DSpark arms run with vLLM's
defaults, prefix caching and chunked prefill (2048-token chunks), forced on where this
CPU turns them off: the draft ring keeps prefill blocks for the prefix cache there.  The
DFlash2 arm runs chunked prefill without prefix caching: the ring's own chunk path, which
frees earlier chunks behind the window and hands null blocks to the worker's block table
(a one-step prefill: tests/unit/test_draft_ring.py).  The DSpark drafter is
the demo oracle built from the resident arm's own continuations
(vllm_dhisparse/demo_build/drafters.py), so its drafts are accepted; the DFlash2 drafter is
seeded noise with a 128-token window.  Speculative and plain runs are compared on
tokens (their logprobs need not be bitwise equal: different batch shapes); resident +
spec and hierarchy + spec on tokens, logprobs and vLLM's acceptance counters.
"""
import json
import subprocess
import sys

import pytest

from vllm_dhisparse.spec import SpecPreset

from .conftest import assert_same_outputs, run_offline

pytestmark = pytest.mark.e2e

MRV2 = {"VLLM_USE_V2_MODEL_RUNNER": "1"}
# Prompt seed 2: the random demo model has near ties (logprob gaps of 1e-4) that a
# change of batch shape can flip -- a verify step runs 4 tokens per request where plain
# decode runs 1, and a CPU GEMM rounds a row differently at another M.  Seed 0 flips
# the 7000-token request that way, with ngram drafts as well (no drafter KV involved);
# these prompts have no such tie within 16 tokens (the 7000-token one has one at its
# 18th).  Speculative arms are compared with each other bitwise.
# The 7000-token request begins with the first 3840 tokens (15 blocks) of the 4000-token
# one and arrives at step 4, after that one's prefill: with prefix caching it hits them.
ARGS = ["--prompt-lens", "600", "2000", "4000", "7000", "--max-tokens", "16",
        "--repeat-prompt", "--seed", "2", "--shared-prefix", "3:2:3840",
        "--arrivals", "0", "0", "0", "4"]
CHUNKED = ["--prefix-caching", "--chunk-tokens", "2048"]
HIER = {"hot_cache_rows": 512, "optional_residency": False}  # small: host fetches > 0
K = 3


def _build(kind: str, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "vllm_dhisparse.demo_build.drafters", kind, *args],
                   check=True, capture_output=True)


@pytest.fixture(scope="module")
def arms(demo_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("drafters")
    out = {"resident": run_offline(demo_model, *ARGS, env=MRV2)}
    ref = d / "resident.json"
    ref.write_text(json.dumps(out["resident"]))
    _build("dspark", "--target", demo_model, "--ref", str(ref), "--out", str(d / "dspark"),
           "--k", str(K))
    _build("dflash2", "--target", demo_model, "--out", str(d / "dflash2"), "--k", str(K),
           "--window", "128")
    dspark = json.dumps(SpecPreset("dspark", str(d / "dspark"), K).speculative_config())
    dflash2 = json.dumps(SpecPreset("dflash2", str(d / "dflash2"), K).speculative_config())

    def hier(spec):
        return json.dumps({**HIER, "spec": spec})

    out["resident_dspark"] = run_offline(demo_model, *ARGS, *CHUNKED, "--spec", dspark, env=MRV2)
    out["hier_dspark"] = run_offline(demo_model, *ARGS, *CHUNKED, "--spec", dspark,
                                     "--connector", hier("dspark"), env=MRV2)
    out["hier_dflash2"] = run_offline(demo_model, *ARGS, "--chunk-tokens", "2048",
                                      "--spec", dflash2,
                                      "--connector", hier("dflash2"), env=MRV2)
    return out


@pytest.mark.parametrize("arm", ["resident_dspark", "hier_dspark", "hier_dflash2"])
def test_greedy_tokens_equal_resident_without_speculation(arms, arm):
    assert_same_outputs(arms[arm], arms["resident"], logprobs=False)


def test_hierarchy_with_dspark_is_resident_with_dspark(arms):
    """Same tokens, bitwise logprobs, the same acceptance counters and the same prefix-cache
    hits: the hierarchy changes where verification reads rows, never which rows, what is
    accepted or what the prefix cache serves (the draft ring keeps the blocks a hit needs)."""
    hier, resident = arms["hier_dspark"], arms["resident_dspark"]
    assert hier["chunked_prefill"] and hier["prefix_caching"], hier
    assert resident["chunked_prefill"] and resident["prefix_caching"], resident
    assert_same_outputs(hier, resident)
    assert hier["spec_metrics"] == resident["spec_metrics"]
    cached = [o["num_cached_tokens"] for o in hier["outputs"]]
    assert cached == [o["num_cached_tokens"] for o in resident["outputs"]]
    assert cached[3] > 0, cached


def test_dspark_demo_drafter_is_accepted(arms):
    m = arms["hier_dspark"]["spec_metrics"]
    assert m["num_drafts"] > 0, m
    assert 1 + m["num_accepted_tokens"] / m["num_drafts"] >= 3, m  # mean acceptance length


@pytest.mark.parametrize("arm", ["hier_dspark", "hier_dflash2"])
def test_verification_shares_host_retrievals(arms, arm):
    t = arms[arm]["stats"]["totals"]
    assert t["fetched"] > 0, t  # the hot cache is small enough to miss
    assert t["verify_host_selections"] > t["verify_fetched"], t  # union retrieval (eq. 6)


@pytest.mark.parametrize("arm,preset", [("hier_dspark", "dspark"), ("hier_dflash2", "dflash2")])
def test_draft_ring_bounds_every_decode_step_and_prefill_without_prefix_caching(arms, arm, preset):
    """Every request holds at most R_d / p draft blocks at every decode step (eq. 9).
    Without prefix caching also in prefill: the DFlash2 arm prefills the 7000-token prompt
    in 2048-token chunks (vLLM's window holds 9 blocks then, 28 in a one-step prefill:
    results/spec_memory.json).  With prefix
    caching a prefill step holds what vLLM's window holds, the blocks a later hit needs
    (integration/draft_ring.py).  The sizes are published in the stats."""
    run = arms[arm]
    s = run["stats"]["spec"]
    assert s["preset"] == preset and s["k_max"] == K + 1, s
    assert s["draft_window"] == 128 and s["draft_block_size"] == 256, s
    assert s["draft_ring_rows"] == 512 and s["draft_ring_blocks"] == 2, s  # ceil(387 / 256)
    assert s["draft_ring_bounds_prefill"] == (not run["prefix_caching"]), s
    ring = [g for g, grp in enumerate(run["kv_groups"]) if grp["spec"] == "DraftRingSpec"]
    assert len(ring) == 1, run["kv_groups"]
    held = run["max_blocks_per_group"][ring[0]]
    decoding = run["max_decode_blocks_per_group"][ring[0]]
    assert 0 < decoding <= s["draft_ring_blocks"], (decoding, s)
    if s["draft_ring_bounds_prefill"]:  # the ring's chunk path
        assert run["chunked_prefill"] and run["max_num_batched_tokens"] == 2048, run
        assert held <= s["draft_ring_blocks"], (held, s)
    else:  # resident serving's drafter group, vLLM's window: the same blocks at every step
        plain = [g for g, grp in enumerate(arms["resident_dspark"]["kv_groups"])
                 if grp["first_layer"] == run["kv_groups"][ring[0]]["first_layer"]]
        assert held == arms["resident_dspark"]["max_blocks_per_group"][plain[0]] >= 2048 // 256


@pytest.mark.parametrize("arm", ["hier_dspark", "hier_dflash2"])
def test_staging_arena_stays_within_m_stage_and_is_reused(arms, arm):
    """One staging arena (chi = 1) serves both sparse layers: at every step the most
    bytes the layers held at once stay within eq. 11's M_stage, and the second layer of
    every step reuses the arena the first one released."""
    s, st = arms[arm]["stats"]["spec"], arms[arm]["stats"]["staging"]
    assert s["staging_arenas"] == st["arenas"] == 1, (s, st)
    assert 0 < s["staging_reserved_bytes"] == st["arena_bytes"] <= s["staging_bound_bytes"], (s, st)
    assert 0 < st["staging_bytes_step_max"] <= s["staging_bound_bytes"], (s, st)
    assert st["arena_reuses"] > 0 and st["arena_takes"] > st["arena_reuses"], st

