"""Zero-copy reads of scattered host rows, by the pages that back the pinned pool.

    python3 benchmarks/bench_host_reads.py                # H200
    python benchmarks/bench_host_reads.py --smoke         # CPU: allocation and checks only

The resolver's host misses are single rows (584 B at DeepSeek-V4 shapes) that a
kernel reads from pinned host memory through its unified address.  Spread over
tens of GiB such reads ran at a third of the rate of the same reads inside one
request's extent (shared/notes/environment.md); address translation is the likely
cause, and the pages backing the pool decide how many translations there are.

For each kind of host memory:

* ``registered_4k``: an anonymous mapping registered with ``cudaHostRegister``
  (``pinned.host_buffer`` with ``huge_pages=False``, the host store's default);
* ``registered_huge``: the same mapping aligned to 2 MiB and advised for
  transparent huge pages (``huge_pages=True``);
* ``cuda_host_alloc``: torch's pinned allocator (``cudaHostAlloc``);

a pool of ``--pool-gib`` GiB of rows is cut into ``--requests`` equal extents, as the
host store lays requests out, and batch row i of a gather reads ``rows`` random rows
of extent ``i * requests // batch`` (sorted by host address, as the resolver's misses
are).  ``AnonHugePages`` of /proc/meminfo before and after each allocation says
whether the kernel backed it with huge pages.  Checked: every gathered byte against
the host rows.  Timed: one ``gather_rows`` launch per call (CUDA events, median of
``--reps``), useful bytes per second.  Results: ``results/bench_host_reads.{json,png}``.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

from vllm_dhisparse.hierarchy import pinned  # noqa: E402
from vllm_dhisparse.triton_kernels.gather import gather_rows  # noqa: E402

KINDS = ("registered_4k", "registered_huge", "cuda_host_alloc")


def anon_huge_bytes() -> int | None:
    return pinned.meminfo_bytes("AnonHugePages")


def allocate(kind: str, nbytes: int, pin: bool) -> torch.Tensor:
    if kind == "cuda_host_alloc":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    return pinned.host_buffer(nbytes, pin, huge_pages=kind == "registered_huge")


def fill(rows: torch.Tensor, dev: torch.device, seed: int) -> None:
    """Random bytes, drawn on the device in chunks when there is one."""
    g = torch.Generator(device=dev).manual_seed(seed)
    chunk = max(1, (256 << 20) // rows.shape[1])
    for a in range(0, rows.shape[0], chunk):
        b = min(rows.shape[0], a + chunk)
        rows[a:b].copy_(torch.randint(0, 256, (b - a, rows.shape[1]), dtype=torch.uint8,
                                      device=dev, generator=g))
    if dev.type == "cuda":
        torch.cuda.synchronize()


def misses(n_rows: int, requests: int, batch: int, rows: int, seed: int) -> torch.Tensor:
    """[batch, rows] int64 host rows: row i reads ``rows`` random rows of its request's
    extent, ascending."""
    extent = n_rows // requests
    g = torch.Generator().manual_seed(seed)
    first = (torch.arange(batch, dtype=torch.int64) * requests // batch) * extent
    pick = torch.stack([torch.randperm(extent, generator=g)[:rows] for _ in range(batch)])
    return (first[:, None] + pick.sort(dim=1).values).contiguous()


def run_kind(kind: str, cfg: dict, dev: torch.device) -> dict:
    pin = dev.type == "cuda"
    huge_before = anon_huge_bytes()
    buf = allocate(kind, cfg["pool_bytes"], pin)
    host = buf[: (buf.numel() // cfg["row_bytes"]) * cfg["row_bytes"]].view(-1, cfg["row_bytes"])
    fill(host, dev, seed=7)
    huge_after = anon_huge_bytes()
    out = dict(kind=kind, pinned=bool(pin and host.is_pinned()),
               anon_huge_pages_gib=None if huge_after is None or huge_before is None
               else round((huge_after - huge_before) / 2**30, 2), cells=[], errors=[])
    for batch in cfg["batches"]:
        for rows in cfg["rows"]:
            src = misses(host.shape[0], cfg["requests"], batch, rows, seed=batch * 1000 + rows)
            want = host[src.reshape(-1)]
            dst_rows = torch.zeros(batch * rows, cfg["row_bytes"], dtype=torch.uint8, device=dev)
            src_d = src.to(dev)
            dst_d = torch.arange(batch * rows, dtype=torch.int32, device=dev).view(batch, rows)
            count = torch.full((batch,), rows, dtype=torch.int32, device=dev)
            if dev.type == "cuda":
                gather_rows(host, dst_rows, src_d, dst_d, count)
                if not torch.equal(dst_rows.cpu(), want):
                    out["errors"].append(f"batch {batch} rows {rows}: gathered bytes differ")
                t = C.time_gpu(lambda: gather_rows(host, dst_rows, src_d, dst_d, count),
                               reps=cfg["reps"])
                ms = t.median
                gbps = batch * rows * cfg["row_bytes"] / (ms * 1e-3) / 1e9
            else:
                dst_rows[dst_d.reshape(-1).long()] = host[src_d.reshape(-1)]
                if not torch.equal(dst_rows, want):
                    out["errors"].append(f"batch {batch} rows {rows}: gathered bytes differ")
                ms = gbps = None
            out["cells"].append(dict(batch=batch, rows=rows, median_ms=ms, gbps=gbps))
            print(f"  {kind:>16} batch {batch:4d} x {rows:5d} rows: "
                  + (f"{ms * 1e3:8.1f} us, {gbps:6.1f} GB/s" if ms else "checked"), flush=True)
    del host, buf
    gc.collect()
    if kind == "cuda_host_alloc" and hasattr(torch._C, "_host_emptyCache"):
        torch._C._host_emptyCache()  # torch caches pinned blocks: give the memory back
    return out


def plot(result: dict, meta: dict, name: str) -> None:
    fig, axes = C.new_figure(1, "Zero-copy gather of scattered host rows, by host pages", meta)
    ax = axes[0]
    cells = [(c["batch"], c["rows"]) for c in result["kinds"][0]["cells"]]
    width = 0.8 / len(result["kinds"])
    for j, k in enumerate(result["kinds"]):
        ax.bar([i + j * width for i in range(len(cells))], [c["gbps"] or 0 for c in k["cells"]],
               width, label=f"{k['kind']} (AnonHugePages +{k['anon_huge_pages_gib']} GiB)")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cells))])
    ax.set_xticklabels([f"{b}x{r}" for b, r in cells], fontsize=7)
    ax.set_xlabel("batch rows x rows read per batch row")
    ax.set_ylabel("GB/s (useful bytes)")
    ax.legend(fontsize=7)
    C.save_figure(fig, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="small pool, no timing (CPU)")
    ap.add_argument("--pool-gib", type=float, default=32.0, help="host pool size per kind")
    ap.add_argument("--requests", type=int, default=1024, help="extents the pool is cut into")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32, 128, 512])
    ap.add_argument("--rows", type=int, nargs="+", default=[32, 512],
                    help="rows each batch row reads")
    ap.add_argument("--row-bytes", type=int, default=584)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--name", default=None, help="results file stem")
    args = ap.parse_args(argv)
    dev = C.device()
    if args.smoke:
        args.pool_gib, args.requests, args.batches, args.rows = 0.01, 8, [2, 4], [3]
    cfg = dict(pool_bytes=int(args.pool_gib * 2**30), requests=args.requests,
               batches=args.batches, rows=args.rows, row_bytes=args.row_bytes, reps=args.reps)
    pinned.check_host_memory(cfg["pool_bytes"], "bench_host_reads pool (--pool-gib)")
    meta = C.metadata()
    print(f"# bench_host_reads on {meta['device']}: {args.pool_gib} GiB pool, "
          f"{args.requests} extents, THP {_thp()}")
    result = dict(meta=meta, config=cfg, transparent_hugepage=_thp(),
                  kinds=[run_kind(k, cfg, dev) for k in args.kinds])
    name = args.name or ("bench_host_reads_smoke" if args.smoke else "bench_host_reads")
    C.write_json(name, result)
    if dev.type == "cuda":
        plot(result, meta, name)
    errors = [e for k in result["kinds"] for e in k["errors"]]
    for e in errors:
        print("ERROR", e)
    return 1 if errors else 0


def _thp() -> str | None:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().strip()
    except OSError:
        return None


if __name__ == "__main__":
    sys.exit(main())
