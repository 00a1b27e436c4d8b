"""Kernel tests run the Triton kernels in Triton's interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # where the venv's start-up hook did not run
    from vllm_dhisparse.compat.triton_interpreter import fix_numpy_2_4
    fix_numpy_2_4()
