"""Host memory for the backing store: checked against available RAM, pinned exactly.

torch's pinned allocator rounds every request up to a power of two (a 40 GiB
pool pins 64 GiB), so on CUDA the buffer is an anonymous mapping registered
with ``cudaHostRegister``: exactly the requested bytes are pinned, and the
registration ends with the mapping (when the last tensor viewing it is gone).
With unified addressing (every 64-bit CUDA platform) registered memory is
mapped into the device's address space, so kernels read it zero-copy.
"""
from __future__ import annotations

import logging
import mmap
import weakref

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


def _register(buffer: mmap.mmap, nbytes: int) -> bool:
    cudart = torch.cuda.cudart()
    ptr = torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()
    rc = cudart.cudaHostRegister(ptr, nbytes, 0)
    if int(getattr(rc, "value", rc)) != 0:
        logger.warning("cudaHostRegister of %.2f GiB failed (%s); using torch's pinned "
                       "allocator (it pins a power of two)", nbytes / GIB, rc)
        return False
    weakref.finalize(buffer, cudart.cudaHostUnregister, ptr)
    return True


def host_buffer(nbytes: int, pin: bool) -> torch.Tensor:
    """``uint8 [nbytes]`` host tensor; page-locked when ``pin`` (needs CUDA)."""
    if not pin:
        return torch.empty(nbytes, dtype=torch.uint8)
    buffer = mmap.mmap(-1, nbytes)
    if _register(buffer, nbytes):
        return torch.frombuffer(buffer, dtype=torch.uint8)  # keeps the mapping alive
    buffer.close()
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
