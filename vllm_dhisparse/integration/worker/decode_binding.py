"""The worker's half of the routed FlashMLA decode (CUDA, cuda_attention.py).

One :class:`~vllm_dhisparse.flashmla.decode.RoutedDecode` per c4a layer, made and bound
to the layer in ``register_kv_caches``, before vLLM captures its CUDA graphs (a FULL
graph runs the layer's Python only at capture, so what it reads must exist then and
live as long as the engine).  Before every forward, outside graphs, :meth:`write_tables`
rewrites each layer's ``slot_by_block``: the block of an admitted request's newest token
-> the request's request slot in that layer's source, and the block after it too, for a
device ``seq_lens`` past the host's count; with asynchronous speculative decoding also the
blocks back to where the newest token lies if the previous step's drafts, which the host
counts before their verification, were all rejected.  After the forward,
:meth:`take_counters` reads the routing's counters (one device read per step): tokens
the hierarchy did not serve mean a request reached decode without being admitted, which
the worker reports, and a request whose rows of the step did not fit its staging rows is
named, so that the worker fails it.
"""
from __future__ import annotations

import torch

from vllm_dhisparse.flashmla import decode as D
from vllm_dhisparse.flashmla import routing as R
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy

from ..layers.model_probe import SparseLayer
from .requests import TrackedRequest

LOOKAHEAD_BLOCKS = 1  # blocks after the newest token's that map to the request too


class DecodeBinding:
    def __init__(self, hierarchy: KVHierarchy, layers: dict[str, SparseLayer],
                 kv_caches: dict[str, torch.Tensor], max_queries: int,
                 fresh_rows: dict[str, int], modules: dict):
        """``modules``: each c4a layer's attention module (cuda_attention.py's class)."""
        self.hierarchy, self.layers, self.modules = hierarchy, layers, modules
        self.routed: dict[str, D.RoutedDecode] = {}
        self.slot_reqs: dict[str, dict[int, str]] = {}  # per layer: request slot -> request
        for name, layer in layers.items():
            arenas = hierarchy.source(name).arenas
            if arenas is None:
                raise ValueError(f"c4a layer {name!r}: the routed decode stages its rows in "
                                 f"a staging arena; the hierarchy has none")
            # layers run one after another in stream order: each takes arena 0's rows
            self.routed[name] = D.RoutedDecode(
                hierarchy, name, num_vllm_blocks=kv_caches[name].shape[0],
                max_queries=max_queries, fresh_rows=fresh_rows[name],
                staging=arenas.table[0])
        for name, routed in self.routed.items():
            self.modules[name].routed = routed  # read from now on, by every capture too

    def write_tables(self, decoding: list[tuple[TrackedRequest, int]]) -> None:
        """``decoding``: (admitted request, its tokens once this step's are computed)."""
        for name, routed in self.routed.items():
            # what vLLM's warm-up and capture runs found unrouted or lost is no step's; the
            # selections stay, as the resolver's census keeps what such runs resolved (with
            # no table written they select nothing of a request slot)
            routed.counters[D.COUNTER_UNROUTED].zero_()
            routed.lost_by_slot.zero_()
            layer = self.layers[name]
            block_tokens = layer.rows_per_block * layer.compress_ratio
            blocks, req_slots = [], []
            self.slot_reqs[name] = {}
            for req, tokens in decoding:
                ids = req.block_ids[layer.group]
                newest = (tokens - 1) // block_tokens
                oldest = max(0, tokens - 1 - req.num_unverified_tokens) // block_tokens
                req_slot = self.hierarchy.req_slot_of(name, req.req_id)
                self.slot_reqs[name][req_slot] = req.req_id
                for b in ids[oldest:newest + 1 + LOOKAHEAD_BLOCKS]:
                    blocks.append(b)
                    req_slots.append(req_slot)
            R.write_slot_by_block(routed.slot_by_block, torch.tensor(blocks, dtype=torch.int64),
                                  torch.tensor(req_slots, dtype=torch.int32))

    def take_counters(self) -> dict:
        """The routing counters summed over layers since the last call, and the requests
        that lost rows of the step (``lost_requests``); one device read."""
        routed = list(self.routed.values())
        got = torch.cat([torch.stack([r.counters for r in routed]).sum(0)]
                        + [r.lost_by_slot for r in routed]).tolist()
        for r in routed:
            r.counters.zero_()
            r.lost_by_slot.zero_()
        lost, at = set(), D.NUM_COUNTERS
        for name, r in self.routed.items():
            n = r.lost_by_slot.shape[0]
            owners = self.slot_reqs.get(name, {})
            lost |= {owners[s] for s, count in enumerate(got[at:at + n])
                     if count and s in owners}
            at += n
        return dict(selected=got[D.COUNTER_SELECTED], fresh_selections=got[D.COUNTER_FRESH],
                    fresh_rows_lost=sum(got[D.NUM_COUNTERS:]),
                    unrouted_tokens=got[D.COUNTER_UNROUTED], lost_requests=lost)

    def close(self) -> None:
        for name in self.routed:
            self.modules[name].routed = None
