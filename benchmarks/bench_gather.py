"""Host -> device row gather: Triton kernel vs torch reference vs pinned memcpy.

For rows of 584 / 656 / 2432 B, batch 8 / 32 / 160 and 512 / 2048 distinct
misses per request (random rows of each request's contiguous host region,
ascending as the resolver emits them, to random distinct device rows):

* ``triton``: ``vllm_dhisparse.triton_kernels.gather.gather_rows`` (zero-copy reads of pinned
  host memory), timed with CUDA events (graph replay where capture works);
* ``torch``: ``vllm_dhisparse.triton_kernels.reference.gather_reference`` (CPU index_select
  of the pinned pool, then ``copy_`` to the device and a device scatter),
  timed with the wall clock;
* ``memcpy``: one pinned ``copy_`` of the same number of bytes, contiguous:
  the bandwidth ceiling a gather can approach.

The gather is idempotent, so no state restore is needed; the L2 is flushed
before every iteration.  Writes benchmarks/results/bench_gather.{json,png}.

    python benchmarks/bench_gather.py
    TRITON_INTERPRET=1 python benchmarks/bench_gather.py --smoke
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

REAL = dict(row_bytes=(584, 656, 2432), batches=(8, 32, 160), misses=(512, 2048),
            rows_per_request=16384, reps=20, torch_reps=3, torch_max_bytes=1 << 30)
SMOKE = dict(row_bytes=(24, 40), batches=(2, 3), misses=(8, 16),
             rows_per_request=64, reps=2, torch_reps=1, torch_max_bytes=1 << 30)


def make_plan(n: int, m: int, rows: int, dev, seed: int):
    g = torch.Generator().manual_seed(seed)
    src = torch.stack([torch.randperm(rows, generator=g)[:m].sort().values + r * rows
                       for r in range(n)])
    dst = torch.randperm(n * m, generator=g).view(n, m)
    cnt = torch.full((n,), m, dtype=torch.int32)
    return src.to(dev), dst.to(torch.int32).to(dev), cnt.to(dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-torch", action="store_true", help="skip the (slow) torch reference")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(argv)
    cfg = SMOKE if args.smoke else REAL
    name = args.name or ("bench_gather_smoke" if args.smoke else "bench_gather")
    dev = C.device()
    if dev.type == "cpu" and not C.interpreting():
        print("no CUDA: run with TRITON_INTERPRET=1 --smoke")
        return 2
    from vllm_dhisparse.triton_kernels.gather import gather_rows
    from vllm_dhisparse.triton_kernels.reference import gather_reference
    meta = C.metadata()
    print(f"# bench_gather on {meta['device']} ({meta['date_utc']})")
    pinned = C.pinned_h2d_gbps(1 << 30 if not args.smoke else 1 << 20)
    print(f"pinned copy_ H2D (1 GiB): {pinned['median_gbps']:.1f} GB/s")
    points, failures = [], []
    graph = dev.type == "cuda"
    nmax, rows = max(cfg["batches"]), cfg["rows_per_request"]
    for row_bytes in cfg["row_bytes"]:
        host = C.pinned_rows(nmax * rows, row_bytes, seed=row_bytes)
        for n in cfg["batches"]:
            for m in cfg["misses"]:
                src, dst, cnt = make_plan(n, m, rows, dev, seed=n * 7 + m)
                dev_rows = torch.empty((n * m, row_bytes), dtype=torch.uint8, device=dev)
                nbytes = n * m * row_bytes
                # correctness, once: poisoned output, every destination written
                dev_rows.fill_(0xA5)
                gather_rows(host, dev_rows, src, dst, cnt)
                want = host.index_select(0, src.reshape(-1).cpu())
                got = dev_rows[dst.reshape(-1).long()].cpu()
                ok = torch.equal(want, got)
                if not ok:
                    failures.append(f"row={row_bytes} batch={n} misses={m}")
                res = dict(row_bytes=row_bytes, batch=n, misses_per_request=m, bytes=nbytes,
                           correct=ok)
                t = C.time_gpu(lambda: gather_rows(host, dev_rows, src, dst, cnt),
                               reps=cfg["reps"], graph=graph)
                res["triton"] = t.summary()
                flat = host.view(-1)[:nbytes]
                buf = torch.empty(nbytes, dtype=torch.uint8, device=dev)
                if dev.type == "cuda":
                    t = C.time_gpu(lambda: buf.copy_(flat, non_blocking=True), reps=cfg["reps"])
                    res["memcpy"] = t.summary()
                if not args.no_torch and nbytes <= cfg["torch_max_bytes"]:
                    t = C.time_host(lambda: gather_reference(host, dev_rows, src, dst, cnt),
                                    reps=cfg["torch_reps"], warmup=1)
                    res["torch"] = t.summary()
                for k in ("triton", "memcpy", "torch"):
                    if k in res:
                        res[k]["gbps"] = nbytes / (res[k]["median_ms"] * 1e-3) / 1e9
                if "memcpy" in res:
                    res["triton_over_memcpy"] = res["triton"]["gbps"] / res["memcpy"]["gbps"]
                points.append(res)
                line = " ".join(f"{k} {res[k]['gbps']:6.1f} GB/s" for k in ("triton", "memcpy", "torch")
                                if k in res)
                print(f"  row={row_bytes:>5} batch={n:>4} misses={m:>5} "
                      f"{C.fmt_bytes(nbytes):>9}: {line} {'ok' if ok else 'MISMATCH'}")
                del dev_rows, buf
        del host
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    C.write_json(name, dict(meta=meta, config=cfg, pinned_h2d=pinned, points=points,
                            correctness_failures=failures))
    try:
        fig, ax = C.new_figure(len(cfg["row_bytes"]), "Row gather: Triton vs torch vs pinned memcpy", meta)
        for a, row_bytes in zip(ax, cfg["row_bytes"]):
            for m, ls in zip(cfg["misses"], ("-", "--")):
                ps = [p for p in points if p["row_bytes"] == row_bytes and p["misses_per_request"] == m]
                for k, mk in (("triton", "o"), ("memcpy", "s"), ("torch", "^")):
                    xs = [p["batch"] for p in ps if k in p]
                    if xs:
                        a.plot(xs, [p[k]["gbps"] for p in ps if k in p], ls, marker=mk,
                               label=f"{k}, {m}/req")
            a.axhline(pinned["median_gbps"], color="gray", lw=0.8, ls=":", label="pinned copy_ 1 GiB")
            a.set_xscale("log")
            a.set_xlabel("batch (requests)")
            a.set_ylabel("GB/s")
            a.set_title(f"rows of {row_bytes} B")
            a.legend(fontsize=6)
        C.save_figure(fig, name)
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {type(e).__name__}: {e}")

    print(f"\n{'row':>5} {'batch':>5} {'miss':>5} {'triton':>8} {'memcpy':>8} {'torch':>8} {'tri/memcpy':>10}")
    for p in points:
        g = lambda k: f"{p[k]['gbps']:8.1f}" if k in p else f"{'-':>8}"  # noqa: E731
        r = p.get("triton_over_memcpy")
        print(f"{p['row_bytes']:>5} {p['batch']:>5} {p['misses_per_request']:>5} {g('triton')} "
              f"{g('memcpy')} {g('torch')} {r if r is not None else float('nan'):>10.3f}")
    if failures:
        print(f"CORRECTNESS FAILED: {failures}")
        return 1
    print("CORRECTNESS: every gather matched the host rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
