"""What :class:`~vllm_dhisparse.hierarchy.hierarchy.KVHierarchy` is built from.

``SourceSpec`` describes one physical KV source (its pools and per-request
reservations); ``StagingSpec`` the verification ``staging_arena`` s the sources
share; ``ResidencyConfig`` the load-adaptive residency knobs shared by all
sources.  Both validate in ``__post_init__`` and name the bad value and
what is allowed; ``from_dict`` rejects unknown keys with the valid list.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from .reclaim_policies import DEFAULT_RECLAIM_POLICY, get_reclaim_policy

# A run: the most pages one copy of many pages moves (a reclaim's backup, placing
# imported history, a step's pass of tail backups).  It bounds the rows such a copy
# gathers or stages: 37 MiB at 64-row pages of 584 B, and a reclaim keeps two in flight.
RUN_PAGES = 1024


def _from_dict(cls, what: str, d: Mapping[str, Any]):
    valid = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(d) - set(valid))
    if unknown:
        raise ValueError(f"unknown {what} key(s) {unknown}; valid keys: {valid}")
    return cls(**d)


@dataclass(frozen=True)
class SourceSpec:
    name: str
    row_bytes: int  # bytes of one KV row of this source
    page_size: int  # rows per device page
    device_pages: int  # M of eq. 3 for this source
    host_rows: int  # host backing capacity (all requests)
    hot_cache_rows: int  # B: hot-cache rows per request
    tail_pages: int  # mutable-tail pages per request
    max_req_slots: int  # request slots: concurrent requests
    max_rows: int  # longest request history
    plane_bytes: tuple[int, ...] | None = None  # bytes of each plane of a row, None = one plane

    def __post_init__(self):
        for key, low in (("row_bytes", 1), ("page_size", 1), ("device_pages", 1), ("host_rows", 1),
                         ("hot_cache_rows", 1), ("tail_pages", 1), ("max_req_slots", 1),
                         ("max_rows", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"source {self.name!r}: {key}={value!r}; allowed: int >= {low}")
        if self.max_rows > self.host_rows:
            raise ValueError(f"source {self.name!r}: max_rows={self.max_rows} exceeds "
                             f"host_rows={self.host_rows}; a request's extent must fit the host store")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "SourceSpec":
        return _from_dict(cls, "source spec", d)


    @property
    def layout(self) -> tuple[int, ...]:
        """Byte planes of a row; sources with equal layouts share device storage."""
        return tuple(self.plane_bytes) if self.plane_bytes else (self.row_bytes,)


@dataclass(frozen=True)
class StagingSpec:
    """chi arenas, each ``columns`` rows per batch row (``max_req_slots`` of the sources):
    ``K_max * k - B`` overflow rows plus the rows a step computes (paper eq. 11)."""
    arenas: int  # chi: payload sources whose attention is live at once (1: one after another)
    columns: int  # rows per batch row in one arena

    def __post_init__(self):
        for key in ("arenas", "columns"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"staging {key}={value!r}; allowed: int >= 1")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "StagingSpec":
        return _from_dict(cls, "staging spec", d)


def layout_groups(specs: list[SourceSpec]) -> dict[tuple[int, ...], list[SourceSpec]]:
    """Sources by row layout, in order."""
    groups: dict[tuple[int, ...], list[SourceSpec]] = {}
    for s in specs:
        groups.setdefault(s.layout, []).append(s)
    return groups


# Attention reads a storage as one block of all its rows (flashmla/layout.py), and
# FlashMLA takes a block's stride as a 32-bit int: no storage may pass this.
STORAGE_MAX_BYTES = 2**31 - 1


@dataclass(frozen=True)
class StorageGroup:
    """Sources whose pools share one device storage: ``[pool of each member][arenas][pad]``."""
    layout: tuple[int, ...]
    members: tuple[SourceSpec, ...]
    pool_rows: int  # the members' pools, back to back from row 0
    arenas: int  # chi arenas of this storage (at most one per member)
    arena_rows: int  # the arenas, from row pool_rows
    num_rows: int  # the storage: every storage of one layout has as many (padding at the end)


def storage_groups(specs: list[SourceSpec], staging: StagingSpec | None,
                   max_bytes: int | None = None) -> list[StorageGroup]:
    """The device storages of ``specs``: one per row layout, or, where that would pass
    ``max_bytes``, storages of about equal numbers of consecutive sources, each with its own
    arenas, in the split that allocates the fewest rows (the padding of unequal groups
    against the arenas of more groups).  The storages of a layout get equal row counts, so
    attention sees one block size for every source (FlashMLA plans its schedule once per
    step for all of them).  Raises ``ValueError`` when a single source cannot fit.
    ``max_bytes``: ``STORAGE_MAX_BYTES``."""
    max_bytes = STORAGE_MAX_BYTES if max_bytes is None else max_bytes
    out = []
    for layout, members in layout_groups(specs).items():
        row = sum(layout)
        best = None  # (rows allocated, groups, rows per storage)
        for count in range(1, len(members) + 1):
            groups = [_group(layout, c, staging) for c in _chunks(members, count)]
            rows = max(g.pool_rows + g.arena_rows for g in groups)
            if rows * row <= max_bytes and (best is None or count * rows < best[0]):
                best = (count * rows, groups, rows)
        if best is None:
            alone = max((_group(layout, (m,), staging) for m in members),
                        key=lambda g: g.pool_rows + g.arena_rows)
            m = alone.members[0]
            arenas = f" and {alone.arena_rows} rows of staging arenas" if alone.arena_rows else ""
            raise ValueError(
                f"source {m.name!r}: {m.device_pages} device pages x {m.page_size} rows"
                f"{arenas} of {row} B exceed {max_bytes} B, the most one device storage holds "
                f"(attention reads a storage as one block with a 32-bit stride); lower "
                f"device_pool_pages, max_num_seqs or hot_cache_rows")
        out += [dataclasses.replace(g, num_rows=best[2]) for g in best[1]]
    return out


def _chunks(members, count: int) -> list[tuple]:
    """``members`` in ``count`` consecutive runs; the first ones take one source more."""
    size, extra = divmod(len(members), count)
    out, at = [], 0
    for i in range(count):
        n = size + (i < extra)
        out.append(tuple(members[at:at + n]))
        at += n
    return out


def _group(layout, members, staging) -> StorageGroup:
    # chi arenas serve the layers that take turns in them: a storage of fewer sources
    # than chi needs one per source at most
    pools = sum(s.device_pages * s.page_size for s in members)
    chi = min(staging.arenas, len(members)) if staging else 0
    arena = chi * max(s.max_req_slots for s in members) * staging.columns if staging else 0
    return StorageGroup(layout, members, pools, chi, arena, pools + arena)


def device_bytes(specs: list[SourceSpec], staging: StagingSpec | None) -> int:
    """Device bytes a hierarchy of ``specs`` allocates: pools, arenas and padding."""
    return sum(g.num_rows * sum(g.layout) for g in storage_groups(specs, staging))


@dataclass(frozen=True)
class ResidencyConfig:
    admission_reserve_pages: int = 0  # M_res of eq. 3, per source
    repopulate_pages_per_step: int = 16  # bound per source per step()
    reclaim_policy: str = DEFAULT_RECLAIM_POLICY  # order of eq. 4
    optional_residency: bool = True  # off = imported history goes to host, no repopulation
    eager_backup: bool = False  # back up kept imported pages at admission instead of deferring
    run_pages: int = RUN_PAGES  # most pages one copy of many pages moves

    def __post_init__(self):
        for key, low in (("admission_reserve_pages", 0), ("repopulate_pages_per_step", 0),
                         ("run_pages", 1)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{key}={value!r}; allowed: int >= {low}")
        get_reclaim_policy(self.reclaim_policy)  # ValueError lists the supported names

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "ResidencyConfig":
        return _from_dict(cls, "residency config", d)
