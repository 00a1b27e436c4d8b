"""Host memory for the backing store: checked against available RAM, pinned exactly.

torch's pinned allocator rounds every request up to a power of two (a 40 GiB
pool pins 64 GiB), so on CUDA the buffer is an anonymous mapping registered
with ``cudaHostRegister``: exactly the requested bytes are pinned.  When the
last tensor viewing it is gone the registration ends, then the mapping.
With unified addressing (every 64-bit CUDA platform) registered memory is
mapped into the device's address space, so kernels read it zero-copy.
"""
from __future__ import annotations

import ctypes
import logging
import mmap

import torch

logger = logging.getLogger(__name__)
GIB = 2**30


def available_host_bytes() -> int | None:
    """``MemAvailable`` of /proc/meminfo (what can be allocated without swapping), or
    None where the kernel does not report it."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


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

    def __init__(self, nbytes: int, register=None, unregister=None):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc, self.nbytes, self.registered = libc, nbytes, False
        ptr = libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE,
                        mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        if ptr is None or ptr == ctypes.c_void_p(-1).value:
            raise MemoryError(f"mmap of {nbytes / GIB:.2f} GiB failed (errno {ctypes.get_errno()})")
        self.ptr = ptr
        if register is None:
            cudart = torch.cuda.cudart()
            register = lambda p, n: cudart.cudaHostRegister(p, n, 0)  # noqa: E731
            unregister = cudart.cudaHostUnregister
        self._unregister = unregister
        rc = register(ptr, nbytes)
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
        self._libc.munmap(self.ptr, self.nbytes)

    def tensor(self) -> torch.Tensor:
        """``uint8 [nbytes]`` over the region; it keeps the region alive."""
        view_t = type("_RegionBytes", (ctypes.c_uint8 * self.nbytes,), {})
        view = view_t.from_address(self.ptr)
        view.region = self  # the tensor holds the view, the view holds the region
        return torch.frombuffer(view, dtype=torch.uint8)


def host_buffer(nbytes: int, pin: bool, register=None, unregister=None) -> torch.Tensor:
    """``uint8 [nbytes]`` host tensor; page-locked when ``pin`` (needs CUDA)."""
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    region = _Region(nbytes, register, unregister)
    if region.registered:
        return region.tensor()
    del region
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
