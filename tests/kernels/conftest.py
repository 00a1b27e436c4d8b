"""Kernel tests run the Triton kernels in Triton's interpreter when there is no GPU.

TRITON_INTERPRET must be set before triton is first imported.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
