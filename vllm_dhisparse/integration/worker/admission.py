"""Keeps the hierarchy's rows in step with vLLM's.

* **Admission**: a request whose prefill this step completed (the scheduler half says
  so, whatever the chunking or prefix hit) is admitted after the forward, its history
  read from vLLM's paged cache, where every block is still held (kv_spec.py);
  resident-first placement is the hierarchy's call.  A request without room then is
  retried at its next step; with a device window it fails (vLLM frees its blocks).
* **Committed rows** (compressed rows whose tokens are all computed and verified, eq. 8)
  are appended to the tail at the next step's start, every request of the step in one
  ``append_batch`` per source.  Rows of drafts are never committed: vLLM's
  ``num_computed_tokens`` covers accepted tokens only once the scheduler has seen the
  step's verification; an asynchronous scheduler counts the previous step's drafts
  before that (``num_unverified_tokens``), and their rows wait for a later step.
"""
from __future__ import annotations

import torch
from vllm.logger import init_logger

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy

from ..layers.failures import Failures
from ..layers.model_probe import SparseLayer
from .requests import TrackedRequest
from ..layers.vllm_cache import VllmC4aCaches

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


class Admissions:
    def __init__(self, hierarchy: KVHierarchy, layers: dict[str, SparseLayer],
                 vllm_cache: VllmC4aCaches, failures: Failures, device_window_tokens: int):
        self.hierarchy = hierarchy
        self.layers = layers
        self.vllm_cache = vllm_cache
        self.failures = failures
        self.device_window_tokens = device_window_tokens
        self.pending: dict[str, list] = {}  # per source: (request, have, want) rows to append

    @staticmethod
    def committed_rows(req: TrackedRequest, layer: SparseLayer) -> int:
        return req.num_verified_tokens // layer.compress_ratio  # eq. 8: complete rows only

    def max_rows(self, req: TrackedRequest) -> dict[str, int]:
        return {name: min(self.hierarchy.source(name).spec.max_rows,
                          -(-(req.prompt_len + req.max_tokens) // layer.compress_ratio) + 1)
                for name, layer in self.layers.items()}

    def _vllm_rows(self, req: TrackedRequest, layer: SparseLayer, start: int,
                   end: int) -> torch.Tensor:
        return self.vllm_cache.rows(layer, req.block_ids[layer.group],
                                    torch.arange(start, end, dtype=torch.int64))

    # -- admission ---------------------------------------------------------------------
    def admit(self, req: TrackedRequest) -> None:
        """The request's history from vLLM's cache into the hierarchy; leaves it
        unadmitted when there is no room now."""
        imported = {name: self._vllm_rows(req, layer, 0, self.committed_rows(req, layer))
                    for name, layer in self.layers.items()}
        if not self.hierarchy.admit(req.req_id, self.max_rows(req), imported):
            logger.warning("DHiSparse: no room in the hierarchy to admit %s now", req.req_id)
            return
        req.admitted = True
        req.rows = {name: imported[name].shape[0] for name in self.layers}

    def admit_imported(self, req: TrackedRequest, rows: dict[str, torch.Tensor]) -> bool:
        """A request whose history came from elsewhere (a P/D handoff); False when there
        is no room yet."""
        if not self.hierarchy.admit(req.req_id, self.max_rows(req), rows):
            return False
        req.admitted = req.prefill_complete = True
        req.rows = {name: rows[name].shape[0] for name in self.layers}
        return True

    def admit_completed_prefills(self, requests: dict, step_req_ids: list[str]) -> None:
        """After the forward: requests whose prefill this step completed.  vLLM frees c4a
        blocks behind ``device_window_tokens`` only from the next step's allocation on
        (kv_spec.py), so every row is still in its cache."""
        for rid in step_req_ids:
            req = requests.get(rid)
            if req is None or req.admitted or req.failed or not req.prefill_complete:
                continue
            # drafts (or placeholder drafts) computed this step are not history
            req.num_computed_tokens += req.num_scheduled_tokens - req.num_spec_tokens
            req.num_scheduled_tokens = req.num_spec_tokens = 0
            with self.failures.isolated(req):
                self.admit(req)
            if not req.admitted and not req.failed and self.device_window_tokens:
                self.failures.fail(req, "no room in the hierarchy (request slots, device pages "
                                        "or host extent) to hold the history vLLM frees behind "
                                        "device_window_tokens; raise host_pool_gib / "
                                        "device_pool_pages or lower max_num_seqs")

    # -- committed rows ----------------------------------------------------------------
    def commit(self, req: TrackedRequest) -> None:
        """Rows that became committed wait for the step's other requests
        (``append_committed``: one append_batch per source)."""
        for name, layer in self.layers.items():
            have, want = req.rows[name], self.committed_rows(req, layer)
            if want > have:
                self.pending.setdefault(name, []).append((req, have, want))

    def append_committed(self) -> None:
        pending, self.pending = self.pending, {}
        for name, items in pending.items():
            layer = self.layers[name]
            batch = []  # (request, rows it commits up to, those rows)
            for req, have, want in items:
                if req.admitted and not req.failed:
                    with self.failures.isolated(req):
                        batch.append((req, want, self._vllm_rows(req, layer, have, want)))
            if not batch:
                continue
            try:
                failed = self.hierarchy.append_batch(
                    name, [req.req_id for req, _, _ in batch], torch.cat([d for _, _, d in batch]),
                    [d.shape[0] for _, _, d in batch])
            except Exception:  # noqa: BLE001 -- nothing changed when it raises: find whose
                logger.exception("DHiSparse: a batched append to %s failed; appending its %d "
                                 "requests one by one", name, len(batch))
                failed = None
            for req, want, rows in batch:
                with self.failures.isolated(req):
                    if failed is None:
                        self.hierarchy.append(req.req_id, name, rows)
                    elif req.req_id in failed:
                        raise failed[req.req_id]
                    req.rows[name] = want
