"""Worker half of host prefix hits: prefix entries in host memory, captured and loaded.

An entry holds what a request resuming at ``num_tokens`` needs in every KV
cache group (index.py says which boundary and why):

* the c4a history as hierarchy rows, ``num_tokens // ratio`` per c4a layer,
  read from the hierarchy (device pages or host copy, ``read_history``), or from
  vLLM's blocks for a request not admitted yet (in prefill nothing is freed);
* every other full-attention layer (indexer keys, c128a) as its blocks before
  ``num_tokens``: vLLM frees none of them while the request runs;
* every sliding-window layer (SWA caches, compressor states) as the window
  blocks at ``num_tokens``, snapshotted after the forward that passed that
  boundary, before vLLM freed them.

A load writes an entry into the blocks vLLM allocated for the new request, from
its local prefix hit on, the c4a rows included: the request then prefills its
remaining tokens reading vLLM's cache, as after a local hit, and is admitted
into the hierarchy when its prefill completes.  Loads are done on the engine
thread before the forward and reported finished after it (vLLM's asynchronous
load: the request waits one step in ``WAITING_FOR_REMOTE_KVS``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from ..handoff.store import kv_nbytes
from ..handoff.worker import NULL_BLOCK, KVLayout
from ..metadata import PrefixCapture, PrefixLoad
from .index import layer_specs, window_positions

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


@dataclass
class PrefixEntry:
    num_tokens: int
    rows: dict[str, torch.Tensor]  # c4a layer -> [num_tokens // ratio, row_bytes] uint8
    blocks: dict[str, tuple[list[int], torch.Tensor]]  # layer -> (positions, [n, *page])

    @property
    def nbytes(self) -> int:
        return kv_nbytes(self.rows, self.blocks)


@dataclass
class PrefixCounters:
    captured: int = 0
    capture_failed: int = 0
    evicted: int = 0
    loads: int = 0  # requests that loaded a prefix from host
    load_failed: int = 0
    tokens_loaded: int = 0
    entries: int = 0
    bytes_held: int = 0


@dataclass
class Snapshot:
    num_tokens: int
    blocks: dict[str, tuple[list[int], torch.Tensor]] = field(default_factory=dict)


class PrefixStore:
    def __init__(self, kv_caches: dict[str, torch.Tensor], kv_cache_config, c4a_layers: dict,
                 boundary: int):
        self.layout = KVLayout(kv_caches, kv_cache_config, set(c4a_layers))
        self.c4a = c4a_layers
        self.boundary = boundary
        self.spec = {name: spec for _, name, spec in layer_specs(kv_cache_config)
                     if name in self.layout.caches}
        self.sliding = {n for n, s in self.spec.items() if getattr(s, "sliding_window", None)}
        self.entries: dict[int, PrefixEntry] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.counters = PrefixCounters()

    def _blocks(self, name: str, block_ids: list[int], positions) -> tuple[list[int], torch.Tensor]:
        pos = list(positions)
        if any(p >= len(block_ids) or block_ids[p] == NULL_BLOCK for p in pos):
            raise RuntimeError(f"layer {name!r}: block positions {pos[0]}..{pos[-1]} are not "
                               f"all held")
        cache = self.layout.caches[name]
        ids = torch.tensor([block_ids[p] for p in pos], dtype=torch.int64, device=cache.device)
        return pos, cache[ids].cpu()  # [n, *page] copy

    # -- while requests run ------------------------------------------------------------
    def after_forward(self, req, computed_before: int, computed_after: int) -> None:
        """After the forward of a step that took the request from ``computed_before`` to
        ``computed_after`` tokens (drafts not counted): snapshots its window blocks at
        the boundary the step passed (the rule of index.py).  vLLM frees window blocks
        only at a later schedule, so they are all there.  A boundary below
        ``computed_before`` (accepted drafts passed it in an earlier step) may have lost
        its window already: no snapshot, and that boundary's capture fails."""
        n = computed_after // self.boundary * self.boundary
        snap = self.snapshots.get(req.req_id)
        if n < self.boundary or (snap is not None and snap.num_tokens >= n):
            return
        self.snapshots.pop(req.req_id, None)
        if n < computed_before:
            return
        snap = Snapshot(n)
        try:
            for name in self.sliding:
                g = self.layout.group[name]
                snap.blocks[name] = self._blocks(name, req.block_ids[g],
                                                 window_positions(self.spec[name], n))
        except RuntimeError as e:  # its capture then fails and the entry is forgotten
            logger.debug("DHiSparse: no window snapshot of %s at %d tokens: %s", req.req_id, n, e)
            return
        self.snapshots[req.req_id] = snap

    def forget_request(self, req_id: str) -> None:
        """The request ended, or starts again (resumed): its snapshot is void."""
        self.snapshots.pop(req_id, None)

    # -- the step's metadata, in order -------------------------------------------------
    def blocks_read(self, num_tokens: int, block_ids: list[list[int]]) -> set[int]:
        """vLLM block ids a capture at ``num_tokens`` reads in place (every cache but the
        sliding windows, whose snapshot was taken after an earlier forward, and the c4a
        rows, which the caller reads)."""
        out = set()
        for name in self.layout.caches:
            if name not in self.sliding:
                ids = block_ids[self.layout.group[name]]
                out.update(ids[p] for p in window_positions(self.spec[name], num_tokens)
                           if p < len(ids))
        return out

    def capture(self, item: PrefixCapture, req, read_rows) -> None:
        """``read_rows(layer, n)``: the request's first n c4a rows.  Raises when the
        request's KV at ``item.num_tokens`` is not all there."""
        n = item.num_tokens
        snap = self.snapshots.get(item.req_id)
        if snap is None or snap.num_tokens != n:
            raise RuntimeError(f"no window snapshot at {n} tokens")
        blocks = dict(snap.blocks)
        for name in self.layout.caches:
            if name not in self.sliding:
                g = self.layout.group[name]
                blocks[name] = self._blocks(name, req.block_ids[g],
                                            window_positions(self.spec[name], n))
        rows = {name: read_rows(layer, n // layer.compress_ratio)
                for name, layer in self.c4a.items()}
        entry = PrefixEntry(n, rows, blocks)
        self.entries[item.entry_id] = entry
        c = self.counters
        c.captured += 1
        c.entries = len(self.entries)
        c.bytes_held += entry.nbytes

    def load(self, item: PrefixLoad, write_rows) -> None:
        """Writes entry ``item.entry_id`` into the request's blocks from its local hit on;
        ``write_rows(layer, block_ids, rows, data)`` writes c4a rows.  Checks first, so a
        failed load writes nothing."""
        entry = self.entries.get(item.entry_id)
        if entry is None:
            raise RuntimeError(f"host prefix entry {item.entry_id} is not held")
        first, n = item.first_token, item.num_tokens
        if n > entry.num_tokens or first % self.boundary:
            raise RuntimeError(f"tokens [{first}, {n}) of an entry of {entry.num_tokens}")
        writes = []
        for name, (pos, data) in entry.blocks.items():
            g, bs = self.layout.group[name], self.layout.block_tokens[self.layout.group[name]]
            ids = item.block_ids[g]
            need = [p for p in range(first // bs, min(len(ids), -(-n // bs)))
                    if ids[p] != NULL_BLOCK]
            have = {p: k for k, p in enumerate(pos)}
            missing = [p for p in need if p not in have]
            if missing:
                raise RuntimeError(f"layer {name!r}: the entry lacks block positions "
                                   f"{missing[:8]} vLLM allocated")
            writes.append((name, [ids[p] for p in need], [have[p] for p in need], data))
        for name, dst, src, data in writes:
            if dst:
                cache = self.layout.caches[name]
                cache[torch.tensor(dst, dtype=torch.int64, device=cache.device)] = \
                    data[torch.tensor(src, dtype=torch.int64)].to(cache.device)
        for name, layer in self.c4a.items():
            lo, hi = first // layer.compress_ratio, n // layer.compress_ratio
            if hi > lo:
                write_rows(layer, item.block_ids[layer.group],
                           torch.arange(lo, hi, dtype=torch.int64), entry.rows[name][lo:hi])
        self.counters.loads += 1
        self.counters.tokens_loaded += n - first

    def evict(self, entry_id: int) -> None:
        entry = self.entries.pop(entry_id, None)
        if entry is not None:
            self.counters.evicted += 1
            self.counters.entries = len(self.entries)
            self.counters.bytes_held -= entry.nbytes

    def summary(self) -> dict:
        out = dict(self.counters.__dict__)
        out["failed"] = out["capture_failed"] + out["load_failed"]
        return out
