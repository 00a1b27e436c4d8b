"""Prefix hits served from host memory (``host_prefix_gib``), against RESIDENT serving.

Two conversations, each a first turn and a second turn whose prompt is the first turn's
prompt and outputs plus new tokens (``offline_run --next-turn``).  Prefix caching is on
in both arms (forced where this CPU turns it off).  In the connector arm vLLM's prefix
cache is reset after the first turns (``LLM.reset_prefix_cache``: as if other requests had
taken the blocks), so the second turns' prefixes can only come from the connector's host
entries; resident serving keeps its cache and hits it.

* A: a 1300-token prompt, 10 outputs.  Its entry ends at 1280 tokens (prompt only; the
  sliding-window snapshot is taken as the first decode step passes the boundary).  Both
  arms serve the second turn with 1280 cached tokens: identical tokens, bitwise logprobs.
* B: a 1000-token prompt, 40 outputs.  Its entry ends at 1024 tokens, past the prompt: the
  last 24 were computed by decode steps, the snapshot taken at the decode step that
  passed 1024.  vLLM's own cache does not serve a block completed by decode steps on this
  model (resident hits 768), so the connector computes 256 fewer prompt tokens; the
  tokens are identical, the logprobs equal up to the rounding of a different prefill split.

Both hits are longer than the 512-token device window.

A preempted request resumes from its host entry (``test_preempted_request_resumes_from_host``):
r0 (1300-token prompt, 40 outputs, priority 1) is preempted at step 8 through the
scheduler's own ``_preempt_request`` (the harness's ``--preempt``; vLLM 0.32 preempts by
itself only a running request that cannot grow, and with its admission check -- a
request's whole prompt must fit before it starts -- runs of this model near its smallest
pool did not get there).  Two 2000-token requests of priority 0 arrive in that step;
vLLM's priority policy serves them first, and their prefills take every free block, r0's cached ones
included, so when r0 resumes vLLM's prefix cache holds none of its prefix: resident serving
recomputes all 1307 tokens r0 had, the connector loads 1280 from host (its entry's 256-token
boundary) and computes the 27 after it.
"""
import json

import pytest

from .conftest import assert_same_outputs, run_offline

pytestmark = pytest.mark.e2e

RUN = ["--prompt-lens", "1300", "1000", "300", "200", "--max-tokens", "10", "40", "12", "12",
       "--prefix-caching", "--next-turn", "2:0", "3:1", "--arrivals", "0", "0", "999", "999",
       "--max-model-len", "2048"]
HIER = {"hot_cache_rows": 512, "optional_residency": False, "host_prefix_gib": 0.05}


@pytest.fixture(scope="module")
def arms(demo_model):
    resident = run_offline(demo_model, *RUN)
    got = run_offline(demo_model, *RUN, "--reset-prefix-cache-before", "2",
                      "--connector", json.dumps(HIER))
    return resident, got


def subset(run: dict, idx: list[int]) -> dict:
    return {**run, "outputs": [run["outputs"][i] for i in idx]}


def test_second_turns_load_their_prefix_from_host_exactly(arms):
    resident, got = arms
    for run in (resident, got):
        assert run["prefix_caching"], run
    assert [o["num_cached_tokens"] for o in resident["outputs"]] == [0, 0, 1280, 768]
    assert [o["num_cached_tokens"] for o in got["outputs"]] == [0, 0, 1280, 1024]
    assert_same_outputs(subset(got, [0, 1, 2]), subset(resident, [0, 1, 2]))
    assert_same_outputs(subset(got, [3]), subset(resident, [3]), logprobs=False)
    g, w = got["outputs"][3]["logprobs"], resident["outputs"][3]["logprobs"]
    print("conversation B, second turn: largest logprob difference",
          max(abs(a - b) for a, b in zip(g, w)))
    assert max(abs(a - b) for a, b in zip(g, w)) < 1e-3, (g, w)

    hp = got["stats"]["host_prefix"]
    assert hp["loads"] == 2 and hp["tokens_loaded"] == 1280 + 1024, hp
    # every turn but the last is captured before the stats file is last written
    assert hp["captured"] >= 3 and hp["capture_failed"] == hp["load_failed"] == 0, hp
    t = got["stats"]["totals"]
    assert t["failed"] == 0 and t["admissions"] == 4, t
    # vLLM's own accounting: the loaded tokens are cached, from outside its prefix cache
    assert got["pd_metrics"]["vllm:prompt_tokens_by_source|external_kv_transfer"] == 1280 + 1024
    assert got["pd_metrics"]["vllm:prompt_tokens_by_source|local_cache_hit"] == 0
    computed = got["pd_metrics"]["vllm:prompt_tokens_by_source|local_compute"]
    assert computed == resident["pd_metrics"]["vllm:prompt_tokens_by_source|local_compute"] - 256


# r0 preempted at step 8 while two higher-priority 2000-token prompts arrive; the pool
# (85 MB, vLLM's smallest for 2048-token requests is ~75 MB) holds one of their prefills
PREEMPT = ["--prompt-lens", "1300", "2000", "2000", "--max-tokens", "40", "4", "4",
           "--arrivals", "0", "8", "8", "--priority", "1", "0", "0", "--preempt", "0:8",
           "--max-model-len", "2048", "--kv-cache-bytes", "85000000", "--prefix-caching"]


def test_preempted_request_resumes_from_host(demo_model):
    resident = run_offline(demo_model, *PREEMPT)
    got = run_offline(demo_model, *PREEMPT, "--connector", json.dumps(HIER))
    for run in (resident, got):
        assert [p["computed"] for p in run["forced_preemptions"]] == [1307], run
        assert sorted(run["preemptions"].values()) == [0, 0, 1], run
    # tokens the scheduler ran per request: r0's prompt and 39 decode steps, and again what
    # its resume computed
    first = 1300 + 39
    r0 = [next(v for k, v in run["scheduled_tokens"].items() if k.startswith("r0-"))
          for run in (resident, got)]
    assert r0[0] == first + 1307, r0  # resident: vLLM's cache lost the whole prefix
    assert r0[1] == first + 1307 - 1280, r0  # connector: only past the entry's boundary
    hp = got["stats"]["host_prefix"]
    assert hp["loads"] == 1 and hp["tokens_loaded"] == 1280, hp
    assert hp["capture_failed"] == hp["load_failed"] == 0, hp
    assert got["stats"]["totals"]["failed"] == 0, got["stats"]["totals"]
    # r0's rows before 1280 were computed by its first prefill in the connector arm and by
    # the resume's prefill (another row count) in resident serving: logprobs can round
    # differently there (bit-equal on the machine this was written on)
    assert_same_outputs(got, resident, logprobs=False)
    diff = max(abs(a - b) for g, w in zip(got["outputs"], resident["outputs"])
               for a, b in zip(g["logprobs"], w["logprobs"]))
    print("preempted and resumed: largest logprob difference", diff)
    assert diff < 1e-3, diff
