"""What the scheduler half tells the worker half each step (pickled across processes)."""
from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorHandshakeMetadata,
                                                               KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)


@dataclass
class RequestStep:
    """One scheduled request in one step."""
    req_id: str
    num_computed_tokens: int  # committed tokens before this step (n_r of eq. 7)
    num_scheduled_tokens: int  # queries this step (anchor + drafts, or a prefill chunk)
    prompt_len: int
    # Block ids per KV cache group: the full list for new/resumed requests,
    # the newly appended ones otherwise (replace_blocks says which).
    block_ids: tuple[list[int], ...] | None
    replace_blocks: bool
    max_tokens: int
    # This step computes the last of the request's known tokens (prompt, plus the
    # outputs a resumed request replays): the worker admits it after the forward.
    completes_prefill: bool = False
    # Of num_scheduled_tokens, draft (or placeholder draft) tokens: never committed.
    num_spec_tokens: int = 0
    # Of num_computed_tokens, drafts of the previous step that vLLM's asynchronous
    # scheduler counts before it has seen their verification: the device places this
    # step's tokens after the accepted ones, rewriting the rows of rejected drafts, so
    # none of them is committed yet.
    num_unverified_tokens: int = 0
    # kv_producer: the request's KV is captured for a decode instance under this id once
    # its prefill completes (handoff_worker.py).
    handoff_id: str | None = None

    @property
    def num_verified_tokens(self) -> int:
        """Tokens before this step whose KV is final on the device."""
        return self.num_computed_tokens - self.num_unverified_tokens


@dataclass
class LoadItem:
    """kv_consumer: pull handoff ``handoff_id`` from ``host:port`` for request ``req_id``
    (its prompt's ``num_tokens`` tokens) into the blocks vLLM allocated for it."""
    req_id: str
    handoff_id: str
    host: str
    port: int
    num_tokens: int
    block_ids: tuple[list[int], ...]  # per KV cache group, the request's whole table
    max_tokens: int


@dataclass
class PrefixCapture:
    """Copy the first ``num_tokens`` tokens' KV of ``req_id`` (finished or preempted this
    step) to host as prefix entry ``entry_id`` (host_prefix/store.py)."""
    entry_id: int
    req_id: str
    num_tokens: int


@dataclass
class PrefixLoad:
    """Write prefix entry ``entry_id`` into the blocks vLLM allocated for ``req_id``: the
    tokens from ``first_token`` (its local prefix-cache hit) to ``num_tokens``."""
    req_id: str
    entry_id: int
    first_token: int
    num_tokens: int
    block_ids: tuple[list[int], ...]  # per KV cache group, the request's whole table


@dataclass
class DHiSparseMetadata(KVConnectorMetadata):
    step: int
    requests: list[RequestStep] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    loads: list[LoadItem] = field(default_factory=list)  # kv_consumer: loads to start
    # host prefix entries, done in this order before the forward (host_prefix/)
    prefix_captures: list[PrefixCapture] = field(default_factory=list)
    prefix_loads: list[PrefixLoad] = field(default_factory=list)
    prefix_evictions: list[int] = field(default_factory=list)
    # blocks vLLM writes this step before the forward (zeroed new blocks, copy-on-write
    # targets); model runner V2 calls handle_preemptions only after those writes, so a
    # preempted capture still pending then is given up if it would read one of them.
    # Set only with such captures, under model runner V2.
    rewritten_blocks: frozenset[int] = frozenset()


@dataclass
class DHiSparseHandshake(KVConnectorHandshakeMetadata):
    """kv_producer worker -> its scheduler at start-up: where the side channel listens
    (the port the OS picked when ``handoff_port`` is 0)."""
    host: str
    port: int


@dataclass
class DHiSparseWorkerMetadata(KVConnectorWorkerMetadata):
    """What workers tell the scheduler half after a step: requests that failed, and host
    prefix entries captured (hits may load them) or lost (capture or load failed: the
    scheduler forgets them)."""
    failed: dict[str, str] = field(default_factory=dict)  # request id -> error
    prefix_lost: set[int] = field(default_factory=set)
    prefix_captured: set[int] = field(default_factory=set)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "DHiSparseWorkerMetadata":
        if isinstance(other, DHiSparseWorkerMetadata):
            return DHiSparseWorkerMetadata({**self.failed, **other.failed},
                                           self.prefix_lost | other.prefix_lost,
                                           self.prefix_captured | other.prefix_captured)
        return self
