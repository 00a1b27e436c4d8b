"""Host memory for the backing store: checked against available RAM, pinned exactly.

torch's pinned allocator rounds every request up to a power of two (a 40 GiB
pool pins 64 GiB), so on CUDA the buffer is an anonymous mapping registered
with ``cudaHostRegister``: exactly the requested bytes are pinned.  When the
last tensor viewing it is gone the registration ends, then the mapping.
With unified addressing (every 64-bit CUDA platform) registered memory is
mapped into the device's address space, so kernels read it zero-copy.

With ``huge_pages`` the mapping is aligned to 2 MiB and advised for transparent
huge pages (``MADV_HUGEPAGE``).  Off by default: on the H200 the kernel did back a
32 GiB pool with huge pages, yet scattered zero-copy row reads were no faster than
over 4 KiB pages, and up to a fifth slower for small batches
(``benchmarks/bench_host_reads.py``, results of 2026-12-03).
"""
from __future__ import annotations

import ctypes
import logging
import mmap

import torch

logger = logging.getLogger(__name__)
GIB = 2**30
HUGE = 2 * 2**20
MADV_HUGEPAGE = 14  # linux/mman.h
HUGE_PAGES = False  # the default of host_buffer(huge_pages=None)


def meminfo_bytes(field: str) -> int | None:
    """``field`` of /proc/meminfo in bytes, or None where the kernel does not report it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def available_host_bytes() -> int | None:
    """``MemAvailable`` (what can be allocated without swapping), or None."""
    return meminfo_bytes("MemAvailable")


def check_host_memory(need_bytes: int, what: str, available: int | None = None) -> None:
    """Raises ``ValueError`` before allocating when ``need_bytes`` exceed available RAM,
    instead of an opaque allocation failure or a later OOM kill."""
    available = available_host_bytes() if available is None else available
    if available is not None and need_bytes > available:
        raise ValueError(f"{what}: {need_bytes / GIB:.2f} GiB of host memory requested, but only "
                         f"{available / GIB:.2f} GiB is available on this machine "
                         f"(MemAvailable); lower it or free memory")


class _Region:
    """An anonymous mapping of ``nbytes`` registered with CUDA.  The registration ends
    before the mapping does (``cudaHostUnregister`` then ``munmap``, in ``__del__``), so
    no other mapping can ever inherit it.  ``register`` / ``unregister`` are injectable
    for tests without a GPU."""

    def __init__(self, nbytes: int, register=None, unregister=None,
                 huge_pages: bool | None = None):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        self._libc, self.nbytes, self.registered = libc, nbytes, False
        self.huge_pages = HUGE_PAGES if huge_pages is None else huge_pages
        # room to start the used part on a 2 MiB boundary: huge pages cover aligned ranges
        self._map_bytes = nbytes + (HUGE if self.huge_pages else 0)
        base = libc.mmap(None, self._map_bytes, mmap.PROT_READ | mmap.PROT_WRITE,
                         mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if base is None or base == ctypes.c_void_p(-1).value:
            raise MemoryError(f"mmap of {nbytes / GIB:.2f} GiB failed (errno {ctypes.get_errno()})")
        self._base = base
        self.ptr = -(-base // HUGE) * HUGE if self.huge_pages else base
        if self.huge_pages and libc.madvise(self.ptr, nbytes, MADV_HUGEPAGE) != 0:
            logger.debug("madvise(MADV_HUGEPAGE) of the host pool failed (errno %d); 4 KiB pages",
                         ctypes.get_errno())
        if register is None:
            cudart = torch.cuda.cudart()
            register = lambda p, n: cudart.cudaHostRegister(p, n, 0)  # noqa: E731
            unregister = cudart.cudaHostUnregister
        self._unregister = unregister
        rc = register(self.ptr, nbytes)
        self.registered = int(getattr(rc, "value", rc)) == 0
        if not self.registered:
            logger.warning("cudaHostRegister of %.2f GiB failed (%s); using torch's pinned "
                           "allocator (it pins a power of two)", nbytes / GIB, rc)

    def __del__(self):
        if self.registered:
            try:
                self._unregister(self.ptr)
            except Exception:  # noqa: BLE001 (interpreter shutdown: CUDA may be gone)
                pass
        self._libc.munmap(self._base, self._map_bytes)

    def tensor(self) -> torch.Tensor:
        """``uint8 [nbytes]`` over the region; it keeps the region alive."""
        view_t = type("_RegionBytes", (ctypes.c_uint8 * self.nbytes,), {})
        view = view_t.from_address(self.ptr)
        view.region = self  # the tensor holds the view, the view holds the region
        return torch.frombuffer(view, dtype=torch.uint8)


def host_buffer(nbytes: int, pin: bool, register=None, unregister=None,
                huge_pages: bool | None = None) -> torch.Tensor:
    """``uint8 [nbytes]`` host tensor; page-locked when ``pin`` (needs CUDA).
    ``huge_pages``: advise the pinned mapping for huge pages (default ``HUGE_PAGES``)."""
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    region = _Region(nbytes, register, unregister, huge_pages)
    if region.registered:
        return region.tensor()
    del region
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
