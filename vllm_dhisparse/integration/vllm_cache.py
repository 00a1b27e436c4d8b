"""Reading rows out of vLLM's paged c4a compressed caches.

A block of an ``fp8_ds_mla`` c4a cache is ``[rows x 576 B data][rows x 8 B
scales]``, padded to a multiple of 576 B (``attention.py:873``); a logical row
of the hierarchy is the row's data followed by its scales (``plane_bytes``).
"""
from __future__ import annotations

import torch

from .model_probe import SparseLayer


class VllmC4aCaches:
    def __init__(self):
        self.caches: dict[str, torch.Tensor] = {}  # layer -> [blocks, block_bytes] uint8

    def register(self, kv_caches: dict[str, torch.Tensor], layers) -> None:
        for name in layers:
            if name not in kv_caches:
                raise ValueError(f"sparse layer {name!r} has no KV cache; caches: {sorted(kv_caches)}")
            cache = kv_caches[name].view(torch.uint8)
            self.caches[name] = cache.reshape(cache.shape[0], -1)

    def rows(self, layer: SparseLayer, block_ids: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of the request whose blocks (in ``layer``'s KV cache group) are
        ``block_ids``.  # [n, row_bytes] uint8"""
        cache = self.caches[layer.name]
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        rows = rows.to(torch.int64).cpu()
        b = blocks[rows // layer.rows_per_block].to(cache.device)
        pos = (rows % layer.rows_per_block).to(cache.device)
        parts, plane_start = [], 0
        for width in layer.plane_bytes:  # plane s of a block starts after rows_per_block rows of s-1
            cols = plane_start + pos[:, None] * width + torch.arange(width, device=cache.device)
            parts.append(cache[b[:, None], cols])
            plane_start += layer.rows_per_block * width
        return torch.cat(parts, dim=1)

    def first_rows(self, layer: SparseLayer, block_ids: list[int], n: int) -> torch.Tensor:
        """Rows ``0..n-1`` of the request whose blocks are ``block_ids``.  # [n, row_bytes]"""
        return self.rows(layer, block_ids, torch.arange(n, dtype=torch.int64))
