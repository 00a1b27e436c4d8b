"""Offline greedy generation with or without the connector; prints one JSON line.

    python -m vllm_dhisparse.tools.offline_run --model DIR --prompt-lens 600 3000 \
        [--connector '{"hot_cache_rows": 512}'] [--spec-tokens 3] [--max-tokens 16]

Used by the E2E tests (each run is its own process: vLLM spawns engine
processes and keeps global state) and handy for comparing by hand.  Prompts
are seeded token ids, so both arms see identical inputs.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time


def prompt_ids(length: int, seed: int, vocab: int = 512) -> list[int]:
    import torch
    g = torch.Generator().manual_seed(seed * 7919 + length)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def build_llm(args, stats_file: str | None):
    from vllm import LLM
    kw = dict(model=args.model, enforce_eager=True, block_size=256,
              max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              gpu_memory_utilization=args.kv_fraction, seed=0)
    if args.connector is not None:
        extra = json.loads(args.connector)
        if stats_file:
            extra.setdefault("stats_file", stats_file)
        kw["kv_transfer_config"] = {"kv_connector": "DHiSparseConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": extra}
    if args.spec_tokens:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": args.spec_tokens,
                                    "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    return LLM(**kw)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="model directory (e.g. the demo model)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=[600])
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[16],
                    help="one value, or one per prompt (requests finish at different times)")
    ap.add_argument("--connector", default=None,
                    help="JSON kv_connector_extra_config; omit for resident serving")
    ap.add_argument("--spec-tokens", type=int, default=0, help="ngram speculative tokens (0 = off)")
    ap.add_argument("--repeat-prompt", action="store_true",
                    help="prompts repeat a short motif so ngram drafts get accepted")
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--kv-fraction", type=float, default=0.2,
                    help="gpu_memory_utilization (on CPU: share of RAM for KV)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    from vllm import SamplingParams
    stats_file = tempfile.mktemp(prefix="dhisparse-stats-", suffix=".json") \
        if args.connector is not None else None
    t0 = time.time()
    llm = build_llm(args, stats_file)
    load_s = time.time() - t0
    prompts = []
    for i, n in enumerate(args.prompt_lens):
        ids = prompt_ids(n, args.seed + i)
        if args.repeat_prompt:
            motif = ids[:24]
            ids = (motif * (n // len(motif) + 1))[:n]
        prompts.append({"prompt_token_ids": ids})
    max_tokens = args.max_tokens * len(prompts) if len(args.max_tokens) == 1 else args.max_tokens
    params = [SamplingParams(temperature=0.0, max_tokens=m, logprobs=1, seed=0) for m in max_tokens]
    t0 = time.time()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.time() - t0
    result = dict(load_s=load_s, generate_s=gen_s, outputs=[])
    for o in outs:
        c = o.outputs[0]
        result["outputs"].append(dict(
            token_ids=list(c.token_ids), text=c.text,
            logprobs=[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]))
    if stats_file and os.path.exists(stats_file):
        with open(stats_file) as f:
            result["stats"] = json.load(f)
    print("DHISPARSE_RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
