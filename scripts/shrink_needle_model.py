"""A trained pass-key model carried to narrower widths, as the start of a shorter training.

    python scripts/shrink_needle_model.py --src OLD_MODEL --like demo_model --out DIR

``--src`` is a trained checkpoint of the demo architecture with wider layers (the first
``models/needle_v4``: 8 indexer heads, q/o LoRA ranks 128, expert width 128); ``--like`` is
the model whose config gives the target widths (the demo model: 32 indexer heads, ranks 64 /
32, width 16).  Per layer, in float32:

* indexer heads: each trained head is copied ``new / old`` times and its weight in
  ``weights_proj`` is scaled so that the copies' sum, times the scorer's 1/sqrt(heads), is the
  old head's term: every index score is unchanged, so is the top-k.
* query LoRA rank: the query latent keeps the ``q_lora_rank`` directions that the main and the
  indexer query projections read most (SVD of both maps, the RMS gain folded in); ``q_norm``
  becomes the constant that restores the latent's scale after the narrower RMS.  Exact when
  the gain is one constant and the latent and its readers fit the new rank; otherwise an
  approximation (the trained gains are within 7 % of 1).
* output LoRA rank: each group's ``wo_b @ wo_a`` is replaced by its best rank-``o_lora_rank``
  factorisation (SVD).
* experts (routed and shared): the neurons with the largest ``|w1| |w3| |w2|`` are kept.

Nothing here is exact but the indexer's copies; the recipe then trains the result
(scripts/train_needle_model.py ``--init DIR``).  Writes DIR in the native layout of
``--like`` (its names, dtypes, config and tokenizer) with SHA256SUMS.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys

import torch
from safetensors import safe_open

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import convert_needle_model as convert  # noqa: E402


def read(model_dir: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            out.update({k: f.get_tensor(k).float() for k in f.keys()})
    return out


def config(model_dir: str) -> dict:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)


def indexer_heads(w: dict, a: str, old: dict, new: dict) -> None:
    n0, n1, hd = old["index_n_heads"], new["index_n_heads"], old["index_head_dim"]
    if n1 == n0:
        return
    if n1 % n0:
        raise SystemExit(f"index_n_heads {n1} is not a multiple of {n0}")
    rep = n1 // n0
    q = w[a + "indexer.wq_b.weight"].view(n0, hd, -1)
    w[a + "indexer.wq_b.weight"] = q.repeat(rep, 1, 1).reshape(n1 * hd, -1)
    w[a + "indexer.weights_proj.weight"] = (w[a + "indexer.weights_proj.weight"].repeat(rep, 1)
                                            * ((n1 / n0) ** 0.5 / rep))


def query_rank(w: dict, a: str, old: dict, new: dict) -> None:
    r0, r1 = old["q_lora_rank"], new["q_lora_rank"]
    if r1 == r0:
        return
    g = w[a + "q_norm.weight"]
    readers = [a + "wq_b.weight"] + ([a + "indexer.wq_b.weight"]
                                     if a + "indexer.wq_b.weight" in w else [])
    # the maps from the un-normalised latent to every query: [out, r0]
    _, _, vh = torch.linalg.svd(torch.cat([w[k] * g for k in readers]), full_matrices=False)
    v = vh[:r1].T  # [r0, r1] the directions kept
    w[a + "wq_a.weight"] = v.T @ (g[:, None] * w[a + "wq_a.weight"])
    for k in readers:
        w[k] = w[k] @ v
    # the kept latent holds (most of) g * a, whose RMS over r1 entries is sqrt(r0 / r1) |g|
    # times the RMS of a over r0: this gain gives the old normalised latent back
    w[a + "q_norm.weight"] = torch.full((r1,), (r0 / r1) ** 0.5 * float(g.pow(2).mean().sqrt()))


def output_rank(w: dict, a: str, old: dict, new: dict) -> None:
    r0, r1, groups = old["o_lora_rank"], new["o_lora_rank"], old["o_groups"]
    if r1 == r0:
        return
    wo_a, wo_b, firsts, seconds = w[a + "wo_a.weight"], w[a + "wo_b.weight"], [], []
    for j in range(groups):
        u, s, vh = torch.linalg.svd(wo_b[:, j * r0:(j + 1) * r0] @ wo_a[j * r0:(j + 1) * r0],
                                    full_matrices=False)
        root = s[:r1].sqrt()
        firsts.append(root[:, None] * vh[:r1])
        seconds.append(u[:, :r1] * root)
    w[a + "wo_a.weight"], w[a + "wo_b.weight"] = torch.cat(firsts), torch.cat(seconds, 1)


def expert_width(w: dict, prefix: str, width: int) -> None:
    w1, w2, w3 = (w[prefix + n] for n in ("w1.weight", "w2.weight", "w3.weight"))
    if width == w1.shape[0]:
        return
    keep = (w1.norm(dim=1) * w3.norm(dim=1) * w2.norm(dim=0)).topk(width).indices.sort().values
    w[prefix + "w1.weight"], w[prefix + "w3.weight"] = w1[keep], w3[keep]
    w[prefix + "w2.weight"] = w2[:, keep]


def shrink(w: dict, old: dict, new: dict) -> dict:
    for key in ("hidden_size", "num_hidden_layers", "compress_ratios", "num_attention_heads",
                "head_dim", "o_groups", "n_routed_experts", "index_head_dim", "vocab_size"):
        if old.get(key) != new.get(key):
            raise SystemExit(f"{key} differs ({old.get(key)} -> {new.get(key)}): only the "
                             f"indexer heads, the LoRA ranks and the expert width can change")
    for i in range(old["num_hidden_layers"]):
        a = f"layers.{i}.attn."
        query_rank(w, a, old, new)  # before the heads are copied: the indexer reads the latent
        if a + "indexer.wq_b.weight" in w:
            indexer_heads(w, a, old, new)
        output_rank(w, a, old, new)
        f = f"layers.{i}.ffn."
        for e in range(old["n_routed_experts"]):
            expert_width(w, f"{f}experts.{e}.", new["moe_intermediate_size"])
        expert_width(w, f + "shared_experts.",
                     new["moe_intermediate_size"] * new["n_shared_experts"])
    return w


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", required=True, help="the trained wider model (native layout)")
    ap.add_argument("--like", required=True, help="a model with the target config (native)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    w = shrink(read(args.src), config(args.src), config(args.like))
    like = convert.read(os.path.join(args.like, "*.safetensors"))
    if set(w) != set(like):
        raise SystemExit(f"names differ from {args.like}: {sorted(set(w) ^ set(like))[:8]}")
    bad = [k for k in w if w[k].shape != like[k].shape]
    if bad:
        raise SystemExit(f"shapes differ from {args.like}: {bad[:8]}")
    os.makedirs(args.out, exist_ok=True)
    tensors = {k: w[k].to(like[k].dtype).contiguous() for k in w}
    convert.write_model(tensors, args.out, args.like)
    print(f"{len(tensors)} tensors, {sum(t.numel() for t in tensors.values()) / 1e6:.1f} M "
          f"parameters -> {args.out}")


if __name__ == "__main__":
    main()
