"""KVHierarchy: the engine-agnostic façade the vLLM glue calls (torch only).

One object per worker owns, for every KV source, the device page pool, the
host store, the resolver tables (``SourceState``), the resolver and the
residency manager.  The glue's calls map onto a decode step:

    admit(...)         scheduler: reserve required pages, place imported history
                       (resident-first), reclaim per eq. 4 or answer "wait"
    staging_arena(s)   attention hook: hold a staging arena while a layer runs
    resolve(...)       attention hook: selections [N, K, k] -> device locations
    append(...)        after the forward: new rows land in the tail
    append_batch(...)  the same for many requests: one device write of all rows
    step()             between steps: finish copies, back up completed tail
                       pages, repopulate a bounded number of optional pages
    finish / preempt   release everything the request holds

Sources with the same row layout keep their pools in one device storage
(``DeviceRows``), followed by chi staging arenas (``staging_arena.py``), or in a few
equal storages where one would pass 2**31 B (``placement.py``): locations are rows
of the source's storage, so one tensor holds every row a layer's attention reads.

Admission is all-or-nothing across sources: every source is planned first
(request slots, host extent, eq. 4 victims) and only when all can admit is anything
reclaimed or allocated.  Nothing here reclaims or repopulates under a reader:
``resolve`` only reads the published tables and updates the hot cache.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
import torch

from .device_pool import DevicePagePool
from .host_store import HostBackupError, HostStore
from .pinned import check_host_memory
from .residency import ResidencyManager
from .resolver import Resolver
from .source_state import SourceState
from .placement import place
from .specs import ResidencyConfig, SourceSpec, StagingSpec
from .staging_arena import ArenaLease, StagingArenas, sum_stats
from .transfers import CopyStream


@dataclass
class SourceParts:
    spec: SourceSpec
    state: SourceState
    pool: DevicePagePool
    host: HostStore
    resolver: Resolver
    residency: ResidencyManager
    arenas: StagingArenas | None  # shared with the other sources of its storage


class KVHierarchy:
    def __init__(self, sources: list[SourceSpec | Mapping[str, Any]],
                 config: ResidencyConfig | None = None, *, device: torch.device | str = "cpu",
                 backend: str = "auto", staging: StagingSpec | Mapping[str, Any] | None = None,
                 **knobs):
        if knobs:
            if config is not None:
                raise ValueError("pass residency knobs either as config=ResidencyConfig(...) or as "
                                 f"keywords, not both (got keywords {sorted(knobs)})")
            config = ResidencyConfig.from_dict(knobs)
        self.config = config or ResidencyConfig()
        specs = [s if isinstance(s, SourceSpec) else SourceSpec.from_dict(s) for s in sources]
        if not specs:
            raise ValueError("KVHierarchy needs at least one source spec")
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"source names must be distinct, got {names}")
        cfg = self.config
        check_host_memory(sum(s.host_rows * s.row_bytes for s in specs),
                          "host backing store (host_pool_gib; sources "
                          + ", ".join(f"{s.name}: {s.host_rows} rows x {s.row_bytes} B" for s in specs)
                          + ")")
        if isinstance(staging, Mapping):
            staging = StagingSpec.from_dict(staging)
        self.copies = CopyStream(device)  # backups and repopulation overlap compute
        self._last_active: dict[str, int] = {}  # request -> last step it produced rows
        self.device_rows, self.staging, placed = place(specs, staging, device)
        self.sources: dict[str, SourceParts] = {}
        for s in specs:
            rows, base, arenas = (placed[s.name].rows, placed[s.name].base_row,
                                  placed[s.name].arenas)
            state = SourceState(name=s.name, row_bytes=s.row_bytes, page_size=s.page_size,
                                max_req_slots=s.max_req_slots, max_rows=s.max_rows,
                                hot_cache_rows=s.hot_cache_rows, device=device)
            pool = DevicePagePool(name=s.name, num_pages=s.device_pages, page_size=s.page_size,
                                  row_bytes=s.row_bytes, plane_bytes=s.plane_bytes, rows=rows,
                                  base_row=base)
            host = HostStore(name=s.name, row_bytes=s.row_bytes, capacity_rows=s.host_rows,
                             copies=self.copies)
            resolver = Resolver(state, pool.planes, host.rows, backend=backend,
                                row_range=pool.row_range)
            residency = ResidencyManager(
                state, pool, host, tail_pages=s.tail_pages,
                reserve_pages=cfg.admission_reserve_pages, policy=cfg.reclaim_policy,
                optional_residency=cfg.optional_residency, eager_backup=cfg.eager_backup,
                last_active=self._last_active, run_pages=cfg.run_pages)
            self.sources[s.name] = SourceParts(s, state, pool, host, resolver, residency, arenas)
        self.requests: dict[str, dict[str, int]] = {}  # req -> source -> max_rows
        self.step_index = 0
        self.counters = dict(admissions=0, admissions_waited=0, finished=0, preempted=0)
        self._failures: dict[str, str] = {}

    # -- lookups -----------------------------------------------------------------------
    def source(self, name: str) -> SourceParts:
        if name not in self.sources:
            raise KeyError(f"unknown source {name!r}; sources: {list(self.sources)}")
        return self.sources[name]

    def _require(self, req_id: str) -> str:
        if req_id not in self.requests:
            raise KeyError(f"unknown request id {req_id!r}; {len(self.requests)} requests admitted")
        return req_id

    def _check_rows(self, parts: SourceParts, rows: torch.Tensor, what: str) -> None:
        w = parts.spec.row_bytes
        if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8 or rows.dim() != 2 \
                or rows.shape[1] != w:
            raise ValueError(f"{what} for source {parts.spec.name!r} must be a uint8 tensor "
                             f"[n, {w}], got {getattr(rows, 'dtype', type(rows))} "
                             f"{tuple(getattr(rows, 'shape', ()))}")

    # -- admission ---------------------------------------------------------------------
    def admit(self, req_id: str, max_rows: int | Mapping[str, int],
              imported: Mapping[str, torch.Tensor] | None = None) -> bool:
        """Admits ``req_id`` in every source or in none.  False = wait (nothing changed)."""
        if req_id in self.requests:
            raise ValueError(f"request id {req_id!r} is already admitted")
        imported = dict(imported or {})
        for name in imported:
            self.source(name)
        limits = {}
        for name, parts in self.sources.items():
            mr = max_rows[name] if isinstance(max_rows, Mapping) else max_rows
            if not isinstance(mr, int) or isinstance(mr, bool) or not 1 <= mr <= parts.spec.max_rows:
                raise ValueError(f"request {req_id!r}: max_rows={mr!r} for source {name!r}; "
                                 f"allowed 1..{parts.spec.max_rows} (source max_rows)")
            if name in imported:
                self._check_rows(parts, imported[name], f"imported history of {req_id!r}")
                if imported[name].shape[0] > mr:
                    raise ValueError(f"request {req_id!r}: {imported[name].shape[0]} imported rows "
                                     f"for source {name!r} exceed max_rows={mr}")
            limits[name] = mr
        plans = {n: p.residency.plan_admission(limits[n]) for n, p in self.sources.items()}
        if any(plan is None for plan in plans.values()):
            self.counters["admissions_waited"] += 1
            return False
        # eq. 4 victims, backed up before their pages go: every source's backups are
        # issued before the host waits for any of them
        begun = []
        try:
            for name, plan in plans.items():
                rm = self.sources[name].residency
                begun.append((rm, rm.begin_reclaims(plan.victims)))
                rm.counters.reclaim_events += bool(plan.victims)
        except HostBackupError as e:
            if e.req_id not in self.requests:  # not a victim's: nobody to fail alone
                for _, batch in begun:
                    batch.wait()
                raise
            # A victim's deferred backup could not start: it alone fails (take_failures);
            # the reclaims already issued complete, releasing it frees its pages, so plan
            # again.
            for rm, batch in begun:
                rm.finish_reclaims(batch)
            self._failures[e.req_id] = str(e)
            self._release(e.req_id)
            self.counters["preempted"] += 1
            return self.admit(req_id, max_rows, imported)
        except BaseException:  # nothing freed: the copies issued finish before the caller goes on
            for _, batch in begun:
                batch.wait()
            raise
        for rm, batch in begun:
            rm.finish_reclaims(batch)
        writes = {name: [] for name in self.sources}  # host copies of imported rows: one wait
        try:
            for name, parts in self.sources.items():
                parts.residency.admit(req_id, limits[name], imported.get(name), writes[name])
            for name, parts in self.sources.items():
                parts.residency.complete_host_writes(writes[name])
        except BaseException:  # all-or-nothing: undo the sources already admitted
            for pending in (p for w in writes.values() for p in w):  # before extents go back
                pending.transfer.wait()
            for parts in self.sources.values():
                if req_id in parts.residency.requests:
                    parts.residency.release(req_id)
            raise
        self.requests[req_id] = limits
        self._last_active[req_id] = self.step_index
        self.counters["admissions"] += 1
        return True

    # -- decode ------------------------------------------------------------------------
    def append(self, req_id: str, source: str, rows: torch.Tensor) -> None:
        """Decoded rows of ``req_id`` go into the tail of ``source``."""
        self._require(req_id)
        parts = self.source(source)
        self._check_rows(parts, rows, f"appended rows of {req_id!r}")
        rm = parts.residency
        rm.tail.append(rm.request(req_id), rows)
        self._touch([req_id])

    def append_batch(self, source: str, req_ids: list[str], rows: torch.Tensor,
                     counts: list[int] | None = None) -> dict[str, Exception]:
        """``append`` for many requests in one go: ``counts[i]`` rows of ``rows`` ([T,
        row_bytes] uint8, in request order; default: T / N each) go to ``req_ids[i]``.
        Checked first (unknown request, row shape, counts, max_rows): a bad input
        changes nothing.  Returns what failed for single requests (a host backup on the
        synchronous path of a full tail, ``append``'s errors): those requests were not
        appended, every other one was."""
        parts = self.source(source)
        # set operations, not a loop: a decode step appends for every running request
        ids = set(req_ids)
        if not ids <= self.requests.keys():
            self._require(next(r for r in req_ids if r not in self.requests))
        if len(ids) != len(req_ids):
            raise ValueError(f"append_batch: request ids must be distinct, got {req_ids}")
        self._check_rows(parts, rows, f"appended rows of {len(req_ids)} requests")
        if counts is None:
            if (rows.shape[0] % len(req_ids)) if req_ids else rows.shape[0]:
                raise ValueError(f"append_batch: {rows.shape[0]} rows do not split evenly over "
                                 f"{len(req_ids)} requests; pass counts")
            cnt = np.full(len(req_ids), rows.shape[0] // max(1, len(req_ids)), dtype=np.int64)
        else:
            cnt = np.asarray(counts)
            # each count bounded before the sum: an int64 sum of huge counts could wrap
            if cnt.ndim != 1 or len(cnt) != len(req_ids) or (cnt.size and (
                    cnt.dtype.kind not in "iu" or cnt.min() < 0
                    or cnt.max() > rows.shape[0])) or int(cnt.sum()) != rows.shape[0]:
                raise ValueError(f"append_batch: counts {counts} must be one int >= 0 per "
                                 f"request summing to the {rows.shape[0]} rows")
        rm = parts.residency
        failed = rm.tail.append_batch(req_ids, rows, cnt)
        self._touch(req_ids)
        return failed

    def _touch(self, req_ids: list[str]) -> None:
        """The requests were active in this step (every source's reclaim order reads it)."""
        self._last_active.update(dict.fromkeys(req_ids, self.step_index))

    @contextlib.contextmanager
    def staging_arena(self, source: str):
        """Holds a staging arena for one layer of ``source``: take it before resolving,
        leave the block when the layer's attention has returned (also on an error).
        RuntimeError when all chi arenas are held; without arenas (no ``staging``)
        yields None."""
        arenas = self.source(source).arenas
        if arenas is None:
            yield None
            return
        lease = arenas.take(source)
        try:
            yield lease
        finally:
            arenas.release(lease)

    def resolve(self, source: str, req_ids: list[str], selections: torch.Tensor,
                staging_rows: torch.Tensor | None = None, validate: bool = True,
                arena: ArenaLease | None = None, arena_rows: list[int] | None = None):
        """``(locations [N, K, k] int32, counters [N, 6] int32)``; see ``Resolver.resolve``.

        When K*k exceeds B, overflow misses go to ``staging_rows`` or, with ``arena``
        (held from ``staging_arena(source)`` until the locations are read), to the
        arena's rows of batch rows ``arena_rows`` (default 0..N-1: the i-th request gets
        batch row arena_rows[i]).
        """
        parts = self.source(source)
        if validate:
            parts.resolver.validate(req_ids, selections)
        if staging_rows is not None and arena is not None:
            raise ValueError("pass staging_rows or a staging arena lease, not both")
        if arena_rows is not None and arena is None:
            raise ValueError("arena_rows names rows of a staging arena: pass its lease")
        if arena is not None:
            if arena.source != source or arena.arenas is not parts.arenas:
                raise ValueError(f"staging arena held by source {arena.source!r} passed to a "
                                 f"resolve of source {source!r}")
            n, n_queries, top_k = selections.shape
            rows = list(range(n)) if arena_rows is None else list(arena_rows)
            if len(rows) != n:
                raise ValueError(f"arena_rows names {len(rows)} batch rows for {n} requests")
            staging_rows = arena.overflow_rows(rows,
                                               parts.resolver.staging_columns(n_queries, top_k))
        return parts.resolver.resolve(req_ids, selections, staging_rows, validate=False)

    def resolve_req_slots(self, source: str, req_slots: torch.Tensor,
                          selections: torch.Tensor, staging_rows: torch.Tensor | None = None):
        """``resolve`` with the batch rows' request slots on the device ([N] int32, distinct
        apart from -1 for a padding row; not checked), as device-side routing finds them (``req_slot_of`` maps request
        ids to slots outside the step): capturable in a CUDA graph.  Without overflow
        staging unless ``staging_rows`` are given.  # ([N, K, k] int32, [N, 6] int32)"""
        return self.source(source).resolver.resolve_req_slots(req_slots, selections,
                                                              staging_rows)

    def req_slot_of(self, source: str, req_id: str) -> int:
        """The request slot of ``req_id`` in ``source`` (its row of the source's tables)."""
        self._require(req_id)
        return self.source(source).state.req_slot(req_id)

    def host_only_rows(self, req_id: str) -> dict[str, int]:
        """Per source, the rows of ``req_id``'s imported history that no device page holds
        now (optional residency did not keep them): attention reads them from host."""
        self._require(req_id)
        out = {}
        for name, parts in self.sources.items():
            rec = parts.residency.request(req_id)
            out[name] = (rec.eligible_pages - len(rec.optional)) * parts.spec.page_size
        return out

    def read_history(self, req_id: str, source: str, n: int) -> torch.Tensor:
        """Rows ``0..n-1`` of ``req_id``'s history in ``source``, read from where they live
        now: a page published in the direct map is read on device, any other row from its
        host copy (every row below the length is one or the other, invariant (a)).
        Synchronous; for copying a request's history out, never on the step path.
        # [n, row_bytes] uint8 on the host"""
        self._require(req_id)
        parts = self.source(source)
        st, ps = parts.state, parts.spec.page_size
        length = st.seq_len(req_id)
        if not 0 <= n <= length:
            raise ValueError(f"read_history: {n} rows of {req_id!r} in {source!r}; it holds "
                             f"{length}")
        rows = torch.arange(n, dtype=torch.int64)
        table = st.page_table[st.req_slot(req_id), :-(-n // ps)].cpu().to(torch.int64)
        first = table[rows // ps]  # device row of each row's page, -1 when not published
        on_device = first >= 0
        out = torch.empty((n, parts.spec.row_bytes), dtype=torch.uint8)
        if bool(on_device.any()):
            out[on_device] = parts.pool.read(first[on_device] + rows[on_device] % ps).cpu()
        on_host = ~on_device
        if bool(on_host.any()):
            backed = parts.host.backed(req_id)[:n]
            if not bool(backed[on_host].all()):
                row = int(rows[on_host & ~backed][0])
                raise RuntimeError(f"read_history: row {row} of {req_id!r} in {source!r} is "
                                   f"neither published on device nor backed on host")
            out[on_host] = parts.host.read(req_id, rows[on_host])
        return out

    def step(self) -> None:
        """Between decode steps: complete copies, back up full tail pages, repopulate.

        A failed host backup fails only the request that owns the rows: it is released
        here and reported by ``take_failures``; every other request proceeds."""
        self.step_index += 1
        for parts in self.sources.values():
            rm = parts.residency
            rm.complete_populations()  # pending -> ready (published)
            self._failures.update(rm.tail.advance())
            for rid in [r for r in self._failures if r in self.requests]:
                self.preempt(rid)
            rm.repopulate(self.config.repopulate_pages_per_step)
        for arenas in self.staging:
            arenas.end_step()

    @property
    def device_bytes(self) -> int:
        """Device bytes allocated: every storage (pools and arenas)."""
        return sum(rows.nbytes for rows in self.device_rows)

    def invalid_selections(self) -> dict[str, int]:
        """Cumulative selections outside ``[-1, length)`` per source, which calls with
        ``validate=False`` resolved as padding: one host read for all sources (a caller
        that skips the per-call check looks here once per step)."""
        counts = torch.stack([p.resolver.invalid_count for p in self.sources.values()]).tolist()
        return dict(zip(self.sources, counts))

    def take_failures(self) -> dict[str, str]:
        """Requests released by ``step`` because a host backup failed (request -> error)."""
        out, self._failures = self._failures, {}
        return out

    # -- release -----------------------------------------------------------------------
    def finish(self, req_id: str) -> None:
        self._release(req_id)
        self.counters["finished"] += 1

    def preempt(self, req_id: str) -> None:
        """Preemption frees like completion; a re-admission starts from imported history."""
        self._release(req_id)
        self.counters["preempted"] += 1

    def _release(self, req_id: str) -> None:
        self._require(req_id)
        for parts in self.sources.values():
            parts.residency.release(req_id)
        del self.requests[req_id]
        self._last_active.pop(req_id, None)

    # -- observability -----------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counters, step=self.step_index, admitted=len(self.requests))
        per_source = {}
        for name, parts in self.sources.items():
            rm, ps = parts.residency, parts.spec.page_size
            eligible = sum(r.eligible_pages for r in rm.requests.values()) * ps
            per_source[name] = dict(
                eligible_history_rows=eligible,
                ready_optional_rows=rm.optional_pages() * ps,
                optional_pages=rm.optional_pages(),
                pending_pages=rm.pending_pages(),
                required_pages=rm.required_pages(),
                reserve_pages=rm.reserve,
                free_pages=parts.pool.num_free,
                device_pages=parts.pool.num_pages,
                host_bytes_used=parts.host.bytes_used,
                host_bytes_total=parts.host.bytes_total,
                **dataclasses.asdict(rm.counters),
                resolver=dataclasses.asdict(parts.resolver.totals()),
                resolver_backend=parts.resolver.backend,
            )
        out["sources"] = per_source
        out["staging"] = sum_stats([a.stats() for a in self.staging])
        out["device_bytes"] = self.device_bytes
        return out
