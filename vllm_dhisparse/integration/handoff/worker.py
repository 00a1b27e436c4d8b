"""Worker half of the prefill/decode handoff: capture on the producer, load on the consumer.

Producer (``kv_producer``): after the forward that completes the prefill of a
request carrying a handoff id (the scheduler half assigns it), its KV is
copied out of vLLM's cache into a :class:`Handoff` -- the c4a history as
hierarchy rows, every other KV layer as whole blocks by position -- and held
in the lease-bound store that the side channel serves.  Every block is still
allocated then (vLLM frees a finished request's blocks after the step's
output, and the c4a window frees nothing before the prefill completes).

Consumer (``kv_consumer``): a load pulls the handoff on a thread of its own
and writes the non-c4a blocks into the blocks vLLM allocated for the request
(parked in ``WAITING_FOR_REMOTE_KVS``: nothing else reads or writes them);
the engine thread then admits the c4a rows straight into the hierarchy
(``KVHierarchy.admit`` with imported rows: device pages while there is room,
host otherwise) and reports the load finished.  A failed load is reported as
finished *and* failed, with an error naming the handoff, and vLLM applies
``kv_load_failure_policy`` to that request alone.
"""
from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch
from vllm.logger import init_logger

from .store import Handoff, HandoffStore
from .transport import HandoffError, HandoffServer, pull
from ..metadata import LoadItem

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

NULL_BLOCK = 0  # vLLM's null block (block pool entry 0) pads skipped window positions


class KVLayout:
    """vLLM's non-c4a KV layers: each one's cache tensor ``[num_blocks, ...]`` and the KV
    cache group (block table, tokens per block) that addresses it."""

    def __init__(self, kv_caches: dict[str, torch.Tensor], kv_cache_config, c4a: set[str]):
        self.caches: dict[str, torch.Tensor] = {}
        self.group: dict[str, int] = {}
        self.block_tokens: dict[int, int] = {}
        for g, grp in enumerate(kv_cache_config.kv_cache_groups):
            self.block_tokens[g] = grp.kv_cache_spec.block_size
            for name in grp.layer_names:
                if name in c4a:
                    continue
                cache = kv_caches[name]
                if cache.shape[0] != kv_cache_config.num_blocks:
                    raise ValueError(f"KV layer {name!r}: cache shape {tuple(cache.shape)} is not "
                                     f"[num_blocks={kv_cache_config.num_blocks}, ...]; the P/D "
                                     f"handoff copies whole blocks of blocks-first caches")
                self.caches[name] = cache
                self.group[name] = g

    def positions(self, g: int, block_ids: list[int], num_tokens: int) -> list[int]:
        """Block positions of a request's first ``num_tokens`` tokens that hold a block."""
        n = min(len(block_ids), -(-num_tokens // self.block_tokens[g]))
        return [i for i in range(n) if block_ids[i] != NULL_BLOCK]


def resolve_host(host: str) -> str:
    """``auto``: the node's address as vLLM sees it, so one config serves every node."""
    if host != "auto":
        return host
    from vllm.utils.network_utils import get_ip
    return get_ip()


class Producer:
    def __init__(self, cfg, layout: KVLayout, c4a_rows):
        self.layout = layout
        self.c4a_rows = c4a_rows  # (layer name, block ids, first n rows) -> [n, row_bytes]
        self.store = HandoffStore(cfg.handoff_lease_s, int(cfg.handoff_buffer_gib * 2**30))
        self.server = HandoffServer(self.store, resolve_host(cfg.handoff_host), cfg.handoff_port)

    def capture(self, handoff_id: str, block_ids: list[list[int]], num_tokens: int,
                c4a_layers) -> bool:
        rows = {layer.name: self.c4a_rows(layer, block_ids[layer.group],
                                          num_tokens // layer.compress_ratio)
                for layer in c4a_layers}
        blocks = {}
        for name, cache in self.layout.caches.items():
            g = self.layout.group[name]
            pos = self.layout.positions(g, block_ids[g], num_tokens)
            ids = torch.tensor([block_ids[g][i] for i in pos], dtype=torch.int64)
            blocks[name] = (pos, cache[ids.to(cache.device)].cpu())  # [n, *page] copy
        h = Handoff(handoff_id, num_tokens, rows, blocks)
        if not self.store.put(h):
            logger.error("DHiSparse: handoff %s (%d B) refused: %d B already held, "
                         "handoff_buffer_gib allows %d B", handoff_id, h.nbytes,
                         self.store.bytes_held, self.store.capacity_bytes)
            return False
        logger.debug("DHiSparse: captured handoff %s: %d tokens, %d B", handoff_id,
                     num_tokens, h.nbytes)
        return True


@dataclass
class LoadJob:
    item: LoadItem
    handoff: Handoff | None = None
    error: str | None = None
    seconds: float = 0.0  # pull, check and block writes
    nbytes: int = 0
    done: threading.Event = field(default_factory=threading.Event)


class Consumer:
    """Runs loads one after another on a background thread; the engine thread collects
    finished ones with :meth:`take_done`."""

    def __init__(self, cfg, layout: KVLayout, c4a_layers):
        self.cfg = cfg
        self.layout = layout
        self.c4a = {layer.name: layer for layer in c4a_layers}
        self.jobs: dict[str, LoadJob] = {}  # request id -> in flight or done, not taken
        self._queue: queue.Queue[LoadJob] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="dhisparse-load", daemon=True)
        self._thread.start()

    def submit(self, item: LoadItem) -> None:
        assert item.req_id not in self.jobs, f"request {item.req_id} is already loading"
        job = LoadJob(item)
        self.jobs[item.req_id] = job
        self._queue.put(job)

    def take_done(self) -> list[LoadJob]:
        done = [j for j in self.jobs.values() if j.done.is_set()]
        for j in done:
            del self.jobs[j.item.req_id]
        return done

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            t0 = time.perf_counter()
            try:
                h, _ = pull(job.item.host, job.item.port, job.item.handoff_id,
                            self.cfg.handoff_timeout_s)
                job.nbytes = h.nbytes
                self._check(job.item, h)
                self._write_blocks(job.item, h)
                if any(c.is_cuda for c in self.layout.caches.values()):
                    torch.cuda.synchronize()  # the blocks are in place before done is seen
                job.handoff = h
            except Exception as e:  # noqa: BLE001 -- reported to vLLM as this request's failure
                job.error = str(e) if isinstance(e, HandoffError) else \
                    f"handoff {job.item.handoff_id!r}: {type(e).__name__}: {e}"
            job.seconds = time.perf_counter() - t0
            job.done.set()

    def _check(self, item: LoadItem, h: Handoff) -> None:
        hid = item.handoff_id
        if h.num_tokens != item.num_tokens:
            raise HandoffError(f"handoff {hid!r} holds {h.num_tokens} tokens, the request "
                               f"loads {item.num_tokens} (different prompt?)")
        if set(h.rows) != set(self.c4a) or set(h.blocks) != set(self.layout.caches):
            raise HandoffError(f"handoff {hid!r}: its layers do not match this engine's "
                               f"(same model and KV cache dtype on both sides?)")
        for name, rows in h.rows.items():
            layer = self.c4a[name]
            want = h.num_tokens // layer.compress_ratio
            if tuple(rows.shape) != (want, layer.row_bytes):
                raise HandoffError(f"handoff {hid!r}: layer {name!r} carries rows "
                                   f"{tuple(rows.shape)}, expected ({want}, {layer.row_bytes})")
        for name, (pos, data) in h.blocks.items():
            cache, g = self.layout.caches[name], self.layout.group[name]
            limit = -(-item.num_tokens // self.layout.block_tokens[g])
            if len(pos) != data.shape[0] or any(not isinstance(p, int) for p in pos) \
                    or any(b <= a for a, b in zip(pos, pos[1:])) \
                    or (pos and not 0 <= pos[0] <= pos[-1] < limit):
                raise HandoffError(f"handoff {hid!r}: layer {name!r} names block positions "
                                   f"that are not ascending in [0, {limit}) one per block")
            if tuple(data.shape[1:]) != tuple(cache.shape[1:]) or data.dtype != cache.dtype:
                raise HandoffError(f"handoff {hid!r}: layer {name!r} blocks are "
                                   f"{tuple(data.shape[1:])} {data.dtype}, this engine's "
                                   f"{tuple(cache.shape[1:])} {cache.dtype}")
            need = self.layout.positions(g, item.block_ids[g], item.num_tokens)
            missing = sorted(set(need) - set(pos))
            if missing:
                raise HandoffError(f"handoff {hid!r}: layer {name!r} lacks block positions "
                                   f"{missing[:8]} that this engine allocated")

    def _write_blocks(self, item: LoadItem, h: Handoff) -> None:
        for name, (pos, data) in h.blocks.items():
            cache, g = self.layout.caches[name], self.layout.group[name]
            ids = item.block_ids[g]
            keep = [k for k, p in enumerate(pos) if p < len(ids) and ids[p] != NULL_BLOCK]
            dst = torch.tensor([ids[pos[k]] for k in keep], dtype=torch.int64, device=cache.device)
            cache[dst] = data[torch.tensor(keep, dtype=torch.int64)].to(cache.device)


@dataclass
class HandoffCounters:
    sent: int = 0  # producer: handoffs pulled by a consumer
    captured: int = 0
    expired: int = 0
    refused: int = 0
    bytes_sent: int = 0
    received: int = 0  # consumer: loads admitted into the hierarchy
    failed: int = 0
    bytes_received: int = 0
    tokens_loaded: int = 0
    rows_device: int = 0  # c4a rows admitted on device (the rest went to host)
    rows_host: int = 0
    loads: int = 0  # loads ended (received + failed)
    # per load: pull + checks + writes; drained by the metrics collector (stats.py)
    seconds: list[float] = field(default_factory=list)


class HandoffWorker:
    """The worker's P/D role: ``kv_producer`` captures, ``kv_consumer`` loads."""

    def __init__(self, kv_role: str, cfg, kv_caches, kv_cache_config, layers, c4a_rows):
        layout = KVLayout(kv_caches, kv_cache_config, {layer.name for layer in layers})
        self.layers = layers
        self.producer = Producer(cfg, layout, c4a_rows) if kv_role == "kv_producer" else None
        self.consumer = Consumer(cfg, layout, layers) if kv_role == "kv_consumer" else None
        self.handoff_ids: dict[str, str] = {}  # producer: request id -> handoff id
        self.finished: set[str] = set()  # consumer: requests that ended while loading
        self.ready: list[LoadJob] = []  # consumer: loaded, waiting for hierarchy room
        self.counters = HandoffCounters()

    def begin_step(self, meta) -> None:
        for rs in meta.requests:
            if rs.handoff_id:
                self.handoff_ids[rs.req_id] = rs.handoff_id
        for rid in meta.finished:
            self.handoff_ids.pop(rid, None)
        if self.consumer is not None:
            loading = set(self.consumer.jobs) | {j.item.req_id for j in self.ready}
            self.finished |= meta.finished & loading
            for item in meta.loads:
                self.consumer.submit(item)

    def capture(self, requests, step_req_ids) -> None:
        """Producer, after the forward: requests whose prefill this step completed."""
        if self.producer is None:
            return
        for rid in step_req_ids:
            req = requests.get(rid)
            hid = self.handoff_ids.get(rid)
            if req is None or hid is None or not req.prefill_complete or req.failed:
                continue
            del self.handoff_ids[rid]  # once: a resumed request is not captured again
            try:
                self.producer.capture(hid, req.block_ids, req.prompt_len, self.layers)
            except Exception:  # noqa: BLE001 -- the decode side reports the missing handoff
                logger.exception("DHiSparse: capturing handoff %s of request %s failed", hid, rid)

    def transfer_results(self, admit) -> tuple[set[str], set[str]]:
        """Consumer: ``(finished_recving, failed_recving)``; ``admit(job)`` puts a loaded
        request's c4a rows into the hierarchy (False: no room yet, retried next step)."""
        if self.consumer is None:
            return set(), set()
        done, failed = set(), set()
        self.ready.extend(self.consumer.take_done())
        waiting = []
        for job in self.ready:
            rid, hid = job.item.req_id, job.item.handoff_id
            if rid in self.finished:  # aborted while loading: vLLM frees its blocks now
                self.finished.discard(rid)
                done.add(rid)
                continue
            if job.error is None:
                try:
                    if not admit(job):
                        logger.debug("DHiSparse: no hierarchy room for loaded request %s yet",
                                     rid)
                        waiting.append(job)
                        continue
                except Exception as e:  # noqa: BLE001 -- this request fails, no other
                    job.error = f"handoff {hid!r}: admission failed: {type(e).__name__}: {e}"
            done.add(rid)
            self.counters.loads += 1
            self.counters.seconds.append(job.seconds)
            if job.error is not None:
                failed.add(rid)
                self.counters.failed += 1
                logger.error("DHiSparse: loading request %s failed: %s", rid, job.error)
                continue
            c = self.counters
            c.received += 1
            c.bytes_received += job.nbytes
            c.tokens_loaded += job.item.num_tokens
        self.ready = waiting
        return done, failed

    def close(self) -> None:
        if self.producer is not None:
            self.producer.server.close()

    def summary(self) -> dict:
        c, held = self.counters, 0
        if self.producer is not None:
            s, held = self.producer.store.snapshot()
            c.captured, c.sent, c.expired = s.captured, s.pulled, s.expired
            c.refused, c.bytes_sent = s.refused, s.bytes_sent
        out = {k: v for k, v in c.__dict__.items() if k != "seconds"}
        out["held"] = held
        return out
