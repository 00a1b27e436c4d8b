"""Scheduler half of host prefix hits: which prefixes the workers hold in host memory.

With the connector, vLLM's prefix cache keeps a finished request's blocks only
until other requests need them, and it loses the c4a blocks first: the device
window hands them back while the request still runs.  A later request whose
prompt starts with that request's tokens (the next turn of a conversation, or
the same request resumed after a preemption in recompute mode) would compute
the prefix again.  So when a request finishes or is preempted, its KV up to a
boundary is copied to host as a *prefix entry* (host_prefix/store.py), and a
request whose prompt starts with an entry's tokens loads it through vLLM's
external-hit API (``get_num_new_matched_tokens``, an asynchronous load), so
vLLM counts those tokens as cached, from host (``CacheHitSource.HOST``).

Which boundary.  DeepSeek-V4's sliding-window groups (the SWA caches and the
compressor states) keep only the window behind the newest token, so the KV
needed to resume at a boundary N exists only while the request is near N.
Both halves therefore use one rule: N is the tokens the request's latest
scheduled step leaves computed (its computed tokens plus the step's tokens but
drafts), rounded down to the scheduler's block (the LCM of the groups' block
sizes, 256 tokens), and the worker snapshots the window blocks after the
forward that passes a new N, before vLLM can free them.  An entry is keyed by
vLLM's block hash at N (``Request.block_hashes``, chained over every token
before, and over the request's cache salt and LoRA), so a hit needs the same N
in the later prompt.

When a capture reads.  vLLM zeroes reused blocks before the connector sees a step
(mixed-precision caches), so a capture never reads a freed block: a finished
request's blocks stay allocated until its capture is done (``request_finished``
answers ``delay_free`` and the worker reports the request in ``finished_sending``),
and a preempted request, whose blocks vLLM frees at once, is captured in
``handle_preemptions``, before the model runner zeroes or writes anything.

Entries live by least recent use (capture or load) within ``host_prefix_gib``,
planned here with the byte size each entry will have; captures, loads and
evictions reach the worker in the step metadata, done in that order, so a load
never reads an entry freed in its step.  An entry is hit only once the worker
reported its capture done (``DHiSparseWorkerMetadata.prefix_captured``); one whose
capture or load failed is forgotten (``prefix_lost``), so a failed load is never
repeated.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from vllm.logger import init_logger

from ..metadata import PrefixCapture, PrefixLoad

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


@dataclass
class Entry:
    entry_id: int
    key: object  # vLLM's block hash at num_tokens
    num_tokens: int
    nbytes: int
    ready: bool = False  # the worker reported the capture done


def layer_specs(kv_cache_config):
    """``(group, layer name, spec)`` of every KV layer (a group's spec may wrap one spec
    per layer)."""
    for g, grp in enumerate(kv_cache_config.kv_cache_groups):
        spec = grp.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)
        for name in grp.layer_names:
            yield g, name, inner[name] if isinstance(inner, dict) else spec


def scheduler_block(kv_cache_config) -> int:
    """vLLM's scheduler block of a hybrid model: the LCM of its groups' block sizes
    (``resolve_kv_cache_block_sizes``); local prefix hits end on it."""
    return math.lcm(*{spec.block_size for _, _, spec in layer_specs(kv_cache_config)})


def window_positions(spec, num_tokens: int) -> range:
    """Block positions vLLM keeps (and a request resuming at ``num_tokens`` needs) in a
    group of ``spec``: all for full attention, the window for sliding-window groups
    (``SlidingWindowManager.get_num_skipped_tokens``)."""
    bs = spec.block_size
    window = getattr(spec, "sliding_window", None)
    if not window:
        return range(0, num_tokens // bs)
    skipped = max(0, num_tokens - window + 1 - (getattr(spec, "extra_retained_tokens", 0) or 0))
    return range(skipped // bs, num_tokens // bs)


class PrefixIndex:
    def __init__(self, capacity_bytes: int, kv_cache_config, enabled: bool):
        self.capacity_bytes = capacity_bytes
        self.enabled = enabled and capacity_bytes > 0 and kv_cache_config is not None
        specs = list(layer_specs(kv_cache_config)) if kv_cache_config is not None else []
        self._specs = [spec for _, _, spec in specs]
        sizes = {s.block_size for s in self._specs} or {1}
        self.boundary = scheduler_block(kv_cache_config) if specs else 1
        # Request.block_hashes are this many tokens each (hybrid: the GCD of block sizes)
        self.hash_block = getattr(kv_cache_config, "hash_block_size", None) or math.gcd(*sizes)
        self.entries: OrderedDict[int, Entry] = OrderedDict()  # least recently used first
        self.by_key: dict[object, int] = {}
        self.bytes = 0
        self._next_id = 0
        self.last_boundary: dict[str, int] = {}  # request -> N of its latest step
        self.pending: dict[str, tuple[int, int, int]] = {}  # looked up, not allocated yet
        self.host_loads: set[str] = set()  # requests whose external tokens come from here
        self.captures: list[PrefixCapture] = []
        self.loads: list[PrefixLoad] = []
        self.evictions: list[int] = []

    def nbytes(self, num_tokens: int) -> int:
        """Host bytes of an entry of ``num_tokens`` tokens (c4a rows counted as their
        blocks: at least what their rows take)."""
        return sum(len(window_positions(s, num_tokens)) * s.page_size_bytes for s in self._specs)

    # -- capture -------------------------------------------------------------------------
    def on_step(self, req_id: str, tokens_after: int) -> None:
        """The request's scheduled step leaves ``tokens_after`` tokens computed (drafts
        not counted)."""
        self.last_boundary[req_id] = tokens_after // self.boundary * self.boundary

    def on_ended(self, request: "Request") -> bool:
        """A request finished or was preempted: its KV up to its boundary is captured,
        unless an entry holds that prefix already.  True when a capture is planned."""
        rid = request.request_id
        n = self.last_boundary.pop(rid, 0)
        self.pending.pop(rid, None)
        self.host_loads.discard(rid)
        if not self.enabled or n < self.boundary:
            return False
        key = self._key(request, n)
        if key is None:
            return False
        if key in self.by_key:
            self.entries.move_to_end(self.by_key[key])
            return False
        size = self.nbytes(n)
        if size > self.capacity_bytes:
            return False
        while self.bytes + size > self.capacity_bytes:
            self._evict(next(iter(self.entries)))
        entry = Entry(self._next_id, key, n, size)
        self._next_id += 1
        self.entries[entry.entry_id] = entry
        self.by_key[key] = entry.entry_id
        self.bytes += size
        self.captures.append(PrefixCapture(entry.entry_id, rid, n))
        return True

    def _key(self, request: "Request", num_tokens: int):
        hashes = getattr(request, "block_hashes", None) or ()
        i = num_tokens // self.hash_block - 1
        return hashes[i] if 0 <= i < len(hashes) else None

    def _evict(self, entry_id: int) -> None:
        entry = self.entries.pop(entry_id)
        del self.by_key[entry.key]
        self.bytes -= entry.nbytes
        self.evictions.append(entry_id)

    def reset(self) -> None:
        """Every entry is freed (vLLM's ``reset_prefix_cache(reset_connector=True)``);
        loads already allocated still find theirs: the worker loads before it evicts."""
        for eid in list(self.entries):
            self._evict(eid)

    def confirm(self, entry_ids) -> None:
        """Entries the worker captured: hits may load them from now on."""
        for eid in entry_ids:
            if eid in self.entries:
                self.entries[eid].ready = True

    def forget(self, entry_ids) -> None:
        """Entries whose capture or load failed in a worker."""
        for eid in entry_ids:
            entry = self.entries.pop(eid, None)
            if entry is not None:
                del self.by_key[entry.key]
                self.bytes -= entry.nbytes

    # -- hits ----------------------------------------------------------------------------
    def lookup(self, request: "Request", num_computed_tokens: int) -> int:
        """Tokens beyond the local hit ``num_computed_tokens`` an entry holds: the longest
        entry whose tokens begin the request's, shorter than the request (vLLM computes at
        least its last token)."""
        if not self.enabled:
            return 0
        b = self.boundary
        for n in range((request.num_tokens - 1) // b * b, num_computed_tokens, -b):
            eid = self.by_key.get(self._key(request, n))
            if eid is not None and self.entries[eid].ready and self.entries[eid].num_tokens == n:
                self.pending[request.request_id] = (eid, num_computed_tokens, n)
                return n - num_computed_tokens
        return 0

    def wants_load(self, req_id: str) -> bool:
        return req_id in self.pending or req_id in self.host_loads

    def after_alloc(self, request: "Request", block_ids: tuple[list[int], ...],
                    num_external_tokens: int) -> bool:
        """vLLM allocated the request's blocks: the load goes into this step's metadata.
        False when the request has no entry to load."""
        rid = request.request_id
        if rid not in self.pending:
            return False
        if not num_external_tokens:  # vLLM took no external tokens after all
            self.pending.pop(rid)
            return False
        eid, first, n = self.pending.pop(rid)
        self.entries.move_to_end(eid)
        self.host_loads.add(rid)
        self.loads.append(PrefixLoad(rid, eid, first, first + num_external_tokens, block_ids))
        return True

    def take(self) -> tuple[list[PrefixCapture], list[PrefixLoad], list[int]]:
        out = (self.captures, self.loads, self.evictions)
        self.captures, self.loads, self.evictions = [], [], []
        return out
