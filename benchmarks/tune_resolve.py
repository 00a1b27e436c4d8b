"""Checks and times resolver variants in one device call (issue: resolver vs SGLang).

Variants are launcher settings of ``vllm_dhisparse.triton_kernels.resolve``
(module constants).  Cases: the nine SGLang cells (k=2048, B=4096, 656 B, 32K history,
batch 8/32/160 x 0/5/30 % misses; timed eagerly like bench_sglang.py) and the
no-miss cells of bench_resolve.py (k=512, 584 B; CUDA-graph timed).  Every new
variant is checked against the reference on every case before it is timed.

    python3 benchmarks/tune_resolve.py [--quick]
    TRITON_INTERPRET=1 python3 benchmarks/tune_resolve.py --smoke
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_resolve as BR  # noqa: E402
import bench_sglang as BS  # noqa: E402
import common as C  # noqa: E402

R = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
from vllm_dhisparse.triton_kernels import gather_rows  # noqa: E402

DEFAULTS = dict(_BLOCK_W=2048, _BLOCK_B=1024, _ONE_BLOCK_B=4096, _NUM_WARPS=16,
                _MANY_BLOCK_W=1024, _MANY_BLOCK_B=512, _FUSE_MAX_WIDTH=2048, _COPY_ELEMS=4096,
                _SORT_MID=1024, copy=True)
VARIANTS = {  # v3 = the module's defaults; the others each change one setting
    "v3": dict(),
    "w8": dict(_NUM_WARPS=8),
    "nomid": dict(_SORT_MID=0),
    "copy2k": dict(_COPY_ELEMS=2048),
    "copy8k": dict(_COPY_ELEMS=8192),
    "copy16k": dict(_COPY_ELEMS=16384),
}


def use(variant: str):
    cfg = dict(DEFAULTS, **VARIANTS[variant])
    for k, v in cfg.items():
        if k.startswith("_"):
            setattr(R, k, v)
    if not cfg["copy"]:
        return R.resolve, gather_rows

    def fused(*args, **_):  # resolve copies (fused when K*k <= _FUSE_MAX_WIDTH)
        return R.resolve(*args, host_rows=use.st.host_rows, device_rows=use.st.device_rows)
    return fused, (lambda *a: None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--no-nomiss", action="store_true")
    ap.add_argument("--graph-only", action="store_true")
    ap.add_argument("--batches", default="", help="SGLang-cell batches to run (default: all)")
    args = ap.parse_args()
    dev = C.device()
    variants = args.variants.split(",")
    if args.smoke:
        for v in [DEFAULTS] + list(VARIANTS.values()):
            v.update(_BLOCK_W=min(v.get("_BLOCK_W", 2048), 8), _BLOCK_B=4,
                     _ONE_BLOCK_B=min(v.get("_ONE_BLOCK_B", 4096), 32))
    scfg = dict(BS.SMOKE if args.smoke else BS.REAL)
    if args.batches:
        scfg["batches"] = tuple(int(b) for b in args.batches.split(","))
    ncfg = BR.SMOKE if args.smoke else BR.REAL
    rows, failures = [], []

    def record(case, variant, t, extra=None):
        s = t.summary()
        rows.append(dict(case=case, variant=variant, **s, **(extra or {})))
        print(f"  {case:<34} {variant:<14} {s['median_ms'] * 1e3:8.1f} us "
              f"[p10 {s['p10_ms'] * 1e3:.1f} p90 {s['p90_ms'] * 1e3:.1f}] {s['mode']}", flush=True)

    def checked_call(case, name, st, sel, req_slots, ref_cache, want_misses=None):
        """The variant's resolve + copy as a closure, or None when it differs from the
        reference (recorded as a failure, never timed)."""
        fn, gfn = use(name)
        chk = C.check_against_reference(st, sel, req_slots, fn, gfn, ref_cache=ref_cache)
        if not chk["ok"] or (want_misses is not None and chk["unique_misses"] != want_misses):
            failures.append(f"{case} {name}: {chk['message']}")
            print(f"  CHECK FAILED {case} {name}: {chk['message']}", flush=True)
            return None
        return lambda: C.resolve_and_copy(fn, gfn, st, sel, req_slots)

    # ---- SGLang cells (eager, like bench_sglang.py)
    host = C.pinned_rows(max(scfg["batches"]) * scfg["rows"], scfg["row_bytes"], seed=5)
    for n in scfg["batches"]:
        req_slots = torch.arange(n, dtype=torch.int32, device=dev)
        for frac in scfg["miss_fracs"]:
            st, sel, _, n_miss = BS.build_case(n, scfg, frac, host, dev, seed=n * 100 + int(frac * 100))
            case = f"sglang b={n} miss={frac:.0%}"
            use.st = st
            ref_cache = {}
            for name in variants:
                call = checked_call(case, name, st, sel, req_slots, ref_cache, n * n_miss)
                if call is None:
                    continue
                if not args.graph_only:
                    record(case, name, C.time_gpu(call, setup=st.restore, reps=scfg["reps"],
                                                  spacer_us=1000.0))
                record(case, name + "_graph", C.time_gpu(call, setup=st.restore, reps=scfg["reps"],
                                                         spacer_us=100.0, graph=True))
            del st
    del host
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    # ---- no-miss cells (CUDA graph, like bench_resolve.py)
    nm_cases = [(2, 32), (3, 64)] if args.smoke else [(8, 4096), (160, 8192)]
    if args.no_nomiss:
        nm_cases = []
    for n, budget in nm_cases:
        host = C.pinned_rows(n * ncfg["nm_rows"], ncfg["nm_row_bytes"], seed=n)
        req_slots = torch.arange(n, dtype=torch.int32, device=dev)
        for mode in ("direct", "scan"):
            st, sel0, sel1 = BR._nomiss_state(ncfg, host, n, budget, mode, dev, seed=budget + n)
            for misses, sel in ((0, sel0), (ncfg["nm_misses"], sel1)):
                if misses and n != 8:
                    continue
                case = f"nomiss b={n} B={budget} {mode} m={misses}"
                use.st = st
                ref_cache = {}
                for name in variants:
                    call = checked_call(case, name, st, sel, req_slots, ref_cache)
                    if call is None:
                        continue
                    record(case, name, C.time_gpu(call, setup=st.restore, reps=ncfg["nm_reps"],
                                                  graph=True, spacer_us=100.0))
            del st
        del host

    out = Path(args.out) / "tune_resolve.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=C.metadata(), variants=VARIANTS, rows=rows,
                                   failures=failures), indent=1))
    # compact table: case x variant medians
    names = list(dict.fromkeys(r["variant"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    print("\n" + f"{'case':<34}" + "".join(f"{v[:12]:>13}" for v in names))
    for c in cases:
        med = {r["variant"]: r["median_ms"] * 1e3 for r in rows if r["case"] == c}
        print(f"{c:<34}" + "".join(f"{med[v]:>13.1f}" if v in med else f"{'-':>13}" for v in names))
    try:  # registers / spills of every compiled resolve kernel (occupancy)
        for dc in R._resolve_kernel.device_caches.values():
            for key, k in dc[0].items():
                cs = {n: v for n, v in getattr(k.src, "constants", {}).items()} if hasattr(k, "src") else {}
                print(f"regs {k.n_regs:4d} spills {k.n_spills:4d} warps {k.metadata.num_warps} "
                      f"{ {str(a): b for a, b in cs.items() if not str(a).isdigit()} }")
    except Exception as e:  # noqa: BLE001
        print(f"regs: {type(e).__name__}: {e}")
    print("FAILURES: " + ("; ".join(failures) if failures else "none"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
