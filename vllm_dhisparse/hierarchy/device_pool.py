"""Page pool of one KV source on the device.

A page holds ``page_size`` consecutive rows of ``row_bytes`` bytes.  The pool
only hands pages out and takes them back; *what* a page holds (hot cache, tail,
optional history, staging) and whether it is required or reclaimable is the
residency manager's business.  Allocation returns ``None`` when there is no
room, never raises: "not now" is an ordinary answer.

Row layout.  A row may be stored as several components, each in a *plane* of its
own: DeepSeek-V4's fp8_ds_mla rows are 576 data bytes + 8 scale bytes, and its
attention op reads a block as ``[rows x 576][rows x 8]``.  With
``plane_bytes=(576, 8)`` the pool's storage is exactly that layout with the whole
pool as one block, so attention reads the pool in place.  Locations are the
same in every plane; ``read`` / ``write`` move whole logical rows.

Shared storage.  Sources whose rows have the same layout can keep their pools
in one :class:`DeviceRows` (each pool a range of its rows) next to regions
that belong to no pool, such as the verification ``staging_arena``: the
attention op reads one tensor per call, so every row a source's attention may
read -- its own pages and the arena rows it stages into -- must sit in that
tensor.  Locations (``first_row``, ``page_rows``) are rows of the shared
storage; a pool's pages stay its own.
"""
from __future__ import annotations

import torch

from .devices import canonical_device


class DeviceRows:
    """``num_rows`` rows of ``sum(plane_bytes)`` bytes, stored plane by plane:
    ``[num_rows x plane_bytes[0]][num_rows x plane_bytes[1]]...`` (fp8_ds_mla's block
    layout with the whole storage as one block)."""

    def __init__(self, *, name: str, num_rows: int, plane_bytes: tuple[int, ...],
                 device: torch.device | str = "cpu"):
        plane_bytes = tuple(plane_bytes)
        if num_rows <= 0 or not plane_bytes or min(plane_bytes) <= 0:
            raise ValueError(f"device rows {name!r}: num_rows={num_rows}, "
                             f"plane_bytes={plane_bytes} must be > 0")
        self.name = name
        self.num_rows = num_rows
        self.row_bytes = sum(plane_bytes)
        self.device = canonical_device(device)
        self.storage = torch.zeros(num_rows * self.row_bytes, dtype=torch.uint8, device=self.device)
        # (first byte of the plane's component inside a logical row, plane [num_rows, bytes])
        self.planes: list[tuple[int, torch.Tensor]] = []
        offset = start = 0
        for width in plane_bytes:
            plane = self.storage[offset:offset + num_rows * width].view(num_rows, width)
            self.planes.append((start, plane))
            offset += num_rows * width
            start += width

    @property
    def nbytes(self) -> int:
        return self.storage.numel()


class DevicePagePool:
    def __init__(self, *, name: str, num_pages: int, page_size: int, row_bytes: int,
                 device: torch.device | str = "cpu", plane_bytes: tuple[int, ...] | None = None,
                 rows: DeviceRows | None = None, base_row: int = 0):
        """``rows``/``base_row``: the pool's pages are rows ``[base_row, base_row +
        num_pages * page_size)`` of a shared storage; without ``rows`` it gets its own."""
        if num_pages <= 0 or page_size <= 0 or row_bytes <= 0:
            raise ValueError(f"device pool {name!r}: num_pages={num_pages}, page_size={page_size}, "
                             f"row_bytes={row_bytes} must all be > 0")
        plane_bytes = tuple(plane_bytes) if plane_bytes else (row_bytes,)
        if sum(plane_bytes) != row_bytes or min(plane_bytes) <= 0:
            raise ValueError(f"device pool {name!r}: plane_bytes {plane_bytes} must be positive "
                             f"and sum to row_bytes={row_bytes}")
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        self.row_bytes = row_bytes
        self.num_rows = num_pages * page_size
        if rows is None:
            rows, base_row = DeviceRows(name=name, num_rows=self.num_rows, plane_bytes=plane_bytes,
                                        device=device), 0
        layout = tuple(p.shape[1] for _, p in rows.planes)
        if layout != plane_bytes or not 0 <= base_row <= rows.num_rows - self.num_rows:
            raise ValueError(f"device pool {name!r}: rows [{base_row}, {base_row + self.num_rows}) "
                             f"with plane_bytes {plane_bytes} do not fit shared storage "
                             f"{rows.name!r} ({rows.num_rows} rows, plane_bytes {layout})")
        self.device_rows = rows
        self.base_row = base_row
        self.device = rows.device
        self.storage = rows.storage
        self.planes = rows.planes
        # Lowest page first keeps allocation deterministic (tests replay sequences).
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def row_range(self) -> tuple[int, int]:
        """Rows of the storage this pool's pages cover: ``[first, end)``."""
        return self.base_row, self.base_row + self.num_rows

    @property
    def rows(self) -> torch.Tensor:
        """The row plane when rows are stored whole; locations index it (shared storage:
        every row of it, not only this pool's).  # [storage rows, row_bytes] uint8"""
        if len(self.planes) != 1:
            raise AttributeError(f"device pool {self.name!r} stores rows in {len(self.planes)} "
                                 f"planes; use read()/write()")
        return self.planes[0][1]

    def write(self, locs: torch.Tensor, data: torch.Tensor) -> None:
        """``row[locs[i]] = data[i]`` for logical rows.  locs [n] int, data [n, row_bytes] uint8."""
        locs = locs.to(self.device, torch.int64, non_blocking=True)
        for start, plane in self.planes:
            plane[locs] = data[:, start:start + plane.shape[1]].to(self.device)

    def plane_rows(self, first: int, n: int) -> list[tuple[int, torch.Tensor]]:
        """Rows ``[first, first + n)`` as contiguous views of every plane, for copies in
        and out: ``[(first byte inside a row, uint8 [n, plane bytes])]``."""
        return [(start, plane[first:first + n]) for start, plane in self.planes]

    def page_planes(self, pages: list[int]) -> list[tuple[int, torch.Tensor]]:
        """The rows of ``pages`` in order, as ``plane_rows`` gives them: views when the
        pages are consecutive, else one gather per plane (a new tensor)."""
        if pages == list(range(pages[0], pages[0] + len(pages))):
            return self.plane_rows(self.first_row(pages[0]), len(pages) * self.page_size)
        locs = self.page_rows(pages).to(self.device, non_blocking=True)
        return [(start, plane[locs]) for start, plane in self.planes]

    def write_range(self, first: int, data: torch.Tensor) -> None:
        for start, plane in self.planes:
            plane[first:first + data.shape[0]] = data[:, start:start + plane.shape[1]].to(self.device)

    def read(self, locs: torch.Tensor) -> torch.Tensor:
        """Logical rows at ``locs``.  # [n, row_bytes] uint8"""
        locs = locs.to(self.device, torch.int64)
        return torch.cat([plane[locs] for _, plane in self.planes], dim=1)

    # -- pages -----------------------------------------------------------------------
    def allocate(self, n: int) -> list[int] | None:
        if n < 0:
            raise ValueError(f"device pool {self.name!r}: cannot allocate {n} pages")
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p not in self._used:
                raise ValueError(f"device pool {self.name!r}: page {p} is not allocated")
            self._used.remove(p)
        self._free.extend(pages)
        self._free.sort(reverse=True)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def first_row(self, page: int) -> int:
        return self.base_row + page * self.page_size

    def page_rows(self, pages: list[int]) -> torch.Tensor:
        """Device rows of ``pages`` in order.  # [len(pages) * page_size] int64"""
        if not pages:
            return torch.empty(0, dtype=torch.int64)
        p = torch.tensor(pages, dtype=torch.int64)
        return (self.base_row + p[:, None] * self.page_size
                + torch.arange(self.page_size)[None, :]).flatten()
