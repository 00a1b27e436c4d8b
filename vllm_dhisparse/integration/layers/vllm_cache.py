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
        self._planes: dict[str, list[torch.Tensor]] = {}  # layer -> [blocks, rows, plane] views

    def register(self, kv_caches: dict[str, torch.Tensor], layers) -> None:
        for name in layers:
            if name not in kv_caches:
                raise ValueError(f"sparse layer {name!r} has no KV cache; caches: {sorted(kv_caches)}")
            cache = kv_caches[name].view(torch.uint8)
            try:  # a view, never a copy: rows are read from vLLM's live blocks
                self.caches[name] = cache.view(cache.shape[0], -1)
            except RuntimeError as e:
                raise ValueError(f"sparse layer {name!r}: vLLM's c4a cache {tuple(cache.shape)} "
                                 f"strides {cache.stride()} is not one row of bytes per block "
                                 f"({e})") from e
            self._planes.pop(name, None)

    def planes(self, layer: SparseLayer) -> list[torch.Tensor]:
        """Views of each plane of every block: plane s of a block starts after
        ``rows_per_block`` rows of plane s-1.  # [blocks, rows_per_block, plane_bytes[s]]"""
        views = self._planes.get(layer.name)
        if views is None:
            cache, views, start = self.caches[layer.name], [], 0
            for width in layer.plane_bytes:
                end = start + layer.rows_per_block * width
                views.append(cache[:, start:end].view(cache.shape[0], layer.rows_per_block, width))
                start = end
            self._planes[layer.name] = views
        return views

    def rows(self, layer: SparseLayer, block_ids: list[int], rows: torch.Tensor) -> torch.Tensor:
        """Rows ``rows`` of the request whose blocks (in ``layer``'s KV cache group) are
        ``block_ids``.  # [n, row_bytes] uint8"""
        views = self.planes(layer)
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        rows = rows.to(torch.int64).cpu()
        b = blocks[rows // layer.rows_per_block].to(views[0].device)
        pos = (rows % layer.rows_per_block).to(views[0].device)
        return torch.cat([plane[b, pos] for plane in views], dim=1)

    def write_rows(self, layer: SparseLayer, block_ids: list[int], rows: torch.Tensor,
                   data: torch.Tensor) -> None:
        """The inverse of :meth:`rows`: ``data`` ([n, row_bytes] uint8) becomes rows ``rows``
        of the request whose blocks are ``block_ids``."""
        views = self.planes(layer)
        blocks = torch.tensor(block_ids, dtype=torch.int64)
        rows = rows.to(torch.int64).cpu()
        b = blocks[rows // layer.rows_per_block].to(views[0].device)
        pos = (rows % layer.rows_per_block).to(views[0].device)
        start = 0
        for plane in views:
            width = plane.shape[2]
            plane[b, pos] = data[:, start:start + width].to(plane.device)
            start += width

    def first_rows(self, layer: SparseLayer, block_ids: list[int], n: int) -> torch.Tensor:
        """Rows ``0..n-1`` of the request whose blocks are ``block_ids``.  # [n, row_bytes]"""
        return self.rows(layer, block_ids, torch.arange(n, dtype=torch.int64))
