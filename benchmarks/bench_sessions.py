"""Sessions per GPU at 500K context: admit into a fixed HBM budget until the allocator refuses.

    python3 benchmarks/bench_sessions.py                      # H200, --budget-gib 100
    python benchmarks/bench_sessions.py --smoke               # CPU, tiny shapes

Shapes: ``memory_accounting.deepseek_v41_flash()`` (four c4 sources of 288 B rows,
B = 8192 for the source five layers select from and 4096 for the other three, 64-row
pages, one tail page per source; a 128-row sliding window in every layer, 20 dense
c128 layers and the c4 indexer keys stay resident in both arms).  Every session is
admitted at ``--tokens`` of context:

* resident: the state both arms keep resident plus the whole c4 history of every
  source, one device tensor each, session after session until torch's allocator
  refuses (the budget is enforced by ``set_per_process_memory_fraction``);
* hierarchy: a ``KVHierarchy`` for S sessions (device pool of S sessions' required
  pages, state tables for S slots) with S sessions admitted, plus each session's
  always-resident state; S is the largest count for which every allocation and every
  admission succeeds (bisection).  Nothing is imported, so nothing optional is
  resident: the count is what the required state allows.  The host side is not what is
  measured: the host rows are left unpinned and untouched (virtual memory) so that the
  count is HBM's; the host RAM those sessions' c4 history needs is reported next to it.

Checked: the hierarchy at the count found satisfies ``check_invariants`` (every
session's pages owned once, its tables consistent: the checker the tests use,
``vllm_dhisparse/hierarchy/invariants.py``).  Reported next to the counts:
``memory_accounting.py``'s per-session bytes and the counts they predict, the device
bytes per session measured from the allocator, and the resolver's per-session
metadata (the ``hot_slot_of`` inverse map dominates it).
Results: ``results/bench_sessions.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402
import memory_accounting as M  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import vllm_dhisparse.hierarchy.hierarchy as HH  # noqa: E402
import vllm_dhisparse.hierarchy.host_store as HS  # noqa: E402
from vllm_dhisparse.hierarchy.invariants import check_invariants  # noqa: E402

GIB = 2**30
SMOKE_TOKENS = 4000


class OutOfBudget(Exception):
    pass


class Budget:
    """The HBM budget: on CUDA torch's allocator refuses past it; on CPU (smoke) a
    ledger of the bytes the arms allocate refuses."""

    def __init__(self, dev: torch.device, nbytes: int):
        self.dev, self.nbytes, self.used = dev, nbytes, 0
        if dev.type == "cuda":
            total = torch.cuda.get_device_properties(dev).total_memory
            torch.cuda.set_per_process_memory_fraction(min(1.0, nbytes / total), dev)

    def charge(self, nbytes: int) -> None:
        if self.dev.type != "cuda":
            if self.used + nbytes > self.nbytes:
                raise OutOfBudget(f"{self.used + nbytes} > {self.nbytes} bytes")
            self.used += nbytes

    def reset(self) -> None:
        self.used = 0
        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.dev) if self.dev.type == "cuda" else self.used


def _refused(e: Exception) -> bool:
    return isinstance(e, (OutOfBudget, torch.cuda.OutOfMemoryError))


def shape_of(smoke: bool):
    """The model shape and its offloaded sources ``(name, row bytes, B, tokens per row)``
    (smoke: every B / 16)."""
    ds = M.deepseek_v41_flash()
    if smoke:
        ds = dataclasses.replace(
            ds, metadata_hot_cache_rows=ds.metadata_hot_cache_rows // 16,
            payload=tuple(dataclasses.replace(s, hot_cache_rows=s.hot_cache_rows // 16) if s.offloaded
                          else s for s in ds.payload))
    sources = []
    for s in ds.payload:
        for _ in range(s.count if s.offloaded else 0):
            sources.append((f"c4_{len(sources)}", s.row_bytes, s.hot_cache_rows, s.tokens_per_row))
    return ds, sources


def resident_sessions(budget: Budget, ds, sources, tokens: int, page: int, limit: int) -> int:
    """Sessions whose whole history fits the budget, allocated one after another."""
    held = []
    always = ds.always_resident_bytes(tokens) + ds.index_bytes(tokens)
    try:
        while len(held) < limit:
            per = [always] + [ds.history_rows(tokens, tpr) * rb for _, rb, _, tpr in sources]
            budget.charge(sum(per))
            held.append([torch.empty(n, dtype=torch.uint8, device=budget.dev) for n in per])
    except Exception as e:  # noqa: BLE001 -- the allocator's refusal is the measurement
        if not _refused(e):
            raise
    n = len(held)
    del held
    budget.reset()
    return n


def hierarchy_specs(sources, tokens: int, page: int, sessions: int) -> list[dict]:
    specs = []
    for name, rb, hot, tpr in sources:
        rows = -(-(-(-tokens // tpr)) // page) * page
        per_session = -(-hot // page) + 1  # hot cache pages + one tail page
        specs.append(dict(name=name, row_bytes=rb, page_size=page, hot_cache_rows=hot, tail_pages=1,
                          device_pages=sessions * per_session, host_rows=sessions * rows,
                          max_req_slots=sessions, max_rows=rows))
    return specs


def try_hierarchy(budget: Budget, ds, sources, tokens: int, page: int, sessions: int,
                  check: bool) -> dict | None:
    """The hierarchy's device state for ``sessions`` admitted sessions, or None when the
    budget refuses it."""
    before = budget.allocated()
    h = held = None
    try:
        h = HH.KVHierarchy(hierarchy_specs(sources, tokens, page, sessions), device=budget.dev)
        budget.charge(_metadata_bytes(h) + h.device_bytes)
        always = ds.always_resident_bytes(tokens) + ds.index_bytes(tokens)
        held = []
        for i in range(sessions):
            rows = {name: h.source(name).spec.max_rows for name, *_ in sources}
            if not h.admit(f"s{i}", rows):
                raise OutOfBudget(f"the hierarchy refused session {i}: no required pages left")
            budget.charge(always)
            held.append(torch.empty(always, dtype=torch.uint8, device=budget.dev))
        if check:
            check_invariants(h)
        out = dict(sessions=sessions, device_bytes=budget.allocated() - before,
                   metadata_bytes_per_session=_metadata_bytes(h) / sessions,
                   inverse_map_bytes_per_session=sum(
                       p.state.hot_slot_of.nbytes for p in h.sources.values()) / sessions)
    except Exception as e:  # noqa: BLE001 -- the allocator's refusal is the measurement
        if not _refused(e):
            raise
        out = None
    del h, held
    budget.reset()
    return out


def _state_tensors(h):
    for p in h.sources.values():
        for t in vars(p.state).values():
            if isinstance(t, torch.Tensor):
                yield t


def _metadata_bytes(h) -> int:
    return sum(t.nbytes for t in _state_tensors(h))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes and budget (CPU)")
    ap.add_argument("--budget-gib", type=float, default=100.0, help="HBM budget for the sessions")
    ap.add_argument("--tokens", type=int, default=M.K500, help="context per session")
    ap.add_argument("--name", default=None, help="results file stem")
    args = ap.parse_args(argv)
    # the smoke shapes' exact counts hold for the byte ledger, not for CUDA's allocator
    dev = torch.device("cpu") if args.smoke else C.device()
    if dev.type == "cuda":  # set_per_process_memory_fraction wants an index
        dev = torch.device("cuda", torch.cuda.current_device())
    tokens = SMOKE_TOKENS if args.smoke else args.tokens
    budget_bytes = int((0.05 if args.smoke else args.budget_gib) * GIB)
    ds, sources = shape_of(args.smoke)
    # the host rows stay virtual: nothing is imported, and the count measured is HBM's
    saved = HS.host_buffer, HH.check_host_memory
    HS.host_buffer = lambda nbytes, pin: torch.empty(nbytes, dtype=torch.uint8)
    HH.check_host_memory = lambda *a, **k: None
    try:
        budget = Budget(dev, budget_bytes)
        return _measure(args, dev, tokens, budget, ds, sources)
    finally:
        HS.host_buffer, HH.check_host_memory = saved
        if dev.type == "cuda":
            torch.cuda.set_per_process_memory_fraction(1.0, dev)


def _measure(args, dev, tokens: int, budget: Budget, ds, sources) -> int:
    page, budget_bytes = 64, budget.nbytes
    meta = C.metadata()
    predicted = {k: ds.table(tokens)[k] for k in ("resident", "adaptive")}
    print(f"# bench_sessions on {meta['device']} ({meta['date_utc']}): {tokens} tokens per "
          f"session, budget {budget_bytes / GIB:.2f} GiB")
    limit = int(budget_bytes // (predicted["adaptive"] * 0.5)) + 1
    n_res = resident_sessions(budget, ds, sources, tokens, page, limit)
    lo, hi, best = 0, limit, None  # bisection: lo fits, hi does not (or is the limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        got = try_hierarchy(budget, ds, sources, tokens, page, mid, check=False)
        if got:
            lo, best = mid, got
        else:
            hi = mid
    if lo:
        best = try_hierarchy(budget, ds, sources, tokens, page, lo, check=True)
        assert best, "the count that fitted during the bisection no longer fits"
    n_hier = lo
    if hi == limit and lo == limit - 1:
        print(f"  the hierarchy fitted every count tried, up to {lo}: raise the search limit")
    out = dict(
        meta=meta, tokens=tokens, budget_bytes=budget_bytes, sources=sources,
        resident_sessions=n_res, hierarchy_sessions=n_hier,
        ratio=n_hier / n_res if n_res else None,
        predicted_bytes_per_session=predicted,
        predicted_sessions={k: int(budget_bytes // v) for k, v in predicted.items()},
        predicted_ratio=predicted["resident"] / predicted["adaptive"],
        hierarchy=best,
        host_bytes_per_session=ds.host_backup_bytes(tokens),
        predicted_metadata_bytes_per_session=ds.metadata_bytes(tokens))
    print(f"  resident:  {n_res} sessions (predicted {out['predicted_sessions']['resident']})")
    print(f"  hierarchy: {n_hier} sessions (predicted {out['predicted_sessions']['adaptive']})"
          + (f", {best['device_bytes'] / max(n_hier, 1) / 2**20:.1f} MiB of device state each, "
             f"metadata {best['metadata_bytes_per_session'] / 2**20:.2f} MiB (inverse map "
             f"{best['inverse_map_bytes_per_session'] / 2**20:.2f} MiB)" if best else ""))
    if n_res:
        print(f"  ratio {out['ratio']:.2f} (predicted {out['predicted_ratio']:.2f}); host RAM "
              f"for the hierarchy's c4 history: {n_hier * out['host_bytes_per_session'] / GIB:.1f} GiB")
    name = args.name or ("bench_sessions_smoke" if args.smoke else "bench_sessions")
    C.write_json(name, out)
    return 0 if n_res and n_hier else 1


if __name__ == "__main__":
    sys.exit(main())
