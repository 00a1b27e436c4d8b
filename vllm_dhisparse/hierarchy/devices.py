"""Device identity: ``cuda`` and ``cuda:0`` name the same GPU when 0 is current.

torch compares ``torch.device`` objects field by field, so a table created on
``"cuda"`` and selections on ``cuda:0`` compare unequal although both live on
one GPU.  Everything in the hierarchy stores the canonical form and compares
through :func:`same_device`.
"""
from __future__ import annotations

import numpy as np
import torch


def canonical_device(device: torch.device | str | int) -> torch.device:
    """``device`` with its index filled in (the current CUDA device for a bare ``cuda``)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        return torch.device("cuda", index)
    return device


def same_device(a: torch.device | str, b: torch.device | str) -> bool:
    return canonical_device(a) == canonical_device(b)


def host_index(values: list[int], device: torch.device) -> torch.Tensor:
    """int64 index tensor built on the host and copied without waiting for the device
    (no host synchronisation per call; the copy is ordered before later work)."""
    return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)


def host_indices(*columns: list[int], device: torch.device) -> torch.Tensor:
    """:func:`host_index` of several equally long lists in one copy.  # [len(columns), n] int64"""
    return torch.from_numpy(np.array(columns, dtype=np.int64)).to(device, non_blocking=True)
