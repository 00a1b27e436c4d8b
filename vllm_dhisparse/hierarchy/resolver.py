"""Resolver façade: selected positions ``[N, K, k]`` -> device locations (eq. 2, 6, 12).

Validates user-facing input, picks the implementation (fused Triton kernels on
CUDA; elsewhere ``resolve_torch``, the torch reference with hit-only batch rows
batched; ``reference`` runs the specification alone), runs resolve then the host->device
gather, and keeps running counters.  Counters stay on the device and are
summed there; nothing here forces a host sync except input validation, which
can be switched off by a caller that already guarantees bounds.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_dhisparse.triton_kernels import reference
from vllm_dhisparse.triton_kernels.resolve_torch import resolve_torch
from vllm_dhisparse.triton_kernels.reference import (COUNTER_DIRECT, COUNTER_FETCHED, COUNTER_HOST,
                                                     COUNTER_HOT, COUNTER_INVALID, COUNTER_REPAIRS,
                                                     NUM_COUNTERS)

from .devices import same_device
from .source_state import SourceState

# verification totals read the host and fetched columns as one slice
assert COUNTER_FETCHED == COUNTER_HOST + 1

BACKENDS = ("auto", "triton", "torch", "reference")


def _pick_backend(requested: str, device: torch.device) -> str:
    if requested not in BACKENDS:
        raise ValueError(f"resolver backend {requested!r} is not one of {BACKENDS}")
    if requested != "auto":
        return requested
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
            return "triton"
        except ImportError:
            return "torch"
    return "torch"


@dataclass
class ResolverTotals:
    """Cumulative counters; plain ints (read once, when asked)."""
    calls: int = 0
    selections: int = 0
    direct: int = 0
    hot: int = 0
    host: int = 0
    fetched: int = 0
    bytes_fetched: int = 0
    # multi-query (K > 1) calls only: selections served from host vs rows copied
    verify_host_selections: int = 0
    verify_fetched: int = 0
    # out-of-range table entries the resolver degraded to empty (0 unless state was corrupt)
    state_repairs: int = 0
    # selections outside [-1, length) read as padding (0 unless a caller skipped validation)
    invalid_selections: int = 0


class Resolver:
    def __init__(self, source: SourceState, device_rows, host_rows: torch.Tensor,
                 backend: str = "auto", row_range: tuple[int, int] | None = None):
        """``device_rows``: the pool's row tensor ``uint8 [R, row_bytes]``, or its planes
        ``[(first byte, uint8 [R, plane bytes]), ...]`` (see ``DevicePagePool``).
        ``row_range``: the rows ``[first, end)`` of them that are this source's (a pool
        in a shared storage); page table entries outside it are repaired, never read."""
        if isinstance(device_rows, torch.Tensor):
            device_rows = [(0, device_rows)]
        widths = [plane.shape[1] if plane.dim() == 2 else -1 for _, plane in device_rows]
        if any(p.dtype != torch.uint8 or p.dim() != 2 for _, p in device_rows) \
                or sum(widths) != source.row_bytes:
            raise ValueError(f"device_rows must be uint8 [rows, {source.row_bytes}] (or planes "
                             f"summing to it), got widths {widths}")
        if host_rows.dtype != torch.uint8 or host_rows.dim() != 2 \
                or host_rows.shape[1] != source.row_bytes:
            raise ValueError(f"host_rows must be uint8 [rows, {source.row_bytes}], got "
                             f"{host_rows.dtype} {tuple(host_rows.shape)}")
        self.source = source
        self.planes = device_rows
        self.host_rows = host_rows
        rows = device_rows[0][1].shape[0]
        first, end = row_range if row_range is not None else (0, rows)
        if not 0 <= first <= end <= rows:
            raise ValueError(f"row_range [{first}, {end}) must lie within the {rows} device rows")
        self._bounds = dict(first_device_row=first, num_device_rows=end)
        device = device_rows[0][1].device
        self.backend = _pick_backend(backend, device)
        if self.backend == "triton":
            from vllm_dhisparse.triton_kernels.gather import gather_rows
            from vllm_dhisparse.triton_kernels.resolve import resolve
            self._resolve, self._gather = resolve, gather_rows
        else:
            self._resolve = (resolve_torch if self.backend == "torch"
                             else reference.resolve_reference)
            self._gather = reference.gather_reference
        dev = source.device
        self._totals = torch.zeros(NUM_COUNTERS, dtype=torch.int64, device=dev)
        self._verify = torch.zeros(2, dtype=torch.int64, device=dev)
        self._calls = 0

    def staging_columns(self, n_queries: int, top_k: int) -> int:
        """Staging rows a request needs so any union fits: K*k - B (paper 3.3)."""
        return max(0, n_queries * top_k - self.source.hot_cache_rows)

    def validate(self, req_ids: list[str], selections: torch.Tensor) -> torch.Tensor:
        src = self.source
        if not isinstance(selections, torch.Tensor) or selections.dtype != torch.int32:
            raise ValueError(f"selections must be an int32 tensor [N, K, k], got "
                             f"{getattr(selections, 'dtype', type(selections))}")
        if selections.dim() != 3:
            raise ValueError(f"selections must be [N, K, k], got shape {tuple(selections.shape)}")
        if not same_device(selections.device, src.device):
            raise ValueError(f"selections on {selections.device}, source {src.name!r} on {src.device}")
        n, _, top_k = selections.shape
        if n != len(req_ids):
            raise ValueError(f"selections has {n} rows but {len(req_ids)} request ids were given")
        if len(set(req_ids)) != len(req_ids):
            raise ValueError(f"request ids must be distinct within one call, got {req_ids}")
        if top_k > src.hot_cache_rows:
            raise ValueError(f"top-k {top_k} exceeds hot cache size B={src.hot_cache_rows} of source "
                             f"{src.name!r}; B must be >= k")
        req_slots = src.req_slot_tensor(req_ids)  # KeyError names an unknown id
        if selections.numel():
            # One host sync per call stays: a bad row must raise before the kernels index
            # with it, and the vLLM hook cannot check once per step, since every sparse
            # layer's indexer writes its own top-k (and this step's rows are masked per
            # source).  One pass (per-request min / max), one read; the error path alone
            # looks for the first bad element.
            lens = src.seq_lens[req_slots.long()]  # [N]
            lo, hi = torch.aminmax(selections.reshape(n, -1), dim=1)  # [N]
            if ((lo < -1) | (hi >= lens)).any().item():
                lens = lens.view(n, 1, 1)
                bad = (selections < -1) | (selections >= lens)
                b, q, i = (int(x) for x in bad.nonzero()[0])
                raise IndexError(
                    f"selection {int(selections[b, q, i])} at [{b}, {q}, {i}] (request "
                    f"{req_ids[b]!r}) is outside [0, {int(lens[b, 0, 0])}) rows of source "
                    f"{src.name!r}; -1 is the only allowed padding")
        return req_slots

    def resolve(self, req_ids: list[str], selections: torch.Tensor,
                staging_rows: torch.Tensor | None = None, validate: bool = True):
        """Returns ``(locations [N, K, k] int32, counters [N, 6] int32)``.

        Rows at the returned locations equal the requests' original rows (eq. 12)
        as soon as this returns (stream-ordered on CUDA).  Without ``validate`` (no host
        synchronisation) a selection outside ``[-1, length)`` is not refused: it reads
        nothing, gets location -1 and is counted (``invalid_selections``).
        """
        src = self.source
        if validate:
            req_slots = self.validate(req_ids, selections)
        else:
            req_slots = src.req_slot_tensor(req_ids)
        return self.resolve_req_slots(req_slots, selections, staging_rows)

    def resolve_req_slots(self, req_slots: torch.Tensor, selections: torch.Tensor,
                          staging_rows: torch.Tensor | None = None):
        """``resolve`` for batch rows given as request slots on the device (req_slots [N]
        int32, distinct apart from -1, which is a padding row: it reads and changes
        nothing and gets locations -1; nothing checks distinctness here):
        no host read, so a CUDA graph can capture it while the slots change between
        replays.  Selections are not validated (see ``resolve``).  Only the tensors'
        shapes are checked here.  # ([N, K, k] int32, [N, 6] int32)"""
        src = self.source
        if (selections.dim() != 3 or req_slots.shape != selections.shape[:1]
                or req_slots.dtype != torch.int32):
            raise ValueError(f"req_slots must be int32 [N] for selections [N, K, k]; got "
                             f"{req_slots.dtype} {tuple(req_slots.shape)} and "
                             f"{tuple(selections.shape)}")
        n, n_queries, top_k = selections.shape
        need = self.staging_columns(n_queries, top_k)
        if staging_rows is None:
            if need:
                raise ValueError(f"K*k = {n_queries * top_k} exceeds hot cache B = "
                                 f"{src.hot_cache_rows}: pass staging_rows [N, >= {need}] int32 "
                                 f"(device rows for overflow; KVHierarchy.resolve takes them "
                                 f"from a held staging arena)")
            staging_rows = torch.empty((n, 0), dtype=torch.int32, device=src.device)
        args = (selections, req_slots, src.page_table, src.page_size, src.hot_pos, src.hot_loc,
                src.hot_stamp, src.hot_clock, src.hot_slot_of, staging_rows, src.host_base)
        bounds = dict(self._bounds, seq_lens=src.seq_lens)
        if self.backend == "triton":
            # the launch copies the misses itself: inside the resolve kernel for small
            # K*k and at most two byte planes, else one gather per plane
            locations, _, _, _, counters = self._resolve(
                *args, host_rows=self.host_rows, device_rows=[p for _, p in self.planes],
                **bounds)
        else:
            locations, miss_src, miss_dst, miss_count, counters = self._resolve(*args, **bounds)
            planes = self.planes if bool(miss_count.any()) else []  # all hits: nothing to copy
            for start, plane in planes:  # one gather per plane; host rows are whole
                self._gather(self.host_rows[:, start:start + plane.shape[1]], plane,
                             miss_src, miss_dst, miss_count)
        per_call = counters.sum(0, dtype=torch.int64)
        self._totals += per_call
        if n_queries > 1:
            # a slice, not a list index (which copies its index from the host: a graph
            # capture of a verification step refuses that)
            self._verify += per_call[COUNTER_HOST:COUNTER_FETCHED + 1]
        self._calls += 1
        return locations, counters

    @property
    def invalid_count(self) -> torch.Tensor:
        """Cumulative invalid selections, on the device (reading it waits for the device).
        # [] int64"""
        return self._totals[COUNTER_INVALID]

    def totals(self) -> ResolverTotals:
        t = self._totals.tolist()
        v = self._verify.tolist()
        return ResolverTotals(
            calls=self._calls, selections=t[COUNTER_DIRECT] + t[COUNTER_HOT] + t[COUNTER_HOST],
            direct=t[COUNTER_DIRECT], hot=t[COUNTER_HOT], host=t[COUNTER_HOST],
            fetched=t[COUNTER_FETCHED], bytes_fetched=t[COUNTER_FETCHED] * self.source.row_bytes,
            verify_host_selections=v[0], verify_fetched=v[1], state_repairs=t[COUNTER_REPAIRS],
            invalid_selections=t[COUNTER_INVALID])
