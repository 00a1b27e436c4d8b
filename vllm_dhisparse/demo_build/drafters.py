"""Build the demo drafters for speculative decoding next to the demo model (no downloads).

    python -m vllm_dhisparse.demo_build.drafters dspark --target demo_model --ref RESULT.json --out D
    python -m vllm_dhisparse.demo_build.drafters dflash2 --target demo_model --out D [--window 128]

* ``dspark``: a DSpark drafter (vLLM ``Qwen3DSparkModel``) whose Markov head replays the
  target's own greedy continuations, so its drafts are accepted: the backbone's output
  norm is zero (logits 0), and the Markov bias ``W2 . W1[prev]`` puts all mass on the
  token that followed ``prev`` in ``RESULT.json`` (an ``offline_run`` result: the
  output tokens of every request; the first successor seen wins).
  Its one layer is sliding-window attention of ``--window`` tokens (the draft ring
  bounds a drafter by its own window).
* ``dflash2``: a seeded DFlash2 drafter (``DFlash2DraftModel``: two-tap convolutions and
  a candidate selector) whose every layer is sliding-window attention of ``--window``
  tokens.  Its drafts are noise and are rejected; it exercises the DFlash2 path.

Both are Qwen3-style drafters without embeddings or LM head (vLLM shares the target's),
fed by the hidden states of target layers ``--aux-layers``; their hidden size is the
target's.  Deterministic: the same inputs give the same bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch
from safetensors.torch import save_file

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
MASK_TOKEN = 3  # a token the demo prompts never start a motif with (ids >= 3 are text)


def target_shape(target: str) -> dict:
    with open(os.path.join(target, "config.json")) as f:
        cfg = json.load(f)
    return dict(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"],
                vocab=cfg["vocab_size"])


def qwen3_config(shape: dict, layers: int, aux: list[int], dtype: str, **extra) -> dict:
    hidden = shape["hidden"]
    return dict(model_type="qwen3", vocab_size=shape["vocab"], hidden_size=hidden,
                intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                head_dim=hidden // 4, num_hidden_layers=layers, max_position_embeddings=16384,
                rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu", torch_dtype=dtype,
                attention_bias=False, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
                target_hidden_size=hidden, target_layer_ids=aux, **extra)


def backbone(cfg: dict, n_aux: int, rnd, dtype) -> dict[str, torch.Tensor]:
    """fc (aux states -> hidden), norms and Qwen3 decoder layers."""
    h, hd, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    ones = lambda n: torch.ones(n, dtype=dtype)  # noqa: E731
    w = {"fc.weight": rnd(h, n_aux * cfg["target_hidden_size"]), "hidden_norm.weight": ones(h),
         "norm.weight": ones(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        w.update({
            p + "input_layernorm.weight": ones(h), p + "post_attention_layernorm.weight": ones(h),
            p + "self_attn.q_proj.weight": rnd(4 * hd, h), p + "self_attn.k_proj.weight": rnd(2 * hd, h),
            p + "self_attn.v_proj.weight": rnd(2 * hd, h), p + "self_attn.o_proj.weight": rnd(h, 4 * hd),
            p + "self_attn.q_norm.weight": ones(hd), p + "self_attn.k_norm.weight": ones(hd),
            p + "mlp.gate_proj.weight": rnd(inter, h), p + "mlp.up_proj.weight": rnd(inter, h),
            p + "mlp.down_proj.weight": rnd(h, inter)})
    return w


def write(out: str, target: str, cfg: dict, weights: dict) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    save_file({k: v.contiguous() for k, v in weights.items()}, os.path.join(out, "model.safetensors"))
    for name in TOKENIZER_FILES:
        shutil.copy(os.path.join(target, name), out)


def successors(ref: str) -> dict[int, int]:
    """token -> the token that first followed it in the reference continuations."""
    with open(ref) as f:
        result = json.load(f)
    succ: dict[int, int] = {}
    for out in result["outputs"]:  # drafts follow a sampled token: outputs suffice
        toks = out["token_ids"]
        for x, y in zip(toks, toks[1:]):
            succ.setdefault(x, y)
    return succ


def build_dspark(a) -> None:
    shape = target_shape(a.target)
    aux = [int(x) for x in a.aux_layers.split(",")]
    vocab, hidden = shape["vocab"], shape["hidden"]
    rank = vocab  # one Markov dimension per token: W1 = identity, W2 = the successor table
    cfg = qwen3_config(shape, 1, aux, "bfloat16", architectures=["Qwen3DSparkModel"],
                       markov_rank=rank, dspark_noise_token_id=MASK_TOKEN, block_size=a.k + 1,
                       enable_confidence_head=True, confidence_head_with_markov=True,
                       layer_types=["sliding_attention"], sliding_window=a.window,
                       use_sliding_window=True)
    g = torch.Generator().manual_seed(a.seed)
    rnd = lambda *s: ((torch.rand(s, generator=g) * 2 - 1) * 0.02).to(torch.bfloat16)  # noqa: E731
    w = backbone(cfg, len(aux), rnd, torch.bfloat16)
    w["norm.weight"] = torch.zeros(hidden, dtype=torch.bfloat16)  # backbone logits are 0
    succ = successors(a.ref)
    w2 = torch.zeros(vocab, rank)
    for prev, nxt in succ.items():
        w2[nxt, prev] = 1.0  # bias[v | prev] = 32 * W2[v, prev]
    w["markov_head.markov_w1.weight"] = (torch.eye(vocab, rank) * 32.0).to(torch.bfloat16)
    w["markov_head.markov_w2.weight"] = w2.to(torch.bfloat16)
    w["confidence_head.proj.weight"] = torch.zeros(1, hidden + rank)
    w["confidence_head.proj.bias"] = torch.full((1,), 4.0)  # confident: every draft is verified
    write(a.out, a.target, cfg, w)
    print(f"dspark drafter: {len(succ)} successor entries -> {a.out}")


def build_dflash2(a) -> None:
    shape = target_shape(a.target)
    aux = [int(x) for x in a.aux_layers.split(",")]
    hidden, vocab, layers = shape["hidden"], shape["vocab"], 2
    taps, group, rank = 2, 16, 8
    dfl = dict(mask_token_id=MASK_TOKEN, target_layer_ids=aux, block_size=a.k + 1,
               conv_kernel_size=taps, conv_group_size=group, selector_rank=rank, selector_top_k=4)
    cfg = qwen3_config(shape, layers, aux, "bfloat16", architectures=["DFlash2DraftModel"],
                       is_causal=False, dflash_config=dfl,
                       layer_types=["sliding_attention"] * layers, sliding_window=a.window,
                       use_sliding_window=True)
    g = torch.Generator().manual_seed(a.seed)
    rnd = lambda *s, scale=0.05: ((torch.rand(s, generator=g) * 2 - 1) * scale).to(torch.bfloat16)  # noqa: E731
    w = backbone(cfg, len(aux), rnd, torch.bfloat16)
    for i in range(layers):
        for conv in ("attention_conv", "mlp_conv"):
            base = torch.zeros(2, taps, hidden, dtype=torch.bfloat16)
            base[:, 0] = 1.0  # identity tap: the convolution starts as a pass-through
            w[f"layers.{i}.{conv}.base_kernel"] = base
            w[f"layers.{i}.{conv}.kernel_projection.weight"] = rnd(2 * taps * (hidden // group),
                                                                   hidden, scale=0.01)
    w.update({"candidate_selector.hidden_projection.weight": rnd(rank, hidden),
              "candidate_selector.predecessor_codebook": rnd(vocab, rank),
              "candidate_selector.successor_codebook": rnd(vocab, rank)})
    write(a.out, a.target, cfg, w)
    print(f"dflash2 drafter: window {a.window} -> {a.out}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="kind", required=True)
    for kind in ("dspark", "dflash2"):
        s = sub.add_parser(kind)
        s.add_argument("--target", required=True, help="the target model directory (demo model)")
        s.add_argument("--out", required=True)
        s.add_argument("--k", type=int, default=3, help="draft tokens per step (K)")
        s.add_argument("--aux-layers", default="0,2", help="target layers feeding the drafter")
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--window", type=int, default=128, help="sliding window of every layer")
        if kind == "dspark":
            s.add_argument("--ref", required=True, help="offline_run result of the target (greedy)")
    a = ap.parse_args(argv)
    (build_dspark if a.kind == "dspark" else build_dflash2)(a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
