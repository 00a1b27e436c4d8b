"""A prefilled request's KV, held by the producer until a decode instance pulls it.

A :class:`Handoff` carries everything DeepSeek-V4 needs to decode the request
elsewhere: the c4a history as hierarchy rows (``rows``, what the decode side
admits into its hierarchy) and, for every other KV layer (sliding window,
indexer keys, c128a, compressor states), the request's blocks by position in
its block table (``blocks``), so the decode side can write them into the
blocks its own vLLM allocated for the same positions.

:class:`HandoffStore` holds handoffs under a lease: a handoff is freed when it
is pulled (``take``) or when its lease runs out (``expire``), so a decode
instance that never comes does not leak producer memory.  It is shared by the
engine thread (``put``) and the side-channel thread (``take``), hence the lock.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field, replace

import torch


def kv_nbytes(rows: dict[str, torch.Tensor],
              blocks: dict[str, tuple[list[int], torch.Tensor]]) -> int:
    """Bytes of c4a rows and blocks by position, as a handoff or a host prefix entry
    holds them."""
    return sum(t.numel() * t.element_size() for t in rows.values()) + \
        sum(t.numel() * t.element_size() for _, t in blocks.values())


@dataclass
class Handoff:
    handoff_id: str
    num_tokens: int  # prompt tokens whose KV this holds (all of them)
    rows: dict[str, torch.Tensor]  # c4a layer -> [num_tokens // ratio, row_bytes] uint8
    # layer -> (block positions in the request's block table, [n, *page] blocks at them)
    blocks: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)
    created: float = 0.0  # time.monotonic() at capture

    @property
    def nbytes(self) -> int:
        return kv_nbytes(self.rows, self.blocks)


@dataclass
class StoreCounters:
    captured: int = 0
    pulled: int = 0
    expired: int = 0
    refused: int = 0  # captures over handoff_buffer_gib
    bytes_sent: int = 0


class HandoffStore:
    def __init__(self, lease_s: float, capacity_bytes: int):
        self.lease_s = lease_s
        self.capacity_bytes = capacity_bytes
        self._held: dict[str, Handoff] = {}
        self._bytes = 0
        self._lock = threading.Lock()
        self.counters = StoreCounters()

    def put(self, handoff: Handoff) -> bool:
        """Holds ``handoff`` until pulled or expired; False (nothing held) when it would
        exceed the capacity."""
        size = handoff.nbytes
        with self._lock:
            if handoff.handoff_id in self._held:
                raise ValueError(f"handoff id {handoff.handoff_id!r} is already held")
            if self._bytes + size > self.capacity_bytes:
                self.counters.refused += 1
                return False
            handoff.created = time.monotonic()
            self._held[handoff.handoff_id] = handoff
            self._bytes += size
            self.counters.captured += 1
        return True

    def take(self, handoff_id: str) -> Handoff | None:
        """The handoff, removed from the store (one pull per handoff); None if unknown,
        already pulled or expired."""
        with self._lock:
            h = self._held.pop(handoff_id, None)
            if h is not None:
                self._bytes -= h.nbytes
                self.counters.pulled += 1
                self.counters.bytes_sent += h.nbytes
        return h

    def expire(self, now: float | None = None) -> list[str]:
        """Frees handoffs older than the lease; returns their ids."""
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [k for k, h in self._held.items() if now - h.created > self.lease_s]
            for k in old:
                self._bytes -= self._held.pop(k).nbytes
            self.counters.expired += len(old)
        return old

    def snapshot(self) -> tuple[StoreCounters, int]:
        """(a copy of the counters, handoffs held), read together: the side channel's
        thread frees expired and pulled handoffs and counts them in one locked section,
        so a reader on another thread never sees a handoff gone without its count."""
        with self._lock:
            return replace(self.counters), len(self._held)

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    @property
    def bytes_held(self) -> int:
        with self._lock:
            return self._bytes
