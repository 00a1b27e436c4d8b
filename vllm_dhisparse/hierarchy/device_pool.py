"""Page pool of one KV source on the device.

A page holds ``page_size`` consecutive rows of ``row_bytes`` bytes.  The pool
only hands pages out and takes them back; *what* a page holds (hot cache, tail,
optional history, staging) and whether it is required or reclaimable is the
residency manager's business.  Allocation returns ``None`` when there is no
room, never raises: "not now" is an ordinary answer.
"""
from __future__ import annotations

import torch


class DevicePagePool:
    def __init__(self, *, name: str, num_pages: int, page_size: int, row_bytes: int,
                 device: torch.device | str = "cpu"):
        if num_pages <= 0 or page_size <= 0 or row_bytes <= 0:
            raise ValueError(f"device pool {name!r}: num_pages={num_pages}, page_size={page_size}, "
                             f"row_bytes={row_bytes} must all be > 0")
        self.name = name
        self.num_pages = num_pages
        self.page_size = page_size
        self.row_bytes = row_bytes
        self.device = torch.device(device)
        self.rows = torch.zeros((num_pages * page_size, row_bytes), dtype=torch.uint8, device=self.device)
        # Lowest page first keeps allocation deterministic (tests replay sequences).
        self._free = list(range(num_pages - 1, -1, -1))
        self._used: set[int] = set()

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
        self._free.extend(sorted(pages, reverse=True))
        self._free.sort(reverse=True)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def first_row(self, page: int) -> int:
        return page * self.page_size

    def page_rows(self, pages: list[int]) -> torch.Tensor:
        """Device rows of ``pages`` in order.  # [len(pages) * page_size] int64"""
        if not pages:
            return torch.empty(0, dtype=torch.int64)
        p = torch.tensor(pages, dtype=torch.int64)
        return (p[:, None] * self.page_size + torch.arange(self.page_size)[None, :]).flatten()
