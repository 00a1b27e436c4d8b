"""More sessions in the same KV memory, every pool counted, outputs as resident serving.

Both arms get the same KV budget in bytes (``kv_cache_memory_bytes``).  With the
connector that budget holds vLLM's blocks *and* the hierarchy's device pools
(``integration/worker/pool_sizing.py`` takes them off what vLLM allocates), so the
comparison is byte for byte; the pinned host pool is the memory the design
trades for it.  The c4a compressed caches live in their own group with a
512-token device window: vLLM frees their blocks behind the window once a
request's prefill is complete and the hierarchy holds the rows.

The hierarchy reserves, per possible running request, a hot cache, a tail
and (auto) one hot cache of optional history: 18 pages of 64 rows per sparse
layer here (B = k = 512), the c4a history of ~4,600 tokens, and 2 rows per
request in the staging arena the layers share.  It gives
sessions back only where histories are longer than that; at 2,600 tokens the
two arms run the same number of requests.  So: six 4,000-token requests
(max_model_len 4,100) in 165 MB, where resident serving runs at most three at
once (vLLM's own check refuses to start resident serving below ~161 MB: one
request of max_model_len) and the connector runs all six.  The running-request count is vLLM's own (the
scheduler's ``running`` queue, what ``vllm:num_requests_running`` reports),
sampled after every engine step.

Outputs: greedy tokens must be identical to resident serving.  Logprobs are
compared with a tolerance because the arms run different batches and vLLM's
dense layers are not batch-invariant on CPU; the hierarchy path itself is
bit-exact under identical batches (test_window_exact.py, test_default_paths.py).
"""
import json
import os

import pytest

from benchmarks import ledger

from .conftest import run_offline

pytestmark = pytest.mark.e2e

N = 6
PROMPT = 4000
KV_BYTES = 165_000_000
ARGS = ["--prompt-lens", *[str(PROMPT)] * N, "--max-tokens", "8",
        "--max-model-len", str(PROMPT + 100),
        "--max-num-seqs", str(N), "--kv-cache-bytes", str(KV_BYTES)]


def test_more_sessions_same_memory(demo_model):
    resident = run_offline(demo_model, *ARGS)
    got = run_offline(demo_model, *ARGS, "--connector", json.dumps({"hot_cache_rows": 512}))
    t = got["stats"]["totals"]
    record = dict(kv_cache_bytes=KV_BYTES, prompt_len=PROMPT, requests=N,
                  resident=dict(max_running=resident["max_running"], running=resident["running"],
                                vllm_kv_bytes=resident["vllm_kv_bytes"],
                                generate_s=resident["generate_s"]),
                  connector=dict(max_running=got["max_running"], running=got["running"],
                                 vllm_kv_bytes=got["vllm_kv_bytes"],
                                 device_pool_bytes=t["device_pool_bytes"],
                                 host_pool_bytes=t["host_pool_bytes"],
                                 generate_s=got["generate_s"], totals=t))
    if os.environ.get("DHISPARSE_CAPACITY_OUT"):  # the committed record
        import datetime
        import platform
        import subprocess
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True).stdout.strip()
        with open(os.environ["DHISPARSE_CAPACITY_OUT"], "w") as f:
            json.dump(dict(record, device=f"CPU {platform.processor() or platform.machine()}, "
                                          f"{os.cpu_count()} cores",
                           date=datetime.date.today().isoformat(), commit=commit), f, indent=1)
    print(json.dumps(record))
    # every device pool of both arms inside the same budget
    assert resident["vllm_kv_bytes"] <= KV_BYTES, record
    assert t["device_pool_bytes"] > 0, record
    assert got["vllm_kv_bytes"] + t["device_pool_bytes"] <= KV_BYTES, record
    # The README quotes these counts from the ledger's latest capacity record: the same
    # engines must give them again (counts, so no tolerance; resident serving may run fewer
    # where this CPU's scheduling admits later, never more).
    quoted = ledger.latest(ledger.load())[("capacity", "cpu")]
    config, now = ledger.EXTRACTORS["capacity"](record)
    print(f"capacity against the ledger ({quoted['files'][0]}, {quoted['commit']}): "
          f"{now} here, {quoted['metrics']} there")
    assert (config, now["kv_mb"], now["prompt_tokens"]) == (
        quoted["config"], quoted["metrics"]["kv_mb"], quoted["metrics"]["prompt_tokens"])
    assert now["connector_running"] == quoted["metrics"]["connector_running"] == N, record
    assert now["resident_running"] <= quoted["metrics"]["resident_running"], record
    for i, (g, w) in enumerate(zip(got["outputs"], resident["outputs"])):
        assert g["token_ids"] == w["token_ids"], (i, g["token_ids"], w["token_ids"])
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])) < 0.05, i
    assert t["admissions"] == N and t["failed"] == 0, t
