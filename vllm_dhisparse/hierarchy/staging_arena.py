"""Verification staging reused across layers: chi ``staging_arena`` s (paper 3.4, eq. 11).

A verification step resolves K_r queries per request at once; their union of
missing rows can exceed the B-row hot cache, and the rows the step itself
computed are not in the hierarchy yet.  Both are read by one layer's attention
and by nothing after it, so their rows live in an arena the layer holds only
while it runs: a source *takes* an arena before it resolves and *releases* it
when its attention returned.  With chi payload sources live at once (1 on CPU,
where layers run one after another) chi arenas serve every layer, instead of
per-request staging pages in every source's pool.

Layout: arena ``a`` is ``batch_rows x columns`` rows of the shared storage
(``DeviceRows``) its sources' pools live in, so a source's attention reads
arena rows and pool rows from one tensor.  Batch row ``n`` of a resolve call
owns the ``columns`` rows ``base + (a * batch_rows + n) * columns + [0, columns)``:
overflow misses take the first columns (``overflow_rows``), rows computed in
the step the last ones (``fresh_rows``).  Requests never share a row, so what
one request stages cannot overwrite another's.

Copy-back: the resolver never links a staged row into the hot cache (overflow
misses "do not enter the hot cache", ``triton_kernels/reference.py``), and
nothing else points into an arena, so releasing one needs no copy; the next
taker overwrites rows nobody references.
"""
from __future__ import annotations

import numpy as np
import torch

from .device_pool import DeviceRows


class ArenaLease:
    """One source's hold on one arena, from ``take`` to ``release``."""

    def __init__(self, arenas: "StagingArenas", source: str, index: int):
        self.arenas = arenas
        self.source = source
        self.index = index
        self.released = False
        n = arenas.batch_rows
        self._overflow = np.zeros(n, dtype=np.int64)  # [batch_rows] columns handed out
        self._fresh = np.zeros(n, dtype=np.int64)  # [batch_rows] fresh rows handed out

    @property
    def rows_used(self) -> int:
        return int(self._overflow.sum() + self._fresh.sum())

    def _check(self, batch_rows: list[int]) -> None:
        if self.released:
            raise RuntimeError(f"staging arena {self.index} of source {self.source!r} was released: "
                               f"its rows may already hold another layer's rows")
        bad = [b for b in batch_rows if not 0 <= b < self.arenas.batch_rows]
        if bad:
            raise ValueError(f"batch rows {bad} outside the {self.arenas.batch_rows} batch rows of "
                             f"staging arena {self.index}")

    def overflow_rows(self, batch_rows: list[int], columns: int) -> torch.Tensor:
        """Device rows for the overflow misses of each batch row.  # [len(batch_rows), columns] int32"""
        self._check(batch_rows)
        a = self.arenas
        if columns > a.columns:
            raise ValueError(f"{columns} overflow rows per request exceed the {a.columns} columns "
                             f"of a staging arena (K_max * k - B plus this step's rows)")
        if (a.columns - self._fresh[batch_rows] < columns).any():
            raise RuntimeError(f"overflow and fresh rows of one request overlap in staging arena "
                               f"{self.index}: {columns} + {int(self._fresh[batch_rows].max())} > "
                               f"{a.columns} columns")
        self._overflow[batch_rows] = np.maximum(self._overflow[batch_rows], columns)
        a._account()
        table = a.table[self.index]  # [batch_rows, columns] int32
        if not batch_rows:
            return table[:0, :columns]
        lo, hi = batch_rows[0], batch_rows[-1] + 1
        if batch_rows == list(range(lo, hi)):  # the usual call: a view, no copy
            return table[lo:hi, :columns]
        idx = torch.tensor(batch_rows, dtype=torch.int64).to(table.device)
        return table[idx, :columns]

    def fresh_rows(self, batch_row: int, n: int) -> torch.Tensor:
        """Device rows for ``n`` rows computed in this step (the last columns).  # [n] int64"""
        self._check([batch_row])
        a = self.arenas
        if n > a.columns - int(self._overflow[batch_row]):
            raise RuntimeError(f"{n} rows computed this step do not fit staging arena {self.index} "
                               f"next to {int(self._overflow[batch_row])} overflow rows "
                               f"({a.columns} columns)")
        self._fresh[batch_row] = max(int(self._fresh[batch_row]), n)
        a._account()
        return a.table[self.index, batch_row, a.columns - n:].to(torch.int64)


class StagingArenas:
    """``arenas`` (chi) arenas of ``batch_rows x columns`` rows at ``base_row`` of ``rows``."""

    def __init__(self, *, rows: DeviceRows, base_row: int, arenas: int, batch_rows: int,
                 columns: int):
        if arenas < 1 or batch_rows < 1 or columns < 1:
            raise ValueError(f"staging arenas: arenas={arenas}, batch_rows={batch_rows}, "
                             f"columns={columns} must all be >= 1")
        if base_row < 0 or base_row + arenas * batch_rows * columns > rows.num_rows:
            raise ValueError(f"staging arenas: {arenas} x {batch_rows} x {columns} rows at row "
                             f"{base_row} do not fit shared storage {rows.name!r} "
                             f"({rows.num_rows} rows)")
        self.rows = rows
        self.base_row = base_row
        self.arenas, self.batch_rows, self.columns = arenas, batch_rows, columns
        self.row_bytes = rows.row_bytes
        first = torch.arange(arenas * batch_rows * columns, dtype=torch.int32) + base_row
        self.table = first.view(arenas, batch_rows, columns).to(rows.device)  # [chi, N, C] int32
        self._live: dict[int, ArenaLease] = {}  # arena -> its lease
        self._cursor = 0  # next arena in execution order (arena j mod chi)
        self._used_this_step: set[int] = set()
        self.takes = 0
        self.reuses = 0  # takes of an arena another layer already staged in this step
        self.step_peak_bytes = 0  # most arena bytes handed out at once, this step
        self.last_step_peak_bytes = 0
        self.max_step_peak_bytes = 0

    @property
    def num_rows(self) -> int:
        return self.arenas * self.batch_rows * self.columns

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.row_bytes

    def live_sources(self) -> list[str]:
        return [lease.source for lease in self._live.values()]

    def take(self, source: str) -> ArenaLease:
        """An arena for ``source``'s layer; ``RuntimeError`` when all chi are held."""
        if source in self.live_sources():
            raise RuntimeError(f"source {source!r} already holds a staging arena; it releases it "
                               f"when its layer's attention returns")
        free = [(self._cursor + i) % self.arenas for i in range(self.arenas)
                if (self._cursor + i) % self.arenas not in self._live]
        if not free:
            raise RuntimeError(
                f"staging_arenas = {self.arenas}: every arena is held (sources "
                f"{self.live_sources()}), so source {source!r} cannot stage until one of their "
                f"attention calls returns; set staging_arenas to the number of payload sources "
                f"whose attention runs at once")
        index = free[0]
        self._cursor = (index + 1) % self.arenas
        self.reuses += index in self._used_this_step
        self._used_this_step.add(index)
        self.takes += 1
        lease = ArenaLease(self, source, index)
        self._live[index] = lease
        return lease

    def release(self, lease: ArenaLease) -> None:
        if lease.arenas is not self or self._live.get(lease.index) is not lease:
            raise RuntimeError(f"staging arena {lease.index} of source {lease.source!r} is not "
                               f"held by that lease (released twice?)")
        del self._live[lease.index]
        lease.released = True

    def _account(self) -> None:
        live = sum(lease.rows_used for lease in self._live.values()) * self.row_bytes
        self.step_peak_bytes = max(self.step_peak_bytes, live)

    def end_step(self) -> None:
        """Between steps: this step's peak becomes the published one; reuse restarts."""
        self.last_step_peak_bytes = self.step_peak_bytes
        self.max_step_peak_bytes = max(self.max_step_peak_bytes, self.step_peak_bytes)
        self.step_peak_bytes = 0
        self._used_this_step = set(self._live)

    def stats(self) -> dict:
        return dict(arenas=self.arenas, batch_rows=self.batch_rows, columns=self.columns,
                    arena_bytes=self.nbytes, arena_takes=self.takes, arena_reuses=self.reuses,
                    staging_bytes=self.last_step_peak_bytes,
                    staging_bytes_step_max=self.max_step_peak_bytes)


def sum_stats(per_layout: list[dict]) -> dict:
    """Arena stats over storages (each with its own arenas): sizes and counters add up."""
    keys = ("arena_bytes", "arena_takes", "arena_reuses", "staging_bytes",
            "staging_bytes_step_max")
    out = {k: sum(d[k] for d in per_layout) for k in keys}
    out["arenas"] = max((d["arenas"] for d in per_layout), default=0)
    return out
