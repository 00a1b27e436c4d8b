"""Side by side with SGLang 0.5.23's HiSparse swap-in kernel, identical inputs.

SGLang's entry point (PyPI ``sglang==0.5.23``, imported as a library, never
copied): ``sglang.kernels.ops.kvcache.hisparse.load_cache_to_device_buffer_mla``

    load_cache_to_device_buffer_mla(
        top_k_tokens,          # [bs, k]  int32  request-local token positions (one query)
        device_buffer_tokens,  # [pool, B+1] int32 token held by each hot slot, -1 empty;
                               #   column B = "newest slot" (holds token seq_len-1, not in LRU)
        host_cache_locs,       # [pool, max_seq] int64 host row of every token of the request
        device_buffer_locs,    # [pool, B+1] int32 device row of every hot slot
        host_cache,            # [R_host, item] pinned CPU tensor (read zero-copy by the kernel)
        device_buffer,         # [R_dev, item] CUDA tensor (updated: missed rows copied in)
        top_k_device_locs,     # [bs, k]  int32  OUTPUT device row per selection
        req_pool_indices,      # [bs] int32/int64 pool row of each batch row
        seq_lens,              # [bs] int32/int64; seq_len <= B takes a no-scan fast path
        lru_slots,             # [pool, B] int16 hot slots, least recent first (updated)
        item_size_bytes, num_top_k, hot_buffer_size,
        page_size=1, block_size=256, num_real_reqs=None,  # [1] int32 (CUDA-graph padding)
        miss_src=None, miss_dst=None, miss_count=None,    # optional miss-plan outputs
        skip_io=False)

It JIT-compiles ``kvcacheio/hisparse.cuh`` through ``apache-tvm-ffi`` with the
machine's nvcc (one CTA of ``block_size`` threads per request).  SGLang's
server calls it from ``srt/managers/hisparse_coordinator.py`` with
``block_size = swap_in_block_size``, default 960 (``srt/mem_cache/sparsity/
factory.py``), ``page_size=1``; we use the same (``--sglang-block-size``).  Semantics
match ours for a single query: hits are protected, the i-th miss takes the
i-th least-recent unselected slot, misses are copied from pinned host memory.
Differences: no direct map (we leave ours empty here), misses in top-k order
(ours ascending by position), and the newest token is a hit on slot B (we
never select it here).

Identical inputs: batch N, k = 2048, B = 4096, rows of 656 B, history of
``rows`` rows per request (> B, so SGLang takes its scan path); per request
the hot cache holds B random rows, and each selection takes (1 - x) k of them
plus x k non-hot rows, x in {0, 5, 30}%.  Both kernels start every iteration
from the same restored state (see common.py); both are timed eagerly with
CUDA events behind a GPU spacer (SGLang's wrapper allocates per call).

Import (``--import-mode``, default ``light``): ``import sglang...hisparse``
as is would run sglang/__init__.py, which pulls the whole serving stack
(transformers patches, orjson, starlette, ...).  The *light* import instead
registers empty parent packages
(``sglang``, ``sglang.kernels``, ``sglang.kernels.ops``,
``sglang.kernels.ops.kvcache``, ``sglang.srt.utils``) pointing at the
installed package directories, and a two-function stand-in for
``sglang.srt.utils.common`` (``is_cuda``, ``get_cuda_version``: the only names
the JIT helpers import from it).  The kernel module itself and its JIT loader
are SGLang's own, unmodified.  ``--import-mode full`` tries the ordinary import,
``auto`` tries light then full.  The JSON records which import worked and
why any other failed.

    python benchmarks/bench_sglang.py                 # needs sglang + tvm-ffi + msgspec
    TRITON_INTERPRET=1 python benchmarks/bench_sglang.py --smoke   # CPU: our side only
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
import time
import traceback
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

REAL = dict(batches=(8, 32, 160), miss_fracs=(0.0, 0.05, 0.30), top_k=2048, budget=4096,
            row_bytes=656, rows=32768, reps=30, sglang_block_size=960)
SMOKE = dict(batches=(2, 3), miss_fracs=(0.0, 0.25), top_k=16, budget=32, row_bytes=40,
             rows=256, reps=2, sglang_block_size=960)
ENTRY = "sglang.kernels.ops.kvcache.hisparse"
# GPU busy-wait before each timed call, so that both sides' host-side work (our
# Python launchers and argument checks, SGLang's tvm-ffi wrapper and its per-call
# allocations, plus the state restore and L2 flush) is enqueued before the GPU
# reaches the start event: the events then time GPU work only.  200 us was too
# short for our two Python launchers (2026-11-30: resolve alone read ~44 us eager
# vs ~10-20 us replayed from a CUDA graph), so small cells timed host overhead.
SPACER_US = 1000.0


def _light_import():
    spec = importlib.util.find_spec("sglang")  # does not execute sglang/__init__.py
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("package 'sglang' is not installed (find_spec returned None)")
    root = Path(list(spec.submodule_search_locations)[0])

    def pkg(name: str, path: Path):
        if name in sys.modules:
            return sys.modules[name]
        m = types.ModuleType(name)
        m.__path__ = [str(path)]
        m.__package__ = name
        sys.modules[name] = m
        return m

    pkg("sglang", root)
    pkg("sglang.srt", root / "srt")
    pkg("sglang.srt.utils", root / "srt" / "utils")
    pkg("sglang.kernels", root / "kernels")
    pkg("sglang.kernels.ops", root / "kernels" / "ops")
    pkg("sglang.kernels.ops.kvcache", root / "kernels" / "ops" / "kvcache")
    if "sglang.srt.utils.common" not in sys.modules:
        common = types.ModuleType("sglang.srt.utils.common")
        # Stand-ins with the same meaning as SGLang's helpers of these names.
        common.is_cuda = lambda: torch.cuda.is_available() and torch.version.cuda is not None
        common.get_cuda_version = lambda: (tuple(int(x) for x in torch.version.cuda.split("."))
                                           if torch.version.cuda else (0, 0))
        sys.modules["sglang.srt.utils.common"] = common
    return importlib.import_module(ENTRY)


def _drop_sglang_modules() -> None:
    for k in [k for k in sys.modules if k == "sglang" or k.startswith("sglang.")]:
        del sys.modules[k]


def import_sglang(mode: str = "light") -> tuple:
    """(module or None, info dict).  ``light`` (default) imports only the kernel
    module (see the module docstring); ``full`` runs sglang/__init__.py first;
    ``auto`` tries light, then full."""
    info = {"entry": f"{ENTRY}.load_cache_to_device_buffer_mla", "import_mode": mode}
    order = {"light": ("light",), "full": ("full",), "auto": ("light", "full")}[mode]
    mod = None
    for how in order:
        try:
            mod = _light_import() if how == "light" else importlib.import_module(ENTRY)
            info["import"] = how
            break
        except Exception as e:  # noqa: BLE001 - we report any failure verbatim
            info[f"{how}_import_error"] = f"{type(e).__name__}: {e}"
            info[f"{how}_import_traceback"] = traceback.format_exc()[-3000:]
            _drop_sglang_modules()
    if mod is None:
        return None, info
    try:
        from importlib.metadata import version
        info["sglang_version"] = version("sglang")
        info["tvm_ffi_version"] = version("apache-tvm-ffi")
    except Exception as e:  # noqa: BLE001
        info["version_error"] = str(e)
    return mod, info


def build_case(n, cfg, frac, host, dev, seed):
    """Our state + SGLang's tensors for the same hot caches and selections."""
    k, budget, rows, rb = cfg["top_k"], cfg["budget"], cfg["rows"], cfg["row_bytes"]
    st = C.build_state(n_req_slots=n, rows=rows, row_bytes=rb, budget=budget, staging_cols=0,
                       host_rows=host, dev=dev, seed=seed)
    g = torch.Generator().manual_seed(seed)
    n_miss = int(round(frac * k))
    hot, sel = [], []
    for _ in range(n):
        perm = torch.randperm(rows - 1, generator=g)  # never the newest token rows-1
        hot_r, cold_r = perm[:budget], perm[budget:budget + n_miss]
        pick = torch.cat([hot_r[torch.randperm(budget, generator=g)[:k - n_miss]], cold_r])
        hot.append(hot_r)
        sel.append(pick[torch.randperm(k, generator=g)])
    C.make_hot(st, hot)
    st.save()
    sel = torch.stack(sel).to(device=dev, dtype=torch.int32)
    i32 = dict(dtype=torch.int32, device=dev)
    # SGLang side: own device buffer [n*(B+1), rb], same hot rows
    sg = {}
    dbl = (torch.arange(n, **i32)[:, None] * (budget + 1) + torch.arange(budget + 1, **i32)[None])
    sg["device_buffer_locs"] = dbl.contiguous()
    sg["device_buffer"] = torch.empty((n * (budget + 1), rb), dtype=torch.uint8, device=dev)
    sg["device_buffer"].fill_(0xA5)
    sg["device_buffer"][dbl[:, :budget].reshape(-1).long()] = st.device_rows[
        st.hot_loc.reshape(-1).long()]
    newest = torch.full((n, 1), rows - 1, **i32)
    sg["tokens0"] = torch.cat([st.hot_pos, newest], 1).contiguous()
    sg["device_buffer_tokens"] = sg["tokens0"].clone()
    g_lru = torch.Generator(device="cpu").manual_seed(1)  # SGLang's own LRU list: any permutation
    sg["lru0"] = torch.stack([torch.randperm(budget, generator=g_lru) for _ in range(n)]).to(
        device=dev, dtype=torch.int16).contiguous()
    sg["lru_slots"] = sg["lru0"].clone()
    sg["host_cache_locs"] = (st.host_base[:, None] + torch.arange(rows, device=dev)[None]).contiguous()
    sg["top_k_tokens"] = sel.contiguous()
    sg["top_k_device_locs"] = torch.empty((n, k), **i32)
    sg["req_pool_indices"] = torch.arange(n, **i32)
    sg["seq_lens"] = torch.full((n,), rows, **i32)
    sg["num_real_reqs"] = torch.tensor([n], **i32)
    return st, sel.view(n, 1, k), sg, n_miss


def sglang_call(mod, sg, host, cfg):
    mod.load_cache_to_device_buffer_mla(
        sg["top_k_tokens"], sg["device_buffer_tokens"], sg["host_cache_locs"],
        sg["device_buffer_locs"], host, sg["device_buffer"], sg["top_k_device_locs"],
        sg["req_pool_indices"], sg["seq_lens"], sg["lru_slots"],
        cfg["row_bytes"], cfg["top_k"], cfg["budget"], page_size=1,
        block_size=cfg["sglang_block_size"], num_real_reqs=sg["num_real_reqs"])


def sglang_restore(sg):
    sg["device_buffer_tokens"].copy_(sg["tokens0"], non_blocking=True)
    sg["lru_slots"].copy_(sg["lru0"], non_blocking=True)


def check_sglang(mod, sg, st, cfg, host) -> str | None:
    sglang_restore(sg)
    sglang_call(mod, sg, host, cfg)
    torch.cuda.synchronize()
    locs = sg["top_k_device_locs"].long()
    if bool((locs < 0).any()):
        return "negative location returned"
    want_idx = sg["host_cache_locs"].gather(1, sg["top_k_tokens"].long())
    want = host.index_select(0, want_idx.reshape(-1).cpu())
    got = sg["device_buffer"][locs.reshape(-1)].cpu()
    sglang_restore(sg)
    if not torch.equal(want, got):
        return f"payload wrong for {int((want != got).any(1).sum())} selections"
    return None


def compare(files: list, name: str) -> int:
    """Our median per (batch, miss) cell in each results file, and SGLang's from the first."""
    import json
    runs = [(Path(f).stem, json.loads(Path(f).read_text())) for f in files]
    cells = [(p["batch"], p["miss_frac"]) for p in runs[0][1]["points"]]
    fig, ax = C.new_figure(1, "resolver median per cell (SGLang from the first file)", runs[0][1]["meta"])
    a = ax[0]
    width = 0.8 / (len(runs) + 1)
    xs = range(len(cells))
    for i, (label, d) in enumerate(runs):
        by = {(p["batch"], p["miss_frac"]): p["ours"]["median_ms"] * 1e3 for p in d["points"]}
        a.bar([x + i * width for x in xs], [by.get(c, float("nan")) for c in cells], width,
              label=label)
    sg = {(p["batch"], p["miss_frac"]): p["sglang"]["median_ms"] * 1e3
          for p in runs[0][1]["points"] if p.get("sglang")}
    a.bar([x + len(runs) * width for x in xs], [sg.get(c, float("nan")) for c in cells], width,
          label="SGLang", color="gray")
    a.set_xticks([x + 0.4 for x in xs], [f"{b}/{m:.0%}" for b, m in cells], fontsize=7)
    a.set_yscale("log")
    a.set_xlabel("batch / host misses")
    a.set_ylabel("median (us)")
    a.legend(fontsize=7)
    C.save_figure(fig, name)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--name", default=None)
    ap.add_argument("--import-mode", default="light", choices=("light", "full", "auto"))
    ap.add_argument("--sglang-block-size", type=int, default=960,
                    help="threads per CTA; SGLang's server default swap_in_block_size is 960")
    ap.add_argument("--set", action="append", default=[], metavar="_NAME=INT",
                    help="override a launcher constant of our resolve module for this run "
                         "(recorded in the results file), e.g. --set _COPY_ELEMS=8192")
    ap.add_argument("--compare", nargs="+", metavar="JSON",
                    help="no runs: draw our median time per cell of several results files "
                         "(label = file stem) next to each other, into --name")
    args = ap.parse_args(argv)
    if args.compare:
        return compare(args.compare, args.name or "bench_sglang_compare")
    overrides = C.apply_overrides(args.set)
    cfg = dict(SMOKE if args.smoke else REAL, sglang_block_size=args.sglang_block_size)
    name = args.name or ("bench_sglang_smoke" if args.smoke else "bench_sglang")
    dev = C.device()
    meta = C.metadata()
    mod, info = import_sglang(args.import_mode)
    info["kernel_overrides"] = overrides
    print(f"# bench_sglang on {meta['device']} ({meta['date_utc']})")
    for k, v in info.items():
        if not k.endswith("_traceback"):
            print(f"  {k}: {v}")
    if dev.type == "cpu" and not C.interpreting():
        print("no CUDA: run with TRITON_INTERPRET=1 --smoke (our side only)")
        return 2
    resolve_fn, gather_fn = C.load_impl("triton")
    can_sglang = mod is not None and dev.type == "cuda"
    if mod is None:
        for how in ("light", "full"):
            if f"{how}_import_error" in info:
                print(f"SGLang kernel NOT importable ({how}): {info[how + '_import_error']}")
                print(info[f"{how}_import_traceback"])
    points, failures = [], []
    nmax = max(cfg["batches"])
    host = C.pinned_rows(nmax * cfg["rows"], cfg["row_bytes"], seed=5)
    for n in cfg["batches"]:
        req_slots = torch.arange(n, dtype=torch.int32, device=dev)
        for frac in cfg["miss_fracs"]:
            st, sel, sg, n_miss = build_case(n, cfg, frac, host, dev, seed=n * 100 + int(frac * 100))
            chk = C.check_against_reference(st, sel, req_slots, resolve_fn, gather_fn)
            if not chk["ok"] or chk["unique_misses"] != n * n_miss:
                failures.append(f"ours batch={n} miss={frac}: {chk['message']}, "
                                f"misses {chk['unique_misses']} vs built {n * n_miss}")

            def ours(st=st, sel=sel):
                C.resolve_and_copy(resolve_fn, gather_fn, st, sel, req_slots)

            t_ours = C.time_gpu(ours, setup=st.restore, reps=cfg["reps"], spacer_us=SPACER_US).summary()
            res = dict(batch=n, miss_frac=frac, misses_per_request=n_miss, top_k=cfg["top_k"],
                       budget=cfg["budget"], row_bytes=cfg["row_bytes"], ours=t_ours)
            if can_sglang:
                try:
                    t0 = time.perf_counter()
                    err = check_sglang(mod, sg, st, cfg, host)
                    info.setdefault("first_call_s_incl_jit", time.perf_counter() - t0)
                    if err:
                        failures.append(f"sglang batch={n} miss={frac}: {err}")
                    t_sg = C.time_gpu(lambda sg=sg: sglang_call(mod, sg, host, cfg),
                                      setup=lambda sg=sg: sglang_restore(sg), reps=cfg["reps"],
                                      spacer_us=SPACER_US).summary()
                    res["sglang"] = t_sg
                    res["speedup"] = t_sg["median_ms"] / t_ours["median_ms"]
                except Exception as e:  # noqa: BLE001 - e.g. JIT build failure: report it
                    info["sglang_run_error"] = f"{type(e).__name__}: {e}"
                    info["sglang_run_traceback"] = traceback.format_exc()[-4000:]
                    print(f"SGLang call failed: {info['sglang_run_error']}\n{info['sglang_run_traceback']}")
                    can_sglang = False
            points.append(res)
            sgs = (f"sglang {res['sglang']['median_ms'] * 1e3:8.1f} us  speedup {res['speedup']:.2f}x"
                   if "sglang" in res else "sglang -")
            print(f"  batch={n:>4} miss={frac:4.0%}: ours {t_ours['median_ms'] * 1e3:8.1f} us  {sgs}")
            del st, sg
    C.write_json(name, dict(meta=meta, config=cfg, sglang=info, points=points,
                            correctness_failures=failures))
    try:
        fig, ax = C.new_figure(1, "vs SGLang HiSparse load_cache_to_device_buffer (single query)", meta)
        a = ax[0]
        for frac in cfg["miss_fracs"]:
            ps = [p for p in points if p["miss_frac"] == frac and "speedup" in p]
            if ps:
                a.plot([p["batch"] for p in ps], [p["speedup"] for p in ps], marker="o",
                       label=f"{frac:.0%} misses")
        a.axhline(1.0, color="gray", lw=0.8)
        a.set_xscale("log")
        a.set_xlabel("batch")
        a.set_ylabel("SGLang time / our time")
        a.legend(fontsize=7)
        C.save_figure(fig, name)
    except Exception as e:  # noqa: BLE001
        print(f"plot failed: {type(e).__name__}: {e}")
    print(f"\n{'batch':>5} {'miss':>5} {'ours us':>9} {'sglang us':>10} {'speedup':>8}")
    for p in points:
        s = p.get("sglang")
        print(f"{p['batch']:>5} {p['miss_frac']:>5.0%} {p['ours']['median_ms'] * 1e3:>9.1f} "
              f"{(s['median_ms'] * 1e3 if s else float('nan')):>10.1f} {p.get('speedup', float('nan')):>8.2f}")
    if failures:
        print(f"CORRECTNESS FAILED: {failures}")
        return 1
    if not can_sglang and dev.type == "cuda":
        why = (info.get("sglang_run_error") or info.get("light_import_error")
               or info.get("full_import_error") or "?")
        print("SGLANG NOT RUN: " + why)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
