"""An HF transformers DeepSeek-V4 checkpoint (save_pretrained) as the DeepSeek-native
checkpoint vLLM loads, next to the demo model's config and tokenizer.

    python scripts/convert_needle_model.py --hf /tmp/needle/hf --out needle_model

HF's save_pretrained writes the native names with a few differences: a ``model.``
prefix on every name but ``head.weight``, ``embed.weight`` as ``embed_tokens.weight``,
``hc_head_{fn,base,scale}`` as ``hc_head.hc_{fn,base,scale}``, each attention's
``kv_norm`` as ``norm``, and its own dtypes.  This undoes them, casts every tensor to the
dtype of the same tensor in ``--like`` (the demo model: its names and dtypes are what
vLLM's loader expects) and refuses any name the two do not share.  Writes shards of at
most ``--shard-mb`` MB with vLLM's index file, the config and tokenizer of ``--like``, and
``SHA256SUMS`` of every file written (what `make demo` checks).
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil

import torch
from safetensors import safe_open
from safetensors.torch import save_file

RENAMES = [
    (re.compile(r"^embed_tokens\.weight$"), "embed.weight"),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head_\1"),
    (re.compile(r"^(layers\.\d+\.attn)\.norm\.weight$"), r"\1.kv_norm.weight"),
]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "config.json", "generation_config.json")


def native_name(hf_name: str) -> str:
    name = hf_name[len("model."):] if hf_name.startswith("model.") else hf_name
    for pattern, repl in RENAMES:
        name = pattern.sub(repl, name)
    return name


def read(path_glob: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(glob.glob(path_glob)):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def convert(hf_dir: str, like_dir: str) -> dict[str, torch.Tensor]:
    like = {}
    for path in sorted(glob.glob(os.path.join(like_dir, "*.safetensors"))):
        with safe_open(path, "pt") as f:
            for k in f.keys():
                like[k] = f.get_slice(k).get_dtype()
    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "I32": torch.int32,
              "I64": torch.int64, "F16": torch.float16}
    tensors = {native_name(k): v for k, v in read(os.path.join(hf_dir, "*.safetensors")).items()}
    missing, extra = sorted(set(like) - set(tensors)), sorted(set(tensors) - set(like))
    if missing or extra:
        raise SystemExit(f"names differ from {like_dir}: missing {missing[:8]} "
                         f"({len(missing)}), unexpected {extra[:8]} ({len(extra)})")
    return {k: v.to(dtypes[like[k]]).contiguous() for k, v in tensors.items()}


def write(tensors: dict[str, torch.Tensor], out: str, shard_mb: int) -> list[str]:
    shards, cur, size = [], {}, 0
    for k in sorted(tensors):
        n = tensors[k].numel() * tensors[k].element_size()
        if cur and size + n > shard_mb * 1_000_000:
            shards.append(cur)
            cur, size = {}, 0
        cur[k] = tensors[k]
        size += n
    shards.append(cur)
    names, index = [], {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, name), metadata={"format": "pt"})
        names.append(name)
        index.update({k: name for k in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": index}, f, indent=1)
    return names


def write_model(tensors: dict[str, torch.Tensor], out: str, like: str, shard_mb: int = 15) -> None:
    """The shards, vLLM's index, the config and tokenizer of ``like`` and SHA256SUMS."""
    for old in glob.glob(os.path.join(out, "*.safetensors")):
        os.remove(old)
    names = write(tensors, out, shard_mb)
    for f in TOKENIZER_FILES:
        shutil.copy(os.path.join(like, f), os.path.join(out, f))
    with open(os.path.join(out, "SHA256SUMS"), "w") as f:
        for name in names + ["model.safetensors.index.json", *TOKENIZER_FILES]:
            with open(os.path.join(out, name), "rb") as g:
                f.write(f"{hashlib.sha256(g.read()).hexdigest()}  {name}\n")
    print(f"{len(tensors)} tensors in {len(names)} shards -> {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", required=True, help="save_pretrained directory")
    ap.add_argument("--out", required=True)
    ap.add_argument("--like", default=os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "demo_model"), help="the native model to match")
    ap.add_argument("--shard-mb", type=int, default=15)
    args = ap.parse_args()
    tensors = convert(args.hf, args.like)
    os.makedirs(args.out, exist_ok=True)
    write_model(tensors, args.out, args.like, args.shard_mb)


if __name__ == "__main__":
    main()
