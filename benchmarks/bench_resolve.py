"""Resolver cost (paper Figure 8): the miss path and the no-miss path.

Part 1, miss path (Fig. 8a): batch 32, K = 8 verification queries, B = 2k, cold
cache; selections shared / partial / disjoint across the K queries (overlap f:
each query = f*k common rows + (1-f)*k own rows), plus one retained-cache
point with no miss.  Time (resolve + gather) against the unique host-miss
bytes of the call; least-squares GB/s, as a ratio of the pinned ``copy_`` H2D
bandwidth measured in the same run.  Rows of 2432 B and 656 B, k = 2048 / 512.

Part 2, no-miss path (Fig. 8b/c): single query, k = 512, rows of 584 B,
B = 2k..16k, batch 8 and 160.  *direct*: every selected row is in a published
direct-map page; *scan*: no direct map, every selected row in the hot cache.
Each with 0 or 77 host misses per request.  Beside them, in the same run, the
*floor*: a kernel doing only what any direct lookup must (per batch row: load
the selections, load their page-table entries, store the locations), timed the
same way: the part of the direct path that launch and two dependent memory
reads cost whatever the resolver does.

Every configuration is checked once against ``vllm_dhisparse.triton_kernels.reference``
(outputs, state updates, payload) before it is timed; a mismatch exits 1.
Timing: see ``benchmarks/common.py`` (state restored before every iteration,
outside the events).

    python benchmarks/bench_resolve.py            # H200 sizes (~3-5 min)
    TRITON_INTERPRET=1 python benchmarks/bench_resolve.py --smoke   # CPU check
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

REAL = dict(
    miss_batch=32, miss_queries=8, miss_topk=(2048, 512), miss_row_bytes=(2432, 656),
    overlaps=(1.0, 0.75, 0.5, 0.25, 0.0), miss_reps=15,
    nm_topk=512, nm_budgets=(2048, 4096, 8192, 16384), nm_batches=(8, 160), nm_row_bytes=584,
    nm_rows=32768, nm_misses=77, nm_reps=60, page_size=64,
)
SMOKE = dict(
    miss_batch=3, miss_queries=4, miss_topk=(16,), miss_row_bytes=(72, 40),
    overlaps=(1.0, 0.5, 0.0), miss_reps=2,
    nm_topk=16, nm_budgets=(32, 64), nm_batches=(2, 3), nm_row_bytes=24,
    nm_rows=512, nm_misses=3, nm_reps=2, page_size=16,
)


def _selections_overlap(n: int, n_q: int, k: int, rows: int, f: float, seed: int) -> torch.Tensor:
    """[n, n_q, k]: f*k rows common to all queries, (1-f)*k own rows per query,
    all distinct, in random order within each query."""
    g = torch.Generator().manual_seed(seed)
    common_n = int(round(f * k))
    own_n = k - common_n
    out = torch.empty((n, n_q, k), dtype=torch.int32)
    for r in range(n):
        pool = torch.randperm(rows - 1, generator=g)[:common_n + n_q * own_n]
        common, own = pool[:common_n], pool[common_n:].view(n_q, own_n)
        for j in range(n_q):
            q = torch.cat([common, own[j]])
            out[r, j] = q[torch.randperm(k, generator=g)].to(torch.int32)
    return out


def _reset_tables(st: C.SynthState) -> None:
    st.hot_pos.fill_(-1)
    st.hot_slot_of.fill_(-1)


def _check_or_die(name: str, res: dict, failures: list) -> None:
    status = "ok" if res["ok"] else "MISMATCH"
    print(f"  check {name}: {status} ({res['message']}; unique misses {res['unique_misses']})")
    if not res["ok"]:
        failures.append(f"{name}: {res['message']}")


# --------------------------------------------------------------- miss path
def run_miss_path(cfg, resolve_fn, gather_fn, dev, failures, graph) -> list:
    n, n_q = cfg["miss_batch"], cfg["miss_queries"]
    out = []
    for row_bytes in cfg["miss_row_bytes"]:
        max_rows = 16 * max(cfg["miss_topk"])
        host = C.pinned_rows(n * max_rows, row_bytes, seed=row_bytes)
        for k in cfg["miss_topk"]:
            budget, rows = 2 * k, 16 * k
            st = C.build_state(n_req_slots=n, rows=rows, row_bytes=row_bytes, budget=budget,
                               staging_cols=n_q * k - budget, page_size=cfg["page_size"],
                               host_rows=host, dev=dev, seed=k)
            req_slots = torch.arange(n, dtype=torch.int32, device=dev)
            cases = [("cold", f) for f in cfg["overlaps"]] + [("retained", 1.0)]
            for cache, f in cases:
                sel = _selections_overlap(n, n_q, k, rows, f, seed=int(f * 100) + k).to(dev)
                _reset_tables(st)
                if cache == "retained":  # the shared rows already hot: no miss
                    C.make_hot(st, [sel[r, 0].long() for r in range(n)])
                st.save()
                name = f"miss row={row_bytes} k={k} {cache} overlap={f:.2f}"
                chk = C.check_against_reference(st, sel, req_slots, resolve_fn, gather_fn)
                _check_or_die(name, chk, failures)
                miss_bytes = chk["unique_misses"] * row_bytes

                def call(sel=sel, st=st):
                    C.resolve_and_copy(resolve_fn, gather_fn, st, sel, req_slots)

                t = C.time_gpu(call, setup=st.restore, reps=cfg["miss_reps"], graph=graph)
                s = t.summary()
                out.append(dict(row_bytes=row_bytes, top_k=k, budget=budget, batch=n,
                                queries=n_q, cache=cache, overlap=f,
                                unique_misses=chk["unique_misses"], miss_bytes=miss_bytes,
                                selections=n * n_q * k, **s))
                print(f"  {name}: {C.fmt_bytes(miss_bytes):>10}  median {s['median_ms']:.3f} ms "
                      f"[{s['min_ms']:.3f}, {s['max_ms']:.3f}] ({s['mode']})")
            del st
        del host
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def summarize_miss(points: list, pinned_gbps: float) -> list:
    fits = []
    for row_bytes in sorted({p["row_bytes"] for p in points}, reverse=True):
        for k in sorted({p["top_k"] for p in points}, reverse=True):
            ps = [p for p in points if p["row_bytes"] == row_bytes and p["top_k"] == k]
            if len(ps) < 2:
                continue
            fit = C.linear_fit([p["miss_bytes"] for p in ps], [p["median_ms"] * 1e-3 for p in ps])
            gbps = 1.0 / fit["slope"] / 1e9 if fit["slope"] > 0 else float("nan")
            shared = next(p for p in ps if p["cache"] == "cold" and p["overlap"] == 1.0)
            disjoint = [p for p in ps if p["cache"] == "cold" and p["overlap"] == 0.0]
            ratio_dj = disjoint[0]["median_ms"] / shared["median_ms"] if disjoint else None
            target = 0.90 if row_bytes >= 2048 else 0.75
            fits.append(dict(row_bytes=row_bytes, top_k=k, fit_gbps=gbps, r2=fit["r2"],
                             intercept_ms=fit["intercept"] * 1e3,
                             ratio_to_pinned=gbps / pinned_gbps if C.finite(pinned_gbps) else None,
                             target_ratio=target, disjoint_over_shared=ratio_dj))
    return fits


# ------------------------------------------------------------ no-miss path
def _nomiss_state(cfg, host, n, budget, mode, dev, seed):
    """direct: rows [0, D) published (D <= rows/2), hot cache holds B rows of [D, rows);
    scan: no direct map, hot cache holds B rows of [0, rows) including the selections."""
    rows, k, m, ps = cfg["nm_rows"], cfg["nm_topk"], cfg["nm_misses"], cfg["page_size"]
    # direct rows [0, half): as many as leave room above for the hot cache and the misses
    half = min(rows // 2, rows - 1 - budget - m) // ps * ps
    assert half >= k, f"nm_rows={rows} too small for B={budget}"
    st = C.build_state(n_req_slots=n, rows=rows, row_bytes=cfg["nm_row_bytes"], budget=budget,
                       staging_cols=0, page_size=ps, direct_rows=half if mode == "direct" else 0,
                       host_rows=host, dev=dev, seed=seed)
    g = torch.Generator().manual_seed(seed)
    hot, sel0, sel1 = [], [], []
    for _ in range(n):
        if mode == "direct":
            upper = half + torch.randperm(rows - 1 - half, generator=g)
            hot_r, miss_r = upper[:budget], upper[budget:budget + m]
            chosen = torch.randperm(half, generator=g)[:k]
        else:
            perm = torch.randperm(rows - 1, generator=g)
            hot_r, miss_r = perm[:budget], perm[budget:budget + m]
            chosen = hot_r[torch.randperm(budget, generator=g)[:k]]
        hot.append(hot_r)
        sel0.append(chosen)
        with_miss = torch.cat([chosen[:k - m], miss_r])
        sel1.append(with_miss[torch.randperm(k, generator=g)])
    C.make_hot(st, hot)
    st.save()
    to = dict(dtype=torch.int32, device=dev)
    return st, torch.stack(sel0).view(n, 1, k).to(**to), torch.stack(sel1).view(n, 1, k).to(**to)


@triton.jit
def _direct_floor_kernel(sel_ptr, slot_ptr, pt_ptr, pt_stride, loc_ptr, K,
                         PAGE_SIZE: tl.constexpr, BLOCK: tl.constexpr):
    # the least a direct lookup does: selection -> page-table entry -> location
    n = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    j = tl.arange(0, BLOCK)
    m = j < K
    sel = tl.load(sel_ptr + n * K + j, mask=m, other=0)
    base = tl.load(pt_ptr + slot * pt_stride + sel // PAGE_SIZE, mask=m & (sel >= 0), other=-1)
    tl.store(loc_ptr + n * K + j, tl.where(base >= 0, base + sel % PAGE_SIZE, -1), mask=m)


def direct_floor(st: C.SynthState, sel: torch.Tensor, req_slots: torch.Tensor) -> torch.Tensor:
    n, q, k = sel.shape
    loc = torch.empty_like(sel)
    _direct_floor_kernel[(n,)](sel, req_slots, st.page_table, st.page_table.stride(0), loc, q * k,
                               PAGE_SIZE=st.page_size, BLOCK=triton.next_power_of_2(q * k),
                               num_warps=8)
    return loc


def run_nomiss_path(cfg, resolve_fn, gather_fn, dev, failures, graph) -> list:
    out = []
    for n in cfg["nm_batches"]:
        host = C.pinned_rows(n * cfg["nm_rows"], cfg["nm_row_bytes"], seed=n)
        req_slots = torch.arange(n, dtype=torch.int32, device=dev)
        for budget in cfg["nm_budgets"]:
            for mode in ("direct", "scan"):
                st, sel0, sel1 = _nomiss_state(cfg, host, n, budget, mode, dev, seed=budget + n)
                for misses, sel in ((0, sel0), (cfg["nm_misses"], sel1)):
                    name = f"nomiss batch={n} B={budget} {mode} misses={misses}"
                    chk = C.check_against_reference(st, sel, req_slots, resolve_fn, gather_fn)
                    _check_or_die(name, chk, failures)
                    if chk["unique_misses"] != n * misses:
                        failures.append(f"{name}: built {n * misses} misses, resolver saw "
                                        f"{chk['unique_misses']}")

                    def call(sel=sel, st=st):
                        C.resolve_and_copy(resolve_fn, gather_fn, st, sel, req_slots)

                    t = C.time_gpu(call, setup=st.restore, reps=cfg["nm_reps"], graph=graph,
                                   spacer_us=100.0)
                    s = t.summary()
                    out.append(dict(batch=n, budget=budget, top_k=cfg["nm_topk"], path=mode,
                                    misses_per_request=misses, row_bytes=cfg["nm_row_bytes"],
                                    counters=chk["counters"], **s))
                    print(f"  {name}: median {s['median_ms'] * 1e3:.1f} us "
                          f"[p10 {s['p10_ms'] * 1e3:.1f}, p90 {s['p90_ms'] * 1e3:.1f}] ({s['mode']})")
                    if mode == "direct" and misses == 0:
                        loc_ref = C.resolve_and_copy(resolve_fn, gather_fn, st, sel, req_slots)[0]
                        st.restore()
                        if not torch.equal(direct_floor(st, sel, req_slots), loc_ref):
                            failures.append(f"{name}: the floor kernel's locations differ")
                        t = C.time_gpu(lambda sel=sel, st=st: direct_floor(st, sel, req_slots),
                                       reps=cfg["nm_reps"], graph=graph, spacer_us=100.0)
                        s = t.summary()
                        out.append(dict(batch=n, budget=budget, top_k=cfg["nm_topk"], path="floor",
                                        misses_per_request=0, row_bytes=cfg["nm_row_bytes"], **s))
                        print(f"  floor (sel -> page table -> loc) batch={n} B={budget}: median "
                              f"{s['median_ms'] * 1e3:.1f} us ({s['mode']})")
                del st
        del host
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


# ------------------------------------------------------------------- plot
def plot(meta, miss_points, fits, nm_points, name):
    fig, ax = C.new_figure(3, "Resolver cost (cf. paper Figure 8)", meta)
    a = ax[0]
    for fit in fits:
        ps = [p for p in miss_points if p["row_bytes"] == fit["row_bytes"]
              and p["top_k"] == fit["top_k"]]
        xs = [p["miss_bytes"] / 1e6 for p in ps]
        ys = [p["median_ms"] for p in ps]
        err = [[p["median_ms"] - p["min_ms"] for p in ps], [p["max_ms"] - p["median_ms"] for p in ps]]
        lab = f"{fit['row_bytes']} B, k={fit['top_k']}: {fit['fit_gbps']:.1f} GB/s (R2 {fit['r2']:.4f})"
        line = a.errorbar(xs, ys, yerr=err, fmt="o", ms=4, capsize=2, label=lab)
        xm = max(xs)
        a.plot([0, xm], [fit["intercept_ms"], fit["intercept_ms"] + fit["slope_ms_per_mb"] * xm],
               "--", color=line[0].get_color(), lw=1)
    if not fits:
        a.text(0.5, 0.5, "miss path: see bench_resolve_miss", ha="center", va="center",
               transform=a.transAxes)
    a.set_xlabel("unique host-miss payload (MB)")
    a.set_ylabel("resolve + gather (ms)")
    a.set_title("(a) miss path, batch 32, K=8, B=2k, cold")
    if fits:
        a.legend(fontsize=7)
    b = ax[1]
    for n in sorted({p["batch"] for p in nm_points}):
        for mode, ls in (("scan", "-"), ("direct", ":"), ("floor", "-.")):
            ps = sorted([p for p in nm_points if p["batch"] == n and p["path"] == mode
                         and p["misses_per_request"] == 0], key=lambda p: p["budget"])
            if ps:
                b.plot([p["budget"] for p in ps], [p["median_ms"] * 1e3 for p in ps], ls,
                       marker="o", label=f"batch {n} {mode}")
    b.set_xscale("log", base=2)
    b.set_xlabel("hot-cache rows B (k=512)")
    b.set_ylabel("median (us)")
    b.set_title("(b) no host miss: scan vs direct")
    if nm_points:
        b.legend(fontsize=7)
    else:
        b.text(0.5, 0.5, "no-miss path: see bench_resolve_nomiss", ha="center", va="center",
               transform=b.transAxes)
    c = ax[2]
    labels, vals0, vals1 = [], [], []
    budgets = sorted({p["budget"] for p in nm_points})
    mid = 4096 if 4096 in budgets else (budgets[len(budgets) // 2] if budgets else None)
    for n in sorted({p["batch"] for p in nm_points}):
        for mode in ("scan", "direct"):
            ps = {p["misses_per_request"]: p for p in nm_points
                  if p["batch"] == n and p["path"] == mode and p["budget"] == mid}
            if len(ps) == 2:
                labels.append(f"b{n}\n{mode}")
                m0, m1 = sorted(ps)
                vals0.append(ps[m0]["median_ms"] * 1e3)
                vals1.append(ps[m1]["median_ms"] * 1e3)
    xs = range(len(labels))
    c.bar([x - 0.2 for x in xs], vals0, 0.4, label="no miss")
    c.bar([x + 0.2 for x in xs], vals1, 0.4, label="with misses")
    c.set_xticks(list(xs), labels, fontsize=7)
    c.set_ylabel("median (us)")
    c.set_title(f"(c) B={mid}: with / without misses")
    if labels:
        c.legend(fontsize=7)
    else:
        c.set_title("(c) with / without misses")
        c.text(0.5, 0.5, "see bench_resolve_nomiss", ha="center", va="center", transform=c.transAxes)
    return C.save_figure(fig, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (CPU + TRITON_INTERPRET=1)")
    ap.add_argument("--impl", default="triton", choices=("triton", "torch", "reference"))
    ap.add_argument("--part", default="all", choices=("all", "miss", "nomiss"))
    ap.add_argument("--no-graph", action="store_true", help="time eager launches only")
    ap.add_argument("--name", default="bench_resolve", help="results file stem")
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG of a results file, no runs")
    ap.add_argument("--set", action="append", default=[], metavar="_NAME=INT",
                    help="override a launcher constant of our resolve module for this run "
                         "(recorded in the results file), e.g. --set _ONE_BLOCK_B=1024")
    args = ap.parse_args(argv)
    if args.replot:
        import json
        d = json.loads(Path(args.replot).read_text())
        plot(d["meta"], d["miss_path"], d["miss_fits"], d["nomiss_path"], Path(args.replot).stem)
        return 0
    if args.smoke and args.name == "bench_resolve":
        args.name = "bench_resolve_smoke"
    cfg = SMOKE if args.smoke else REAL
    dev = C.device()
    if dev.type == "cpu" and args.impl == "triton" and not C.interpreting():
        print("no CUDA: set TRITON_INTERPRET=1 (with --smoke) or use --impl reference")
        return 2
    resolve_fn, gather_fn = C.load_impl(args.impl)
    graph = not args.no_graph and args.impl == "triton" and dev.type == "cuda"
    overrides = C.apply_overrides(args.set)
    meta = C.metadata()
    print(f"# bench_resolve on {meta['device']} ({meta['date_utc']}), impl={args.impl}, "
          f"{'smoke' if args.smoke else 'full'} sizes")
    pinned = C.pinned_h2d_gbps(1 << 30 if not args.smoke else 1 << 20)
    print(f"pinned copy_ H2D: {pinned['median_gbps']:.1f} GB/s")
    failures: list = []
    miss_points, fits, nm_points = [], [], []
    if args.part in ("all", "miss"):
        print("## miss path")
        miss_points = run_miss_path(cfg, resolve_fn, gather_fn, dev, failures, graph)
        fits = summarize_miss(miss_points, pinned["median_gbps"])
        for f in fits:
            f["slope_ms_per_mb"] = (1e3 / (f["fit_gbps"] * 1e3)) if C.finite(f["fit_gbps"]) else 0.0
    if args.part in ("all", "nomiss"):
        print("## no-miss path")
        nm_points = run_nomiss_path(cfg, resolve_fn, gather_fn, dev, failures, graph)

    targets = []
    print("\n## summary")
    print(f"{'rows':>6} {'k':>5} {'fit GB/s':>9} {'R2':>7} {'/pinned':>8} {'disj/shared':>11}")
    for f in fits:
        r = f["ratio_to_pinned"]
        print(f"{f['row_bytes']:>6} {f['top_k']:>5} {f['fit_gbps']:>9.1f} {f['r2']:>7.4f} "
              f"{(r if r is not None else float('nan')):>8.3f} {f['disjoint_over_shared'] or 0:>11.2f}")
        if r is not None:
            targets.append((f"miss path {f['row_bytes']} B k={f['top_k']}: fit/pinned {r:.3f} "
                            f">= {f['target_ratio']}", r >= f["target_ratio"]))
        if f["disjoint_over_shared"] is not None:
            targets.append((f"miss path {f['row_bytes']} B k={f['top_k']}: 8 disjoint / 8 identical "
                            f"{f['disjoint_over_shared']:.2f}x <= 8.0x", f["disjoint_over_shared"] <= 8.0))
    by = {(p["batch"], p["budget"], p["path"], p["misses_per_request"]): p for p in nm_points}
    if nm_points:
        print(f"{'batch':>6} {'B':>6} {'direct us':>10} {'scan us':>9} {'d/s':>6} "
              f"{'+miss direct':>13} {'+miss scan':>11} {'floor us':>9}")
    m = cfg["nm_misses"]
    for n in cfg["nm_batches"]:
        for budget in cfg["nm_budgets"]:
            d0, s0 = by.get((n, budget, "direct", 0)), by.get((n, budget, "scan", 0))
            d1, s1 = by.get((n, budget, "direct", m)), by.get((n, budget, "scan", m))
            if not (d0 and s0 and d1 and s1):
                continue
            ratio = d0["median_ms"] / s0["median_ms"]
            fl = by.get((n, budget, "floor", 0))
            fl_us = fl["median_ms"] * 1e3 if fl else float("nan")
            print(f"{n:>6} {budget:>6} {d0['median_ms'] * 1e3:>10.1f} {s0['median_ms'] * 1e3:>9.1f} "
                  f"{ratio:>6.2f} {d1['median_ms'] * 1e3:>13.1f} {s1['median_ms'] * 1e3:>11.1f} "
                  f"{fl_us:>9.1f}")
            targets.append((f"no-miss batch {n} B={budget}: direct/scan {ratio:.2f} <= 0.5 "
                            f"(floor/scan {fl_us / (s0['median_ms'] * 1e3):.2f})", ratio <= 0.5))
    key_b = 4096 if not args.smoke else cfg["nm_budgets"][0]
    key_n = 8 if not args.smoke else cfg["nm_batches"][0]
    for mode in ("scan", "direct"):
        p = by.get((key_n, key_b, mode, 0))
        if p:
            targets.append((f"no-miss B={key_b} k={cfg['nm_topk']} batch {key_n} {mode}: "
                            f"{p['median_ms'] * 1e3:.1f} us < 18.7 us", p["median_ms"] * 1e3 < 18.7))

    payload = dict(meta=meta, impl=args.impl, kernel_overrides=overrides, smoke=args.smoke,
                   config=cfg, pinned_h2d=pinned,
                   miss_path=miss_points, miss_fits=fits, nomiss_path=nm_points,
                   targets=[dict(target=t, passed=ok) for t, ok in targets],
                   correctness_failures=failures)
    C.write_json(args.name, payload)
    if miss_points or nm_points:
        try:
            plot(meta, miss_points, fits, nm_points, args.name)
        except Exception as e:  # noqa: BLE001 - a plotting failure must not lose the numbers
            print(f"plot failed: {type(e).__name__}: {e}")
    print()
    for t, ok in targets:
        print(f"TARGET {'PASS' if ok else 'FAIL'}: {t}")
    if failures:
        print(f"CORRECTNESS FAILED in {len(failures)} configuration(s):")
        for f in failures:
            print(f"  {f}")
        return 1
    print("CORRECTNESS: all configurations match the reference")
    return 0


if __name__ == "__main__":
    sys.exit(main())
