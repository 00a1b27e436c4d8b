"""One SGLang cell of the resolver, launched eagerly a few times: a target for ncu.

    ncu --clock-control none --kernel-name regex:_resolve_kernel --launch-skip 2 \\
        --launch-count 1 --section SpeedOfLight --section Occupancy \\
        --section WarpStateStats python3 benchmarks/profile_resolve.py --batch 160 --miss 0

Builds the same case as bench_sglang.py (k=2048, B=4096, 656 B rows), checks it
against the reference once, then calls the production resolve (fused copy)
``--calls`` times, restoring the tables before each call.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import bench_sglang as BS  # noqa: E402
import common as C  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=160)
    ap.add_argument("--miss", type=float, default=0.0, help="miss fraction, e.g. 0.3")
    ap.add_argument("--calls", type=int, default=4)
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    cfg = BS.SMOKE if args.smoke else BS.REAL
    dev = C.device()
    resolve_fn, gather_fn = C.load_impl("triton")
    host = C.pinned_rows(args.batch * cfg["rows"], cfg["row_bytes"], seed=5)
    st, sel, _, n_miss = BS.build_case(args.batch, cfg, args.miss, host, dev, seed=7)
    req_slots = torch.arange(args.batch, dtype=torch.int32, device=dev)
    chk = C.check_against_reference(st, sel, req_slots, resolve_fn, gather_fn)
    print(f"batch {args.batch} miss {args.miss:.0%}: check {chk['message']}")
    if not chk["ok"]:
        return 1
    for _ in range(args.calls):
        st.restore()
        C.flush_l2()
        C.resolve_and_copy(resolve_fn, gather_fn, st, sel, req_slots)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
