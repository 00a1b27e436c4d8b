"""Scheduler half of the prefill/decode handoff: vLLM's ``kv_transfer_params`` protocol.

A P/D router (Ray Serve LLM's ``PDDecodeServer``, vLLM's toy proxy) sends the
request to the prefill instance with ``do_remote_decode`` and ``max_tokens=1``,
copies the ``kv_transfer_params`` the prefill answers into the decode request
and sends that to the decode instance.  Both engines give the request
different ids, so the handoff is keyed by an id of ours, carried in the
namespaced sub-dict ``kv_transfer_params["dhisparse"]``.

Roles: ``kv_producer`` captures (``do_remote_decode``), ``kv_consumer`` loads
(``do_remote_prefill``), ``kv_both`` (one instance serving alone) does
neither: it has no side channel, so P/D parameters are ignored there and the
request is served locally, as before.
"""
from __future__ import annotations

import hashlib
import uuid
from typing import TYPE_CHECKING, Any

import numpy as np

from vllm.logger import init_logger

from ..kv_spec import DHiSparseCompressedSpec
from ..metadata import LoadItem

if TYPE_CHECKING:
    from vllm.v1.request import Request

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

NAMESPACE = "dhisparse"


def prompt_digest(request: "Request") -> str:
    """A digest of the prompt's token ids: the consumer loads a handoff only for the
    prompt it was made from (a router that attaches it to another prompt of the same
    length would otherwise decode on that prompt's KV)."""
    ids = np.asarray(request.prompt_token_ids or (), dtype=np.int64)
    return hashlib.blake2b(ids.tobytes(), digest_size=16).hexdigest()


def c4a_group_ids(kv_cache_config) -> set[int]:
    """KV cache groups of the hierarchy-managed c4a caches (kv_spec.py)."""
    out = set()
    for g, grp in enumerate(kv_cache_config.kv_cache_groups):
        spec = grp.kv_cache_spec
        inner = getattr(spec, "kv_cache_specs", None)
        specs = inner.values() if isinstance(inner, dict) else [spec]
        if any(isinstance(s, DHiSparseCompressedSpec) for s in specs):
            out.add(g)
    return out


class HandoffScheduler:
    def __init__(self, kv_role: str, cfg, engine_id: str, kv_cache_config):
        self.producer = kv_role == "kv_producer"
        self.consumer = kv_role == "kv_consumer"
        self.cfg = cfg
        self.engine_id = engine_id
        # the side channel's address; handoff_port 0 is replaced by the worker's handshake
        self.address = (cfg.handoff_host, cfg.handoff_port) if cfg is not None else None
        groups = range(len(kv_cache_config.kv_cache_groups)) if kv_cache_config else ()
        c4a = c4a_group_ids(kv_cache_config) if kv_cache_config else set()
        # The load restores every group but the c4a one (its history goes into the
        # hierarchy, its vLLM blocks are never read for loaded tokens), sliding-window
        # groups included: else vLLM would recompute the last window.
        self.loaded_groups = tuple(g for g in groups if g not in c4a)
        self.handoff_ids: dict[str, str] = {}  # producer: request id -> handoff id
        self.tried: set[str] = set()  # consumer: requests whose load was started once
        self.pending: dict[str, tuple[str, str, int]] = {}  # request -> (handoff, host, port)
        self.loads: list[LoadItem] = []
        self._warned_both = False

    # -- producer ------------------------------------------------------------------------
    def on_new_request(self, request: "Request") -> None:
        params = getattr(request, "kv_transfer_params", None) or {}
        if params.get("do_remote_decode") and not self.producer:
            self._warn_role("do_remote_decode", request)
        elif params.get("do_remote_decode"):
            self.handoff_ids[request.request_id] = uuid.uuid4().hex

    def handoff_id(self, req_id: str) -> str | None:
        return self.handoff_ids.get(req_id)

    def request_finished(self, request: "Request", prefilled: bool) -> dict[str, Any] | None:
        rid = request.request_id
        self.tried.discard(rid)
        self.pending.pop(rid, None)
        hid = self.handoff_ids.pop(rid, None)
        if hid is None or not prefilled:
            return None
        n = request.num_prompt_tokens
        return dict(do_remote_prefill=True, do_remote_decode=False,
                    remote_engine_id=self.engine_id, remote_request_id=rid,
                    remote_host=self.address[0], remote_port=self.address[1],
                    remote_block_ids=None, remote_num_tokens=n, tp_size=1,
                    **{NAMESPACE: dict(handoff_id=hid, num_tokens=n,
                                       prompt_digest=prompt_digest(request))})

    def set_address(self, host: str, port: int) -> None:
        self.address = (host, port)

    # -- consumer ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        params = getattr(request, "kv_transfer_params", None) or {}
        if not params.get("do_remote_prefill"):
            return 0, False
        rid = request.request_id
        if not self.consumer:
            self._warn_role("do_remote_prefill", request)
            return 0, False
        if rid in self.tried:  # a failed load being recomputed, or a preempted request
            return 0, False
        ours = params.get(NAMESPACE) or {}
        hid = ours.get("handoff_id")
        if not hid:
            logger.warning("DHiSparse: request %s has do_remote_prefill but no %r handoff id "
                           "(a producer with another connector?); computing its prompt here",
                           rid, NAMESPACE)
            return 0, False
        if ours.get("prompt_digest") != prompt_digest(request):
            logger.warning("DHiSparse: handoff %s was made for another prompt than request "
                           "%s's; computing its prompt here", hid, rid)
            return 0, False
        if num_computed_tokens:
            # The hierarchy admits a request's whole c4a history at once; the local hit's
            # rows are not in the handoff path, so the prompt is computed here instead.
            logger.warning("DHiSparse: request %s hit %d tokens of the local prefix cache; "
                           "handoff %s is not used (disable prefix caching on decode "
                           "instances)", rid, num_computed_tokens, hid)
            return 0, False
        # asked again while vLLM cannot allocate the blocks yet: same answer (the load
        # counts as started only once blocks are allocated for it)
        self.pending[rid] = (hid, str(params.get("remote_host") or "127.0.0.1"),
                             int(params.get("remote_port") or 0))
        return request.num_prompt_tokens, True

    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int,
                                 max_tokens: int) -> None:
        rid = request.request_id
        if rid not in self.pending or not num_external_tokens:
            return
        hid, host, port = self.pending.pop(rid)
        self.tried.add(rid)
        self.loads.append(LoadItem(rid, hid, host, port, num_external_tokens,
                                   tuple(list(b) for b in blocks.get_block_ids()), max_tokens))

    def take_loads(self) -> list[LoadItem]:
        out, self.loads = self.loads, []
        return out

    def _warn_role(self, key: str, request: "Request") -> None:
        if not self._warned_both:
            self._warned_both = True
            logger.warning("DHiSparse: request %s carries %s, which this instance's kv_role "
                           "does not serve (kv_producer captures, kv_consumer loads); served "
                           "locally", request.request_id, key)
