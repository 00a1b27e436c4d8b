"""Checks and times resolver variants in one device call (issue: resolver vs SGLang).

Variants are launcher settings of ``vllm_dhisparse.triton_kernels.resolve``
(module constants) plus ``v0``, the sort-based kernel kept in
``benchmarks/versions/resolve_v0.py`` (timed only: its miss order is the old
spec's).  Cases: the nine SGLang cells (k=2048, B=4096, 656 B, 32K history,
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

VARIANTS = {
    "v1": dict(_BLOCK_W=2048, _BLOCK_B=1024, _ONE_BLOCK_B=4096, _NUM_WARPS=8),
}

def use(variant: str):
    for k, v in VARIANTS[variant].items():
        setattr(R, k, v)
    return R.resolve


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = ap.parse_args()
    dev = C.device()
    variants = args.variants.split(",")
    old = None
    if not args.smoke:
        old = importlib.import_module("versions.resolve_v0").resolve
    if args.smoke:
        for v in VARIANTS.values():
            v.update(_BLOCK_W=min(v["_BLOCK_W"], 8), _BLOCK_B=4, _ONE_BLOCK_B=min(v["_ONE_BLOCK_B"], 32))
    scfg = BS.SMOKE if args.smoke else BS.REAL
    ncfg = BR.SMOKE if args.smoke else BR.REAL
    rows, failures = [], []

    def record(case, variant, t, extra=None):
        s = t.summary()
        rows.append(dict(case=case, variant=variant, **s, **(extra or {})))
        print(f"  {case:<34} {variant:<14} {s['median_ms'] * 1e3:8.1f} us "
              f"[p10 {s['p10_ms'] * 1e3:.1f} p90 {s['p90_ms'] * 1e3:.1f}] {s['mode']}", flush=True)

    # ---- SGLang cells (eager, like bench_sglang.py)
    host = C.pinned_rows(max(scfg["batches"]) * scfg["rows"], scfg["row_bytes"], seed=5)
    for n in scfg["batches"]:
        slot_ids = torch.arange(n, dtype=torch.int32, device=dev)
        for frac in scfg["miss_fracs"]:
            st, sel, _, n_miss = BS.build_case(n, scfg, frac, host, dev, seed=n * 100 + int(frac * 100))
            case = f"sglang b={n} miss={frac:.0%}"
            for name in variants + (["v0"] if old else []):
                fn = old if name == "v0" else use(name)
                if name != "v0":
                    chk = C.check_against_reference(st, sel, slot_ids, fn, gather_rows)
                    if not chk["ok"] or chk["unique_misses"] != n * n_miss:
                        failures.append(f"{case} {name}: {chk['message']}")
                        print(f"  CHECK FAILED {case} {name}: {chk['message']}", flush=True)
                        continue

                def call(fn=fn, st=st, sel=sel, slot_ids=slot_ids):
                    loc, src, dst, cnt, _ = fn(*st.resolve_args(sel, slot_ids))
                    gather_rows(st.host_rows, st.device_rows, src, dst, cnt)

                record(case, name, C.time_gpu(call, setup=st.restore, reps=scfg["reps"],
                                              spacer_us=1000.0))
                record(case, name + "_graph", C.time_gpu(call, setup=st.restore, reps=scfg["reps"],
                                                         spacer_us=100.0, graph=True))
                if name == variants[0]:
                    def call_r(fn=fn, st=st, sel=sel, slot_ids=slot_ids):
                        fn(*st.resolve_args(sel, slot_ids))
                    record(case, name + "_resolve_graph",
                           C.time_gpu(call_r, setup=st.restore, reps=scfg["reps"], spacer_us=100.0,
                                      graph=True))
            del st
    del host
    torch.cuda.empty_cache() if torch.cuda.is_available() else None

    # ---- no-miss cells (CUDA graph, like bench_resolve.py)
    nm_cases = [(2, 32), (3, 64)] if args.smoke else [(8, 4096), (160, 8192)]
    for n, budget in nm_cases:
        host = C.pinned_rows(n * ncfg["nm_rows"], ncfg["nm_row_bytes"], seed=n)
        slot_ids = torch.arange(n, dtype=torch.int32, device=dev)
        for mode in ("direct", "scan"):
            st, sel0, sel1 = BR._nomiss_state(ncfg, host, n, budget, mode, dev, seed=budget + n)
            for misses, sel in ((0, sel0), (ncfg["nm_misses"], sel1)):
                if misses and n != 8:
                    continue
                case = f"nomiss b={n} B={budget} {mode} m={misses}"
                for name in variants + (["v0"] if old else []):
                    fn = old if name == "v0" else use(name)
                    if name != "v0":
                        chk = C.check_against_reference(st, sel, slot_ids, fn, gather_rows)
                        if not chk["ok"]:
                            failures.append(f"{case} {name}: {chk['message']}")
                            print(f"  CHECK FAILED {case} {name}: {chk['message']}", flush=True)
                            continue

                    def call(fn=fn, st=st, sel=sel, slot_ids=slot_ids):
                        loc, src, dst, cnt, _ = fn(*st.resolve_args(sel, slot_ids))
                        gather_rows(st.host_rows, st.device_rows, src, dst, cnt)

                    record(case, name, C.time_gpu(call, setup=st.restore, reps=ncfg["nm_reps"],
                                                  graph=True, spacer_us=100.0))
            del st
        del host

    out = Path(args.out) / "tune_resolve.json"
    out.write_text(json.dumps(dict(meta=C.metadata(), variants=VARIANTS, rows=rows,
                                   failures=failures), indent=1))
    # compact table: case x variant medians
    names = [x for v in variants + ["v0"] for x in (v, v + "_graph")] + [variants[0] + "_resolve_graph"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    print("\n" + f"{'case':<34}" + "".join(f"{v[:12]:>13}" for v in names))
    for c in cases:
        med = {r["variant"]: r["median_ms"] * 1e3 for r in rows if r["case"] == c}
        print(f"{c:<34}" + "".join(f"{med[v]:>13.1f}" if v in med else f"{'-':>13}" for v in names))
    print("FAILURES: " + ("; ".join(failures) if failures else "none"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
