"""Host backing store: full KV history rows of each (request, source) in host memory.

Rows are raw bytes (``uint8 [rows, row_bytes]``) so any row format fits: 584 B
fp8_ds_mla rows on CPU, 656 B on GPU, 2.4 KB GLM layer rows.  Memory is pinned
when CUDA is present, so resolver kernels read it zero-copy.

Each request gets one *contiguous* extent sized for its maximum length: random
656 B reads spread over a 32 GiB pool ran at ~18 GB/s on the H200 against
~45 GB/s inside one request's region (shared/notes/environment.md).

Writes are two-phase (``prepare_backup`` -> ``complete_backup``): a row counts
as host-backed only after its copy completed, never when it was merely issued.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch


@dataclass
class PendingBackup:
    req_id: str
    rows: torch.Tensor  # [n] int64 request-local rows being written
    event: object = None  # torch.cuda.Event when the copy is asynchronous
    done: bool = field(default=False)


class HostBackupError(RuntimeError):
    """A host backup copy failed; the request that owns the rows cannot be served."""

    def __init__(self, message: str, req_id: str | None = None):
        super().__init__(message)
        self.req_id = req_id


class HostStore:
    def __init__(self, *, name: str, row_bytes: int, capacity_rows: int, pin: bool | None = None):
        if row_bytes <= 0 or capacity_rows <= 0:
            raise ValueError(f"host store {name!r}: row_bytes={row_bytes} and "
                             f"capacity_rows={capacity_rows} must be > 0")
        self.name = name
        self.row_bytes = row_bytes
        self.capacity_rows = capacity_rows
        if pin is None:
            pin = torch.cuda.is_available()
        self.rows = torch.empty((capacity_rows, row_bytes), dtype=torch.uint8, pin_memory=pin)
        self._extent: dict[str, tuple[int, int]] = {}  # req -> (base, length)
        self._backed: dict[str, torch.Tensor] = {}  # req -> [length] bool
        self._free: list[tuple[int, int]] = [(0, capacity_rows)]  # sorted (base, length)
        self.fail_next_backup_of: set[str] = set()  # fault injection for tests

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
    def prepare_backup(self, req_id: str, rows: torch.Tensor, data: torch.Tensor) -> PendingBackup:
        """Starts copying ``data`` ([n, row_bytes] uint8, any device) into rows ``rows``."""
        base, length = self._extent[self._require(req_id)]
        rows = rows.to(torch.int64).cpu()
        if data.dtype != torch.uint8 or data.shape != (rows.numel(), self.row_bytes):
            raise ValueError(f"host store {self.name!r}: backup data must be uint8 "
                             f"[{rows.numel()}, {self.row_bytes}], got {data.dtype} {tuple(data.shape)}")
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= length):
            raise IndexError(f"host store {self.name!r}: request {req_id!r} rows "
                             f"[{int(rows.min())}, {int(rows.max())}] outside [0, {length})")
        if req_id in self.fail_next_backup_of:
            self.fail_next_backup_of.discard(req_id)
            raise HostBackupError(f"host store {self.name!r}: backup of request {req_id!r} failed "
                                  f"(injected fault)", req_id=req_id)
        pending = PendingBackup(req_id, rows)
        if data.is_cuda and self.rows.is_pinned():
            self.rows[base + rows] = data.to("cpu", non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record()
        else:
            self.rows[base + rows] = data.cpu()
        return pending

    def complete_backup(self, pending: PendingBackup) -> None:
        """Marks rows backed once their copy finished (waits for it)."""
        if pending.event is not None:
            pending.event.synchronize()
        if pending.req_id in self._backed:  # request may have finished meanwhile
            self._backed[pending.req_id][pending.rows] = True
        pending.done = True

    def backed(self, req_id: str) -> torch.Tensor:
        """Which rows of ``req_id`` have a complete host copy.  # [length] bool (CPU)"""
        return self._backed[self._require(req_id)]

    def read(self, req_id: str, rows: torch.Tensor) -> torch.Tensor:
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
