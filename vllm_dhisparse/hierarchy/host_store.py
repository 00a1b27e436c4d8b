"""Host backing store: full KV history rows of each (request, source) in host memory.

Rows are raw bytes (``uint8 [rows, row_bytes]``) so any row format fits: 584 B
fp8_ds_mla rows on CPU, 656 B on GPU, 2.4 KB GLM layer rows.  Memory is pinned
(exactly, see ``pinned.py``) when CUDA is present, so resolver kernels read it
zero-copy and copies to and from it are asynchronous.

Each request gets one *contiguous* extent sized for its maximum length: random
656 B reads spread over a 32 GiB pool ran at ~18 GB/s on the H200 against
~45 GB/s inside one request's region.

Writes are two-phase (``prepare_backup`` -> ``complete_backup``): a backup copies
a contiguous run of rows straight into the request's slice of the pool on the
copy stream, and the rows count as host-backed only once that copy completed,
never when it was merely issued.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from .pinned import host_buffer
from .transfers import CopyStream, Planes, Transfer


@dataclass
class PendingBackup:
    req_id: str
    first: int  # request-local rows [first, first + count) being written
    count: int
    transfer: Transfer = field(default_factory=Transfer)
    done: bool = field(default=False)


class HostBackupError(RuntimeError):
    """A host backup copy failed; the request that owns the rows cannot be served."""

    def __init__(self, message: str, req_id: str | None = None):
        super().__init__(message)
        self.req_id = req_id


class HostStore:
    def __init__(self, *, name: str, row_bytes: int, capacity_rows: int, pin: bool | None = None,
                 copies: CopyStream | None = None):
        if row_bytes <= 0 or capacity_rows <= 0:
            raise ValueError(f"host store {name!r}: row_bytes={row_bytes} and "
                             f"capacity_rows={capacity_rows} must be > 0")
        self.name = name
        self.row_bytes = row_bytes
        self.capacity_rows = capacity_rows
        if pin is None:
            pin = torch.cuda.is_available()
        self.copies = copies or CopyStream("cpu")
        self.rows = host_buffer(capacity_rows * row_bytes, pin).view(capacity_rows, row_bytes)
        self._extent: dict[str, tuple[int, int]] = {}  # req -> (base, length)
        self._backed: dict[str, torch.Tensor] = {}  # req -> [length] bool
        self._free: list[tuple[int, int]] = [(0, capacity_rows)]  # sorted (base, length)

    # -- extents -------------------------------------------------------------
    def allocate(self, req_id: str, max_rows: int) -> int | None:
        """Reserves ``max_rows`` contiguous rows; None when no extent is large enough."""
        if req_id in self._extent:
            raise ValueError(f"host store {self.name!r}: request {req_id!r} already allocated")
        if max_rows <= 0 or max_rows > self.capacity_rows:
            raise ValueError(f"host store {self.name!r}: request {req_id!r} asks for {max_rows} "
                             f"rows; allowed 1..{self.capacity_rows} (host pool capacity)")
        for i, (base, length) in enumerate(self._free):
            if length >= max_rows:
                if length == max_rows:
                    self._free.pop(i)
                else:
                    self._free[i] = (base + max_rows, length - max_rows)
                self._extent[req_id] = (base, max_rows)
                self._backed[req_id] = torch.zeros(max_rows, dtype=torch.bool)
                return base
        return None

    def can_allocate(self, max_rows: int) -> bool:
        """Whether ``allocate`` of ``max_rows`` would succeed now (changes nothing)."""
        return any(length >= max_rows for _, length in self._free)

    def free(self, req_id: str) -> None:
        base, length = self._extent.pop(self._require(req_id))
        del self._backed[req_id]
        bisect.insort(self._free, (base, length))
        merged: list[tuple[int, int]] = []
        for b, n in self._free:  # coalesce neighbours so large extents reappear
            if merged and merged[-1][0] + merged[-1][1] == b:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((b, n))
        self._free = merged

    def _require(self, req_id: str) -> str:
        if req_id not in self._extent:
            raise KeyError(f"host store {self.name!r}: unknown request id {req_id!r}")
        return req_id

    def base(self, req_id: str) -> int:
        return self._extent[self._require(req_id)][0]

    def length(self, req_id: str) -> int:
        return self._extent[self._require(req_id)][1]

    def has(self, req_id: str) -> bool:
        return req_id in self._extent

    # -- backups (two-phase) ----------------------------------------------------
    def slice(self, req_id: str, first: int, count: int) -> torch.Tensor:
        """Rows ``[first, first + count)`` of ``req_id``: a contiguous view of the pool
        (pinned on CUDA).  # [count, row_bytes] uint8"""
        row = self.row_of(req_id, first, count)
        return self.rows[row:row + count]

    def row_of(self, req_id: str, first: int, count: int) -> int:
        """Row of ``rows`` holding row ``first`` of ``req_id``, checked to have ``count``
        rows of the request from there."""
        base, length = self._extent[self._require(req_id)]
        if first < 0 or count < 0 or first + count > length:
            raise IndexError(f"host store {self.name!r}: request {req_id!r} rows "
                             f"[{first}, {first + count}) outside [0, {length})")
        return base + first

    def backup_slices(self, req_id: str, firsts: list[int], count: int) -> list[torch.Tensor]:
        """Where backups of ``count`` rows of ``req_id`` from each of ``firsts`` write:
        contiguous views of its extent, as ``slice`` gives them.  Every backup takes its
        destinations here, one request at a time, before anything is copied: a request
        whose backup cannot start (``HostBackupError``) fails alone."""
        return [self.slice(req_id, first, count) for first in firsts]

    def prepare_backup(self, req_id: str, first: int, data: torch.Tensor | Planes) -> PendingBackup:
        """Starts copying ``data`` into rows ``[first, first + n)`` of ``req_id``:
        ``uint8 [n, row_bytes]`` on any device, or device planes ``[(first byte,
        uint8 [n, plane bytes])]`` covering the row (``DevicePagePool.plane_rows``)."""
        planes = [(0, data)] if isinstance(data, torch.Tensor) else list(data)
        n = planes[0][1].shape[0]
        if any(p.dtype != torch.uint8 or p.dim() != 2 or p.shape[0] != n for _, p in planes) \
                or sum(p.shape[1] for _, p in planes) != self.row_bytes:
            raise ValueError(f"host store {self.name!r}: backup data must be uint8 "
                             f"[n, {self.row_bytes}] (or planes summing to it), got "
                             f"{[(p.dtype, tuple(p.shape)) for _, p in planes]}")
        dst, = self.backup_slices(req_id, [first], n)
        return PendingBackup(req_id, first, n, self.copies.to_host(dst, planes))

    def prepare_backups(self, items: list[tuple[str, int, torch.Tensor]],
                        data: Planes) -> list[PendingBackup]:
        """``prepare_backup`` for each ``(request, first row, destination)`` of ``items``,
        the destinations from ``backup_slices``: item i's rows are the next
        ``len(destination)`` rows of the device planes ``data``.  One pass over the copy
        stream, one event shared by the returned backups."""
        n = sum(dst.shape[0] for _, _, dst in items)
        if any(p.dtype != torch.uint8 or p.dim() != 2 or p.shape[0] != n for _, p in data) \
                or sum(p.shape[1] for _, p in data) != self.row_bytes:
            raise ValueError(f"host store {self.name!r}: backup data must be planes of "
                             f"{n} uint8 rows summing to {self.row_bytes} bytes, got "
                             f"{[(p.dtype, tuple(p.shape)) for _, p in data]}")
        transfer = self.copies.to_host_rows([dst for _, _, dst in items], data)
        return [PendingBackup(req_id, first, dst.shape[0], transfer)
                for req_id, first, dst in items]

    def backup_done(self, pending: PendingBackup) -> bool:
        """Whether the copy completed (polls; never waits)."""
        return pending.transfer.done()

    def complete_backup(self, pending: PendingBackup) -> None:
        """Marks the rows backed once their copy finished (waits for it)."""
        pending.transfer.wait()
        pending.transfer = Transfer()
        if pending.req_id in self._backed:  # request may have finished meanwhile
            self._backed[pending.req_id][pending.first:pending.first + pending.count] = True
        pending.done = True

    def backed(self, req_id: str) -> torch.Tensor:
        """Which rows of ``req_id`` have a complete host copy.  # [length] bool (CPU)"""
        return self._backed[self._require(req_id)]

    def read(self, req_id: str, rows: torch.Tensor) -> torch.Tensor:
        """A synchronous copy of backed rows (tests and invariant checks)."""
        base, _ = self._extent[self._require(req_id)]
        return self.rows[base + rows.to(torch.int64).cpu()]

    # -- accounting ----------------------------------------------------------------
    @property
    def rows_used(self) -> int:
        return sum(n for _, n in self._extent.values())

    @property
    def bytes_used(self) -> int:
        return self.rows_used * self.row_bytes

    @property
    def bytes_total(self) -> int:
        return self.capacity_rows * self.row_bytes
