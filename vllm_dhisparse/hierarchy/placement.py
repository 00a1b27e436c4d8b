"""Where every source's pool and the staging arenas live in device storage.

Sources whose rows have one layout (``SourceSpec.layout``) share a ``DeviceRows``:
their pools back to back, then chi staging arenas, so that a location is a row of one
tensor the attention op reads whatever the source, and the arenas are allocated once
for all the layers that take turns in them (paper 3.4).  Where that storage would pass
what one attention block can hold (2**31 B), the layout gets several storages of equal
size, each with its own arenas (``specs.storage_groups``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .device_pool import DeviceRows
from .specs import SourceSpec, StagingSpec, storage_groups
from .staging_arena import StagingArenas


@dataclass(frozen=True)
class Placement:
    rows: DeviceRows  # the storage the source's pool is a range of
    base_row: int  # the pool's first row in it
    arenas: StagingArenas | None  # the storage's arenas (None without staging)


def place(specs: list[SourceSpec], staging: StagingSpec | None, device: torch.device | str
          ) -> tuple[list[DeviceRows], list[StagingArenas], dict[str, Placement]]:
    """Each storage ``[pool of each member][chi arenas][padding]``: the storages, their
    arenas, and each source's place."""
    storages, all_arenas, placed = [], [], {}
    for g in storage_groups(specs, staging):
        rows = DeviceRows(name="+".join(m.name for m in g.members), num_rows=g.num_rows,
                          plane_bytes=g.layout, device=device)
        storages.append(rows)
        arenas = StagingArenas(rows=rows, base_row=g.pool_rows, arenas=g.arenas,
                               batch_rows=max(m.max_req_slots for m in g.members),
                               columns=staging.columns) if staging else None
        all_arenas += [arenas] if arenas else []
        base = 0
        for m in g.members:
            placed[m.name] = Placement(rows, base, arenas)
            base += m.device_pages * m.page_size
    return storages, all_arenas, placed
