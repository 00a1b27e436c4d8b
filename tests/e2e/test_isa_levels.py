"""The ISA-dependent paths at every level this CPU can run besides the session's
(tests/isa.py): vLLM's branches (chunked prefill and prefix caching defaults for
DeepSeek-V4, which of its libraries it loads) and the connector's exactness against
resident serving through them.  The session's level runs the whole suite; P/D exactness
at each level is in test_pd_handoff.py."""
import json
import os
import subprocess
import sys

import pytest

from tests import isa

from .conftest import REPO, assert_same_outputs, run_offline

pytestmark = pytest.mark.e2e

BRANCHES = """
import json, sys
from vllm.engine.arg_utils import EngineArgs
import vllm._custom_ops  # noqa: F401  loads the platform's library
vc = EngineArgs(model=sys.argv[1], enforce_eager=True, block_size=256,
                max_model_len=4096).create_engine_config()
libs = sorted({ln.rsplit("/", 1)[-1].strip() for ln in open("/proc/self/maps")
               if "/vllm/_C" in ln})
print("BRANCHES " + json.dumps(dict(chunked=vc.scheduler_config.enable_chunked_prefill,
                                    prefix=vc.cache_config.enable_prefix_caching, libs=libs)))
"""
EXPECTED = {"amx": (True, True, ["_C.abi3.so"]), "avx512": (False, False, ["_C.abi3.so"]),
            "avx2": (False, False, ["_C_AVX2.abi3.so"])}
HIER = {"hot_cache_rows": 512, "optional_residency": False}  # host fetches
# a prefix hit longer than the device window, and chunked prefill, forced on in both arms
# where the level turns them off
BATCH = ["--prompt-lens", "2600", "2600", "--max-tokens", "6", "--prefix-caching",
         "--chunk-tokens", "1024", "--shared-prefix", "1:0:2600", "--arrivals", "0", "6",
         "--max-model-len", "4096"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("level", isa.available())
def test_vllm_takes_the_branches_of_each_level(demo_model, level):
    proc = subprocess.run([sys.executable, "-c", BRANCHES, demo_model], cwd=REPO,
                          env={**os.environ, **isa.env(level)}, capture_output=True, text=True,
                          timeout=300)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("BRANCHES ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("BRANCHES "):])
    assert (got["chunked"], got["prefix"], got["libs"]) == EXPECTED[level], got


@pytest.mark.parametrize("level", isa.others())
def test_connector_exact_at_other_levels(demo_model, level):
    env = isa.env(level)
    resident = run_offline(demo_model, *BATCH, env=env)
    got = run_offline(demo_model, *BATCH, "--connector", json.dumps(HIER), env=env)
    for run in (resident, got):
        assert run["prefix_caching"] and run["chunked_prefill"], run
        assert run["outputs"][1]["num_cached_tokens"] > 512, run["outputs"][1]
    assert_same_outputs(got, resident)
    t = got["stats"]["totals"]
    assert t["admissions"] == 2 and t["failed"] == 0 and t["host"] > 0, t
