"""Device-side state of one KV source: per request slot, the tables the resolver reads.

A *source* is one physical KV payload (e.g. DeepSeek-V4's compressed c4a
cache, or one GLM layer) with fixed ``row_bytes``.  Every admitted request
gets a *request slot* (row ``s`` of the tables below) for each source it uses; a
*hot slot* is one of the B entries of a request slot's hot cache.

Tables, all on the pool's device, one row per request slot:

* ``page_table [S, max_pages] int32`` — the *direct map*: device row of the
  first row of each history page that is ready on device (tail pages and ready
  optional-history pages), -1 otherwise.  Only *ready* pages are published
  here; an allocated page whose copy is still pending stays -1 (paper 3.1:
  ready vs allocated).
* ``hot_pos / hot_loc / hot_stamp [S, B] int32``, ``hot_clock [S] int32`` and
  ``hot_slot_of [S, max_rows] int32`` — the B-row hot cache, least recently used
  hot slots evicted first by call stamps (see ``vllm_dhisparse/triton_kernels/reference.py``
  for the update rule).
* ``seq_lens [S] int32`` — rows of history per request slot (selections must be below);
  mirrored on the host, so reading a length never waits for the device.
* ``host_base [S] int64`` — host row of the request's row 0 in the host store.

This class only owns the tables and their reset on open/close; which pages
are ready is decided by the residency manager, which publishes and
unpublishes pages through :meth:`publish_page` / :meth:`unpublish_pages`.
"""
from __future__ import annotations

import numpy as np
import torch

from .devices import canonical_device, host_index, host_indices


class SourceState:
    def __init__(self, *, name: str, row_bytes: int, page_size: int, max_req_slots: int,
                 max_rows: int, hot_cache_rows: int, device: torch.device | str = "cpu"):
        if row_bytes <= 0 or page_size <= 0 or max_req_slots <= 0 or max_rows <= 0:
            raise ValueError(
                f"source {name!r}: row_bytes={row_bytes}, page_size={page_size}, "
                f"max_req_slots={max_req_slots}, max_rows={max_rows} must all be > 0")
        if hot_cache_rows <= 0:
            raise ValueError(f"source {name!r}: hot_cache_rows={hot_cache_rows} must be > 0")
        self.name = name
        self.row_bytes = row_bytes
        self.page_size = page_size
        self.max_req_slots = max_req_slots
        self.max_rows = max_rows
        self.hot_cache_rows = hot_cache_rows
        self.max_pages = -(-max_rows // page_size)
        self.device = canonical_device(device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.page_table = torch.full((max_req_slots, self.max_pages), -1, **i32)
        self.hot_pos = torch.full((max_req_slots, self.hot_cache_rows), -1, **i32)
        self.hot_loc = torch.full((max_req_slots, self.hot_cache_rows), -1, **i32)
        self.hot_stamp = torch.zeros((max_req_slots, self.hot_cache_rows), **i32)
        self.hot_clock = torch.zeros(max_req_slots, **i32)
        self.hot_slot_of = torch.full((max_req_slots, max_rows), -1, **i32)
        self.seq_lens = torch.zeros(max_req_slots, **i32)
        self._seq_len_host = np.zeros(max_req_slots, dtype=np.int64)
        self.host_base = torch.zeros(max_req_slots, dtype=torch.int64, device=self.device)
        self._free_req_slots = list(range(max_req_slots - 1, -1, -1))
        # request slots whose table rows hold the reset values (as built, or reset on
        # close): opening one writes no table row but its hot cache and host base
        self._clean = set(range(max_req_slots))
        self._req_slot_of: dict[str, int] = {}
        # req_slot_tensor() of the last batch
        self._batch: tuple[tuple[str, ...], torch.Tensor] | None = None

    # -- request slot lifecycle -------------------------------------------
    def open_req_slot(self, req_id: str, hot_loc: torch.Tensor, host_base: int) -> int:
        """Binds ``req_id`` to a free request slot whose hot cache lives at ``hot_loc``."""
        if req_id in self._req_slot_of:
            raise ValueError(f"source {self.name!r}: request {req_id!r} already has a request "
                             f"slot")
        if not self._free_req_slots:
            raise RuntimeError(f"source {self.name!r}: all {self.max_req_slots} request slots "
                               f"in use")
        if hot_loc.numel() != self.hot_cache_rows:
            raise ValueError(f"source {self.name!r}: hot cache needs {self.hot_cache_rows} rows, "
                             f"got {hot_loc.numel()}")
        req_slot = self._free_req_slots.pop()
        self._req_slot_of[req_id] = req_slot
        self._batch = None
        if req_slot not in self._clean:
            self._reset(req_slot)
        self._clean.discard(req_slot)
        self.hot_loc[req_slot] = hot_loc.to(self.device, self.hot_loc.dtype, non_blocking=True)
        self.host_base[req_slot:req_slot + 1] = host_base
        return req_slot

    def close_req_slot(self, req_id: str) -> None:
        req_slot = self._req_slot_of.pop(self.require(req_id))
        self._batch = None
        self._reset(req_slot)
        self._clean.add(req_slot)
        self._free_req_slots.append(req_slot)

    def _reset(self, req_slot: int) -> None:
        # slices, never an int index: writing a Python scalar into a 0-d view of a device
        # tensor is a host-to-device copy that synchronises; a slice is a fill
        r = slice(req_slot, req_slot + 1)
        self.page_table[r] = -1
        self.hot_pos[r] = -1
        self.hot_loc[r] = -1
        self.hot_stamp[r] = 0
        self.hot_clock[r] = 0
        self.hot_slot_of[r] = -1
        self.seq_lens[r] = 0
        self._seq_len_host[req_slot] = 0
        self.host_base[r] = 0

    def require(self, req_id: str) -> str:
        if req_id not in self._req_slot_of:
            raise KeyError(f"source {self.name!r}: unknown request id {req_id!r}; "
                           f"{len(self._req_slot_of)} requests are open")
        return req_id

    def req_slot(self, req_id: str) -> int:
        return self._req_slot_of[self.require(req_id)]

    def req_slot_array(self, req_ids) -> np.ndarray:
        """Request slots of ``req_ids`` on the host (the caller checked the ids).  # [N] int64"""
        req_slot_of = self._req_slot_of
        return np.fromiter((req_slot_of[r] for r in req_ids), dtype=np.int64, count=len(req_ids))

    def req_slot_tensor(self, req_ids) -> torch.Tensor:
        """Request slots of ``req_ids`` on the device.  # [N] int32
        Every layer of a step resolves the same batch: the tensor of the last batch is kept
        (read-only for callers) until a request slot opens or closes."""
        key = tuple(req_ids)
        if self._batch is None or self._batch[0] != key:
            req_slots = torch.tensor([self.req_slot(r) for r in key], dtype=torch.int32)
            self._batch = (key, req_slots.to(self.device, non_blocking=True))
        return self._batch[1]

    @property
    def open_requests(self) -> list[str]:
        return list(self._req_slot_of)

    # -- direct map ---------------------------------------------------------
    def publish_page(self, req_id: str, page: int, device_row: int) -> None:
        """Makes history page ``page`` resolvable directly.  Call only after its copy completed."""
        self.page_table[self.req_slot(req_id), page:page + 1] = device_row

    def publish_pages(self, req_slots: list[int], pages: list[int],
                      device_rows: list[int]) -> None:
        """:meth:`publish_page` for many (req_slot, page) at once: one write."""
        if req_slots:
            idx = host_indices(req_slots, pages, device_rows, device=self.device)  # [3, n]
            self.page_table[idx[0], idx[1]] = idx[2].int()

    def unpublish_pages(self, req_slot: int | list[int], pages: list[int]) -> None:
        """Makes ``pages`` of one request slot (or one request slot per page) unresolvable
        directly: one write.  ``index_fill_`` on the flat table takes -1 as a kernel
        argument; assigning a Python scalar through advanced indexing would copy it from
        the host with a synchronisation."""
        if pages:
            flat = np.asarray(req_slot, dtype=np.int64) * self.max_pages \
                + np.asarray(pages, dtype=np.int64)
            self.page_table.view(-1).index_fill_(0, host_index(flat, self.device), -1)

    def set_seq_lens(self, req_slots: list[int], rows: list[int]) -> None:
        """Lengths of many request slots at once (callers check them): one write."""
        if len(req_slots):
            idx = host_indices(req_slots, rows, device=self.device)  # [2, n]
            self.seq_lens[idx[0]] = idx[1].int()
            self._seq_len_host[np.asarray(req_slots, dtype=np.int64)] = rows

    def set_seq_len(self, req_id: str, rows: int) -> None:
        if not 0 <= rows <= self.max_rows:
            raise ValueError(f"source {self.name!r}: request {req_id!r} length {rows} "
                             f"outside [0, {self.max_rows}]")
        req_slot = self.req_slot(req_id)
        self.seq_lens[req_slot:req_slot + 1] = rows
        self._seq_len_host[req_slot] = rows

    def seq_len(self, req_id: str) -> int:
        return int(self._seq_len_host[self.req_slot(req_id)])

    def seq_len_at(self, req_slot: int) -> int:
        return int(self._seq_len_host[req_slot])

    def seq_lens_of(self, req_slots: np.ndarray) -> np.ndarray:
        """Host lengths of ``req_slots``.  # [N] int64"""
        return self._seq_len_host[req_slots]
