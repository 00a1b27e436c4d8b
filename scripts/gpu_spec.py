"""Speculative decoding in the GPU scripts (gpu_connector.py ``--spec``): vLLM's
``speculative_config`` for a method, and the demo drafter it needs, built next to the run.

* ``ngram``: vLLM's prompt-lookup speculator (no drafter).  Under Model Runner V2 it
  proposes K tokens at every step, repeating the last sampled token where the prompt has
  no match, so every decode step verifies 1 + K queries per request.
* ``dspark`` / ``dflash2``: the package's presets (``vllm_dhisparse.spec``) with the demo
  drafters (``vllm_dhisparse.demo_build.drafters``).  The DSpark drafter's Markov head
  replays the token that first followed each token in the given sequences: the outputs
  of an earlier run of the same prompts (``--spec-ref``: speculation is lossless, so any
  arm's greedy outputs are the target's), whose tokens it then drafts right where
  requests agree on a successor; without them the prompts, which the demo's random
  prompts make a poor guess.  The DFlash2 drafter is seeded noise.

On CUDA a Qwen3-style drafter next to DeepSeek-V4 needs two keys that vLLM's defaults get
wrong there: ``kv_cache_dtype`` ``auto`` (the preset's ``speculative_config(cuda=True)``
adds it) and, on the lent GPU, ``attention_backend`` ``TRITON_ATTN`` (vLLM picks
FLASH_ATTN first on SM90; the staged engine there has no flash-attn kernels).
"""
from __future__ import annotations

import json
import os

METHODS = ("ngram", "dspark", "dflash2")
STAGED_GPU_DRAFTER_KEYS = {"attention_backend": "TRITON_ATTN"}


def reference_outputs(path: str) -> list[list[int]]:
    """Every output of every LLM arm of an earlier gpu_connector.json, as token lists."""
    with open(path) as f:
        doc = json.load(f)
    return [o["tokens"] for arm in doc["arms"].values() if "error" not in arm
            for sc in arm.get("scenarios", {}).values()
            for o in (sc.get("outputs") or {}).values() if o]


def build_drafter(method: str, target: str, out_dir: str, k: int,
                  sequences: list[list[int]]) -> str | None:
    """The drafter directory of ``method`` (built under ``out_dir``), None for ngram."""
    if method == "ngram":
        return None
    from vllm_dhisparse.demo_build import drafters
    d = os.path.join(out_dir, f"drafter_{method}")
    argv = [method, "--target", target, "--out", d, "--k", str(k)]
    if method == "dspark":
        ref = os.path.join(out_dir, "drafter_ref.json")
        with open(ref, "w") as f:
            json.dump({"outputs": [{"token_ids": p} for p in sequences]}, f)
        argv += ["--ref", ref]
    drafters.main(argv)
    return d


def speculative_config(method: str, k: int, drafter: str | None, cuda: bool) -> dict:
    """vLLM's ``speculative_config`` for ``method`` with K = ``k`` draft tokens."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k,
                "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    from vllm_dhisparse.spec import SpecPreset
    cfg = SpecPreset(method, drafter, k).speculative_config(cuda=cuda)
    return {**cfg, **STAGED_GPU_DRAFTER_KEYS} if cuda else cfg
