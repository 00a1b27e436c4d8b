"""Triton resolve + gather against the torch references at real sizes (H200).

For each configuration (top_k k, hot budget B = 2k, K queries, batch, row width) it
builds a pinned host pool with each request's rows contiguous, a device pool
(hot rows | direct pages | staging), and runs several consecutive calls on the
same state: cold cache with only the tail direct, then warm calls while more
optional-history pages become direct.  Every call compares all outputs and all
state tensors of ``resolve`` with ``resolve_reference`` run on a shadow copy of
the state, the whole device pool after ``gather_rows`` with ``gather_reference``
on a shadow pool, and the bytes at every returned location with the ground-truth
rows.  A last call per configuration runs on corrupted tables of one request
(out-of-range and negative entries in every table) with a padding row (slot -1):
the same checks, and the repairs must be counted.  Prints a table, writes JSON,
exits 1 on any mismatch.

    python benchmarks/gpu_correctness.py                      # H200, < 5 min
    TRITON_INTERPRET=1 python benchmarks/gpu_correctness.py --small --out /tmp/x.json
    python benchmarks/gpu_correctness.py --smoke              # CI (CPU): one configuration
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PAGE_SIZE = 64
HOST_POOL_GIB = 2.0
SMOKE_CASE = "k8_K3_N5_2432B"  # --smoke: several queries per request, the widest row
DIRECT_FRACTIONS = (0.0, 0.25, 0.5, 0.75)  # optional history made direct before call i (tail always)


@dataclass
class Case:
    top_k: int
    queries: int
    batch: int
    row_bytes: int
    calls: list = field(default_factory=list)
    passed: bool = True

    @property
    def name(self):
        return f"k{self.top_k}_K{self.queries}_N{self.batch}_{self.row_bytes}B"


def cases(small: bool) -> list[Case]:
    """Every (k, K) with every batch; row widths rotate so each meets each batch and K."""
    rows = (584, 656, 2432)
    ks, Ks, batches = ((8, 16), (1, 3), (2, 5)) if small else ((512, 2048), (1, 4, 8), (8, 32, 160))
    return [Case(k, K, n, rows[(i + j + m) % 3])
            for m, k in enumerate(ks) for i, K in enumerate(Ks) for j, n in enumerate(batches)]


class Setup:
    """Host pool, device pool and hierarchy state for one configuration."""

    def __init__(self, case: Case, pool: torch.Tensor, dev: str, g: torch.Generator, small: bool):
        k, n, w = case.top_k, case.batch, case.row_bytes
        self.dev, self.g, self.case = dev, g, case
        self.page_size = 4 if small else PAGE_SIZE
        self.B = 2 * k
        self.S = n + 2  # two idle slots: slot ids are not 0..N-1
        cap = pool.numel() // (self.S * w)
        self.P = min(max(cap, 0), 8 * k if small else 6 * k)
        if self.P < k:
            raise SystemExit(f"{case.name}: host pool too small for {self.S} x {k} rows of {w} B")
        P, S, B, ps = self.P, self.S, self.B, self.page_size
        self.n_pages = -(-P // ps)
        self.host_rows = pool[:S * P * w].view(S * P, w)  # pinned on GPU machines
        self.truth = self.host_rows.to(dev)  # device copy of the ground truth (and gather oracle)
        self.host_base = (torch.randperm(S, generator=g) * P).to(dev)
        self.lengths = torch.full((S,), P, dtype=torch.int64)
        short = torch.randperm(S, generator=g)[:max(1, S // 8)]
        self.lengths[short] = torch.randint(1, k, (len(short),), generator=g)  # fewer rows than k
        self.lengths = self.lengths.to(dev)

        n_hot, n_direct = S * B, S * self.n_pages * ps
        per_row = max(0, case.queries * k - B)
        self.stage_start = n_hot + n_direct
        self.device_rows = torch.zeros(n_hot + n_direct + n * per_row, w, dtype=torch.uint8,
                                       device=dev)
        self.hot_loc = torch.randperm(n_hot, generator=g).int().view(S, B).to(dev)
        page_slot = torch.randperm(S * self.n_pages, generator=g).to(dev)
        self.page_starts = (n_hot + page_slot * ps).int().view(S, self.n_pages)
        # every page's rows sit at their device place; page_table decides which are "ready"
        rows = torch.arange(S * self.n_pages * ps, device=dev)
        slot, pos = rows // (self.n_pages * ps), rows % (self.n_pages * ps)
        keep = pos < P
        dst = self.page_starts.flatten()[slot * self.n_pages + pos // ps].long() + pos % ps
        self.device_rows[dst[keep]] = self.truth[self.host_base[slot[keep]] + pos[keep]]
        self.staging_rows = (n_hot + n_direct + torch.randperm(n * per_row, generator=g).int()) \
            .view(n, per_row).to(dev)
        self.page_table = torch.full((S, self.n_pages), -1, dtype=torch.int32, device=dev)
        self.ready = torch.zeros(S, self.n_pages, dtype=torch.bool)
        self.hot_pos = torch.full((S, B), -1, dtype=torch.int32, device=dev)
        self.hot_slot_of = torch.full((S, P), -1, dtype=torch.int32, device=dev)
        self.hot_clock = torch.randint(0, 2**31 - 1, (S,), generator=g, dtype=torch.int32).to(dev)
        self.hot_stamp = (self.hot_clock[:, None] - torch.randint(
            0, 4096, (S, B), generator=g, dtype=torch.int32).to(dev)).contiguous()
        self.shadow = [t.clone() for t in self.state()]
        # per-slot working set: the rows the indexer keeps coming back to
        self.working = torch.rand(S, P, generator=g).to(dev) < 0.6 * k / P
        self.set_direct(0.0)

    def state(self):
        return (self.hot_pos, self.hot_stamp, self.hot_clock, self.hot_slot_of)

    def set_direct(self, fraction: float):
        """The tail page of each request plus ``fraction`` of its history is direct."""
        S, n_pages = self.S, self.n_pages
        last = ((self.lengths.cpu() - 1) // self.page_size).clamp(min=0)
        self.ready |= torch.rand(S, n_pages, generator=self.g) < fraction
        self.ready[torch.arange(S), last] = True
        self.page_table.copy_(torch.where(self.ready.to(self.dev), self.page_starts, -1))

    def corrupt(self, req_slots: torch.Tensor, sel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Corrupts the tables of batch row 0's request (kernel state and shadow alike) with
        out-of-range and negative entries, makes the last batch row a padding row, and
        has row 0 select the rows whose entries were corrupted.  Returns the call's
        (selections, slot ids)."""
        s, B, P = int(req_slots[0]), self.B, self.P
        i32 = (-7, -2**31, 2**31 - 1, -(2**30) + 3)
        held = (self.hot_pos[s] >= 0).nonzero().flatten()
        pick = held[torch.randperm(held.numel(), generator=self.g)[:8].to(held.device)]
        rows = self.hot_pos[s, pick].long()
        bad_hso = [i32[i % 4] if i % 5 else B + i for i in range(rows.numel())]
        empty = (self.hot_pos[s] < 0).nonzero().flatten()[:2]  # never-held slots go bad too
        ready = self.ready[s].nonzero().flatten()[:1]
        bad_hp = torch.tensor([P, -5][:empty.numel()], dtype=torch.int32, device=self.dev)
        bad_stamp = torch.tensor([-1, 2**31 - 1, -2**31][:min(3, B)], dtype=torch.int32,
                                 device=self.dev)  # any value is a stamp: ages only
        bad_hso = torch.tensor(bad_hso, dtype=torch.int32, device=self.dev)
        for hp, stamp, _, hso in (self.state(), self.shadow):
            hso[s, rows] = bad_hso
            hp[s, empty] = bad_hp
            stamp[s, :bad_stamp.numel()] = bad_stamp
        if ready.numel():  # a ready page's entry beyond the device pool (read-only table)
            self.page_table[s, int(ready[0])] = self.device_rows.shape[0]
        sel = sel.clone()
        k = sel.shape[2]
        sel[0, 0, :min(k, rows.numel())] = rows[:k].int()
        req_slots = req_slots.clone()
        if req_slots.numel() > 1:
            req_slots[-1] = -1
        return sel, req_slots

    def selections(self, req_slots: torch.Tensor) -> torch.Tensor:
        """K distinct top-k rows per query, shared working set across queries, -1 padding."""
        case, P = self.case, self.P
        n, K, k = case.batch, case.queries, case.top_k
        scores = torch.rand(n, K, P, generator=self.g).to(self.dev)
        scores += 1.0 * self.working[req_slots.long()][:, None, :]
        length = self.lengths[req_slots.long()][:, None, None]
        scores = torch.where(torch.arange(P, device=self.dev) < length, scores, -1.0)
        sel = scores.topk(k, dim=-1).indices
        return torch.where(sel < length, sel, -1).int()

    def drift(self):
        flip = torch.rand(self.working.shape, generator=self.g).to(self.dev) < 0.1
        self.working ^= flip & (torch.rand(self.working.shape, generator=self.g).to(self.dev) < 0.5)


def run_call(setup: Setup, sel, req_slots, resolve, resolve_reference, gather_rows,
             gather_reference, sync) -> dict:
    s = setup
    common = (s.page_table, s.page_size)
    sync()
    t0 = time.perf_counter()
    got = resolve(sel, req_slots, *common, s.hot_pos, s.hot_loc, s.hot_stamp, s.hot_clock,
                  s.hot_slot_of, s.staging_rows, s.host_base,
                  num_device_rows=s.device_rows.shape[0])
    sync()
    t1 = time.perf_counter()
    locations, miss_src, miss_dst, miss_count, counters = got
    before = s.device_rows.clone()
    gather_rows(s.host_rows, s.device_rows, miss_src, miss_dst, miss_count)
    sync()
    t2 = time.perf_counter()
    hp, stamp, clock, hs = s.shadow
    want = resolve_reference(sel, req_slots, *common, hp, s.hot_loc, stamp, clock, hs,
                             s.staging_rows, s.host_base, num_device_rows=s.device_rows.shape[0])
    errors = []
    for name, a, b in zip(("locations", "miss_src", "miss_dst", "miss_count", "counters"), got, want):
        if not torch.equal(a, b):
            errors.append(f"{name}: {int((a != b).sum())} entries differ")
    for name, a, b in zip(("hot_pos", "hot_stamp", "hot_clock", "hot_slot_of"),
                          s.state(), s.shadow):
        if not torch.equal(a, b):
            errors.append(f"{name}: {int((a != b).sum())} entries differ")
    gather_reference(s.truth, before, miss_src, miss_dst, miss_count)  # oracle on the device copy
    if not torch.equal(before, s.device_rows):
        errors.append(f"gather: {int((before != s.device_rows).any(-1).sum())} device rows differ")
    del before
    bad_bytes = bad_pad = 0
    for n in range(sel.shape[0]):
        if int(req_slots[n]) < 0:  # padding row: no location at all
            bad_pad += int((locations[n] != -1).sum())
            continue
        valid = sel[n] >= 0
        bad_pad += int((locations[n][~valid] != -1).sum())
        loc = locations[n][valid].long()
        src = s.host_base[req_slots[n].long()] + sel[n][valid].long()
        if loc.numel() and (loc.min() < 0 or loc.max() >= s.device_rows.shape[0]):
            bad_bytes += int(((loc < 0) | (loc >= s.device_rows.shape[0])).sum())
            continue
        bad_bytes += int((s.device_rows[loc] != s.truth[src]).any(-1).sum())
    if bad_bytes:
        errors.append(f"bytes: {bad_bytes} selections read wrong rows")
    if bad_pad:
        errors.append(f"padding: {bad_pad} padded selections have a location")
    c = counters.sum(0).tolist()
    fetched = int(miss_count.sum())
    moved = fetched * s.case.row_bytes
    return dict(direct=c[0], hot=c[1], host=c[2], fetched=fetched, repairs=c[4],
                staged=int((miss_dst >= s.stage_start).sum()),
                resolve_ms=round((t1 - t0) * 1e3, 3), gather_ms=round((t2 - t1) * 1e3, 3),
                gather_gbps=round(moved / max(t2 - t1, 1e-9) / 1e9, 2),
                ok=not errors, errors=errors)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="tiny sizes (CPU, TRITON_INTERPRET=1)")
    ap.add_argument("--smoke", action="store_true",
                    help="CI's run: --small with one configuration (K = 3, five requests, "
                         "the widest row) and its corrupted-tables call, JSON to a temporary file")
    ap.add_argument("--calls", type=int, default=3, help="consecutive calls per configuration")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", default="", help="comma-separated configuration names (default: all)")
    ap.add_argument("--host-pool-gib", type=float, default=HOST_POOL_GIB)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/gpu_correctness.json"))
    args = ap.parse_args()
    if args.smoke:
        args.small, args.cases = True, args.cases or SMOKE_CASE
        # a smoke's file stays out of results/ (every file there is named by the ledger)
        if args.out == ap.get_default("out"):
            args.out = os.path.join(tempfile.gettempdir(), "gpu_correctness_smoke.json")

    cuda = torch.cuda.is_available()
    if not cuda:
        if not args.small:
            print("no CUDA device: run with --small (and TRITON_INTERPRET=1) on CPU", file=sys.stderr)
            return 2
        os.environ.setdefault("TRITON_INTERPRET", "1")
    sys.path.insert(0, str(ROOT))
    import triton

    from vllm_dhisparse.triton_kernels import gather_reference, gather_rows, resolve, resolve_reference

    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    dev = "cuda" if cuda and not interpret else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    pool_bytes = int((0.01 if args.small else args.host_pool_gib) * 2**30)
    print(f"host pool {pool_bytes / 2**30:.2f} GiB {'pinned' if dev == 'cuda' else '(cpu)'}", flush=True)
    # random bytes made on the device (fast), then kept in pinned memory
    pool = torch.empty(pool_bytes, dtype=torch.uint8, pin_memory=dev == "cuda")
    gen_dev = torch.Generator(device=dev).manual_seed(args.seed)
    for start in range(0, pool_bytes, 2**28):
        end = min(pool_bytes, start + 2**28)
        pool[start:end].copy_(torch.randint(0, 256, (end - start,), dtype=torch.uint8, device=dev,
                                            generator=gen_dev))

    all_cases = cases(args.small)
    if args.cases:
        wanted = args.cases.split(",")
        unknown = sorted(set(wanted) - {c.name for c in all_cases})
        if unknown:
            print(f"unknown --cases {unknown}; valid: {[c.name for c in all_cases]}", file=sys.stderr)
            return 2
        all_cases = [c for c in all_cases if c.name in wanted]
    header = (f"{'case':<24} {'call':>4} {'direct':>8} {'hot':>8} {'host':>8} {'fetched':>8} "
              f"{'staged':>7} {'res ms':>8} {'gat ms':>8} {'GB/s':>6}  result")
    print(header)
    print("-" * len(header))
    started = time.perf_counter()
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def write(done: list, complete: bool) -> dict:
        # rewritten after every configuration: a run cut short keeps what it checked
        result = dict(
            commit=os.environ.get("DHISPARSE_COMMIT"),  # the device copy may carry no .git
            device=torch.cuda.get_device_name() if dev == "cuda" else "cpu (TRITON_INTERPRET=1)",
            torch=torch.__version__, triton=triton.__version__,
            date_utc=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            small=args.small, seed=args.seed, calls_per_case=args.calls,
            page_size=PAGE_SIZE if not args.small else 4,
            host_pool_gib=round(pool_bytes / 2**30, 3), seconds=round(time.perf_counter() - started, 1),
            complete=complete, configurations_checked=len(done), configurations=len(all_cases),
            passed=all(c.passed for c in done) and bool(done),
            cases=[dict(name=c.name, **{k: v for k, v in asdict(c).items()}) for c in done],
        )
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        return result

    for index, case in enumerate(all_cases):
        g = torch.Generator().manual_seed(args.seed * 1000 + index)
        setup = Setup(case, pool, dev, g, args.small)
        req_slots = torch.randperm(setup.S, generator=g)[:case.batch].int().to(dev)
        # compile outside the timed calls, on throwaway copies of the state
        warm = setup.selections(req_slots)
        scratch = [t.clone() for t in setup.state()]
        out = resolve(warm, req_slots, setup.page_table, setup.page_size, scratch[0], setup.hot_loc,
                      scratch[1], scratch[2], scratch[3], setup.staging_rows, setup.host_base,
                      num_device_rows=setup.device_rows.shape[0])
        gather_rows(setup.host_rows, setup.device_rows.clone(), out[1], out[2], out[3])
        for call in range(args.calls):
            setup.set_direct(DIRECT_FRACTIONS[min(call, len(DIRECT_FRACTIONS) - 1)])
            sel = setup.selections(req_slots)
            r = run_call(setup, sel, req_slots, resolve, resolve_reference, gather_rows,
                         gather_reference, sync)
            case.calls.append(r)
            case.passed &= r["ok"]
            print(f"{case.name:<24} {call:>4} {r['direct']:>8} {r['hot']:>8} {r['host']:>8} "
                  f"{r['fetched']:>8} {r['staged']:>7} {r['resolve_ms']:>8.2f} {r['gather_ms']:>8.2f} "
                  f"{r['gather_gbps']:>6.1f}  {'ok' if r['ok'] else 'FAIL ' + '; '.join(r['errors'])}",
                  flush=True)
            setup.drift()
        # one more call on corrupted tables of one request, with a padding row: the
        # kernel and the reference must still agree and every real request stay exact
        sel, bad_slots = setup.corrupt(req_slots, setup.selections(req_slots))
        r = run_call(setup, sel, bad_slots, resolve, resolve_reference, gather_rows,
                     gather_reference, sync)
        if r["repairs"] == 0:
            r["ok"] = False
            r["errors"].append("corrupted tables but no repair counted")
        case.calls.append(dict(r, corrupted=True))
        case.passed &= r["ok"]
        print(f"{case.name:<24} {'bad':>4} {r['direct']:>8} {r['hot']:>8} {r['host']:>8} "
              f"{r['fetched']:>8} {r['staged']:>7} {r['resolve_ms']:>8.2f} {r['gather_ms']:>8.2f} "
              f"{r['gather_gbps']:>6.1f}  {'ok' if r['ok'] else 'FAIL ' + '; '.join(r['errors'])}"
              f" ({r['repairs']} repairs)", flush=True)
        del setup
        if dev == "cuda":
            torch.cuda.empty_cache()
        write(all_cases[:index + 1], complete=False)

    result = write(all_cases, complete=True)
    passed = result["passed"]

    n_fail = sum(not c.passed for c in all_cases)
    print(f"\n{len(all_cases) - n_fail}/{len(all_cases)} configurations passed "
          f"in {result['seconds']} s; wrote {out_path}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
