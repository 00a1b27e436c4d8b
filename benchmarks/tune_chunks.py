"""Phase-3 chunk sizes on the large-B miss cells of bench_resolve (direct mode, 77 misses
per request, k = 512): each variant of the launcher constants is checked against the
reference, then timed (CUDA-graph replays), in one process.

    python3 benchmarks/tune_chunks.py OUT.json                                  # H200
    python3 benchmarks/tune_chunks.py OUT.json --variants '[{"_BLOCK_B": 4096}]' --budgets 8192
    TRITON_INTERPRET=1 python benchmarks/tune_chunks.py /tmp/t.json --smoke     # CPU, tiny

A variant that names ``_BLOCK_B`` runs only at the first batch (one wave), one that
names ``_MANY_BLOCK_B`` only at the second (more programs than SMs).
"""
import argparse
import importlib
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_resolve as BR  # noqa: E402
import common as C  # noqa: E402

R = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="results JSON")
    ap.add_argument("--variants", default='[{}, {"_BLOCK_B": 2048}, {"_MANY_BLOCK_B": 1024}]',
                    help="JSON list of {constant: value} overrides ({} = the module's values)")
    ap.add_argument("--budgets", type=int, nargs="+", help="hot slots B (default 4096 8192 16384)")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny shapes (bench_resolve's smoke cells), also what a CPU runs")
    args = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    real = cuda and not args.smoke
    cfg = BR.REAL if real else BR.SMOKE
    dev = torch.device("cuda" if cuda else "cpu")
    batches = (8, 160) if real else (2, 3)
    budgets = args.budgets or ((4096, 8192, 16384) if real else (32, 64))
    variants = json.loads(args.variants)
    rf, gf = C.load_impl("triton")
    out, failed = [], False
    for n in batches:
        host = C.pinned_rows(n * cfg["nm_rows"], cfg["nm_row_bytes"], seed=n)
        req_slots = torch.arange(n, dtype=torch.int32, device=dev)
        for budget in budgets:
            st, _, sel = BR._nomiss_state(cfg, host, n, budget, "direct", dev, seed=budget + n)
            for v in variants:
                if n == batches[0] and "_MANY_BLOCK_B" in v or n == batches[1] and "_BLOCK_B" in v:
                    continue
                saved = {k: getattr(R, k) for k in v}
                for k, x in v.items():
                    setattr(R, k, x)
                try:
                    chk = C.check_against_reference(st, sel, req_slots, rf, gf)
                    t = C.time_gpu(lambda: C.resolve_and_copy(rf, gf, st, sel, req_slots),
                                   setup=st.restore, reps=40 if cuda else 1, graph=cuda,
                                   spacer_us=100.0).summary()
                finally:
                    for k, x in saved.items():
                        setattr(R, k, x)
                failed |= not chk["ok"]
                row = dict(batch=n, budget=budget, variant=v, ok=chk["ok"],
                           misses=chk["unique_misses"], median_us=t["median_ms"] * 1e3,
                           p10_us=t["p10_ms"] * 1e3)
                out.append(row)
                print(row, flush=True)
            del st
    Path(args.out).write_text(json.dumps(dict(meta=C.metadata(), points=out), indent=1))
    print("CORRECTNESS: " + ("a variant differs from the reference" if failed
                             else "every variant matches the reference"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
