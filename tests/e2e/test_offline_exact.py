"""The connector serves exactly what resident serving serves.

One run per arm with four concurrent requests of ~600, ~1500, ~3000 and ~7000
tokens finishing at different times; the hot cache (B = k = 512) and
optional residency off force host fetches.  Greedy tokens and logprobs must
be identical, token for token, to the same model without the connector.
"""
import json

import pytest

from .conftest import FAULTY, assert_same_outputs, faults, run_offline

pytestmark = pytest.mark.e2e

LENS = ["600", "1500", "3000", "7000"]
MAX_TOKENS = ["12", "5", "9", "3"]  # different lengths, so requests finish at different times
HIER = {"hot_cache_rows": 512, "optional_residency": False}


@pytest.fixture(scope="module")
def resident(demo_model):
    return run_offline(demo_model, "--prompt-lens", *LENS, "--max-tokens", *MAX_TOKENS)


def test_exact_against_resident_with_host_fetches(demo_model, resident):
    got = run_offline(demo_model, "--prompt-lens", *LENS, "--max-tokens", *MAX_TOKENS,
                      "--connector", json.dumps(HIER))
    assert_same_outputs(got, resident)
    t = got["stats"]["totals"]
    assert t["host"] > 0 and t["fetched"] > 0, f"no host fetches: {t}"
    # "selected" is counted by the routed layers apart from the resolver's census
    assert t["selected"] == t["direct"] + t["hot"] + t["host"], t
    assert t["admissions"] == len(LENS) and t["finished"] + t["preempted"] <= len(LENS)


def test_corrupted_mapping_is_detected(demo_model, resident):
    """The comparison can fail: one shifted location changes the outputs."""
    bad = run_offline(demo_model, "--prompt-lens", *LENS, "--max-tokens", *MAX_TOKENS,
                      "--connector", json.dumps(HIER), *FAULTY, env=faults("corrupt"))
    with pytest.raises(AssertionError):
        assert_same_outputs(bad, resident)
