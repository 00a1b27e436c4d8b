"""Copies between the device pool and the host store, on their own CUDA stream.

Backups (device -> host) and repopulation (host -> device) run on one copy
stream per hierarchy, so they overlap the compute stream's work instead of
queueing behind it.  Each copy first makes the copy stream wait for the
compute stream: the rows a backup reads were produced by work queued there,
and the free pages a repopulation writes may still be read by work queued
there.  A copy ends with an event; its :class:`Transfer` is done when the event
has completed, and only then may the caller mark rows backed or publish a
page.  Nothing on the CPU reads a buffer whose copy is in flight: host rows are
written in place, in one contiguous slice of the pinned store.

Rows stored in several planes (``DevicePagePool.planes``) travel through one
contiguous device buffer allocated on the copy stream, so each direction is a
single host<->device copy of whole rows.  Repopulation copies many pages from
scattered host extents at once: one gather launch per plane reads them from
pinned memory (``pages_to_device``), so its cost does not grow with the pages
of a step.  On CPU every copy is synchronous.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .devices import canonical_device

Planes = list[tuple[int, torch.Tensor]]  # (first byte inside a row, rows [n, plane bytes])


@dataclass
class Transfer:
    event: object = None  # torch.cuda.Event recorded on the copy stream; None = completed
    keep: tuple = ()  # tensors the copy reads or writes, alive until it completed

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class CopyStream:
    def __init__(self, device: torch.device | str):
        self.device = canonical_device(device)
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def _begin(self):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self.stream)

    def _end(self, *keep) -> Transfer:
        event = torch.cuda.Event()
        event.record(self.stream)
        return Transfer(event, keep)

    def to_host(self, dst: torch.Tensor, src: torch.Tensor | Planes) -> Transfer:
        """``dst`` ([n, W] contiguous host slice) <- rows ``src`` ([n, W] any device, or
        device planes ``[(first byte, [n, plane bytes])]``)."""
        return self.to_host_rows([dst], [(0, src)] if isinstance(src, torch.Tensor) else src)

    def to_host_rows(self, dsts: list[torch.Tensor], planes: Planes) -> Transfer:
        """``dsts[i]`` ([n_i, W] contiguous host slices) <- the next n_i rows of ``planes``
        (``[(first byte, [sum n_i, plane bytes])]``, any device): one pass over the copy stream
        and one event for all of them."""
        if self.stream is None or not planes[0][1].is_cuda:
            a = 0
            for dst in dsts:
                n = dst.shape[0]
                for start, plane in planes:
                    dst[:, start:start + plane.shape[1]].copy_(plane[a:a + n])
                a += n
            return Transfer()
        with self._begin():
            if len(planes) == 1 and planes[0][1].is_contiguous():
                rows = planes[0][1]
            else:
                rows = torch.cat([plane for _, plane in planes], dim=1)
            a = 0
            for dst in dsts:
                dst.copy_(rows[a:a + dst.shape[0]], non_blocking=True)
                a += dst.shape[0]
            # the planes too: a gather made them on the compute stream, and only these
            # references stop the allocator from handing their memory out before the
            # copy stream has read them
            return self._end(rows, *dsts, *(plane for _, plane in planes))

    def pages_to_device(self, host_rows: torch.Tensor, planes: Planes, src_first: list[int],
                        dst_first: list[int], page_size: int) -> Transfer:
        """Device rows ``dst_first[i] + j`` of every plane (the pool's ``[(first byte,
        [R, plane bytes])]``) <- host rows ``src_first[i] + j`` of ``host_rows`` ([R_host, W],
        pinned on CUDA), ``j < page_size``: one launch per plane and one event for all
        pages, whatever their number."""
        src, dst = _page_rows(src_first, page_size), _page_rows(dst_first, page_size)
        if dst.size and dst.max() >= 2**31:  # the gather's device rows are int32
            raise ValueError(f"device row {int(dst.max())} does not fit int32")
        if self.stream is None:
            src_t, dst_t = torch.from_numpy(src[0]), torch.from_numpy(dst[0])
            for start, plane in planes:
                plane[dst_t] = host_rows[src_t, start:start + plane.shape[1]]
            return Transfer()
        from vllm_dhisparse.triton_kernels.gather import gather_rows
        with self._begin():
            # pageable -> device without waiting: the driver stages the source before the
            # call returns, and the copy is ordered before the gathers on this stream
            src_t = torch.from_numpy(src).to(self.device, non_blocking=True)  # [1, M] int64
            dst_t = torch.from_numpy(dst.astype(np.int32)).to(self.device, non_blocking=True)
            count = torch.full((1,), src.shape[1], dtype=torch.int32, device=self.device)
            for start, plane in planes:
                rows = host_rows if len(planes) == 1 else host_rows[:, start:start + plane.shape[1]]
                gather_rows(rows, plane, src_t, dst_t, count)
            return self._end(src_t, dst_t, count)


def _page_rows(firsts: list[int], page_size: int) -> np.ndarray:
    """Every row of the pages starting at ``firsts``, in order.
    # [1, len(firsts) * page_size] int64"""
    return (np.asarray(firsts, dtype=np.int64)[:, None] + np.arange(page_size)).reshape(1, -1)
