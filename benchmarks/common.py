"""Shared helpers for the resolver benchmarks (bench_resolve, bench_gather, bench_sglang).

Timing method (resolve() mutates hot_pos / hot_stamp / hot_clock / hot_slot_of, so a call is
not idempotent):

* Every timed iteration starts from the same state.  Before each iteration we
  enqueue, on the timing stream: a ``torch.cuda._sleep`` spacer, the state
  restore (``copy_`` from a pristine snapshot), and an L2 flush (a write of
  ``FLUSH_BYTES``).  Only then is the start event recorded, followed by the
  resolver call (resolve + gather) and the end event.  The events bracket the
  resolver alone: restore and flush run *before* the start event on the same
  stream, so they are not in the measured interval, and the spacer keeps the
  GPU busy while Python enqueues the launches, so host launch overhead does
  not appear as idle GPU time between the events.
* Where the call can be captured in a CUDA graph (the Triton launchers never
  sync the host), we time graph replays the same way; ``mode`` in the JSON
  says which was used.  The torch reference syncs (``int(...)``) and is timed
  eagerly.
* Host-side work (the torch CPU-gather baseline) is timed with
  ``perf_counter`` around ``fn(); synchronize()``.
* We report the median of the iterations, and min / max / p10 / p90.

Synthetic states follow ``SourceState``: per request slot ``s`` the host pool
holds rows ``[s*P, (s+1)*P)`` (per-request-contiguous, pinned), hot slot ``j``
of slot ``s`` lives at device row ``hot_loc[s, j]``, and direct-map pages point
into a separate device region that holds a copy of the host rows.
"""
from __future__ import annotations

import datetime as _dt
import importlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
FLUSH_BYTES = 256 << 20  # > 4x the H200's 60 MB L2
STATE_KEYS = ("hot_pos", "hot_stamp", "hot_clock", "hot_slot_of")
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ----------------------------------------------------------------- metadata
def model_config_copy(src: str, prefix: str, change) -> str:
    """A folder with ``src``'s config and tokenizer but no weights (engines load it with
    ``load_format="dummy"``); ``change(config)`` edits the config dict in place."""
    import shutil
    import tempfile
    d = tempfile.mkdtemp(prefix=prefix)
    for f in os.listdir(src):  # no weights, no checksums of them
        p = os.path.join(src, f)
        if os.path.isfile(p) and not f.endswith(".safetensors") and "index" not in f \
                and f != "SHA256SUMS":
            shutil.copy(p, d)
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    change(cfg)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    return d


SHAPES = ("demo", "v4flash")


def layer_plan(name: str, cfg: dict) -> None:
    """Edit a DeepSeek-V4 config (the demo model's) in place to a shape's layer plan.
    ``demo``: as it is (3 layers: c4a, c128a, c4a).  ``v4flash``: DeepSeek-V4-Flash's plan
    on the demo's dimensions -- 43 layers, window-only layers 0-1 (compress ratio 0, as
    transformers' DeepseekV4Config names them), c4a on even layers from
    2, c128a on odd layers from 3, 64 indexer heads; what sets the KV layout is this plan
    and the KV dimensions, not the hidden size or the weights."""
    if name not in SHAPES:
        raise ValueError(f"shape {name!r}; allowed: {', '.join(SHAPES)}")
    if name == "v4flash":
        n = 43
        cfg.update(num_hidden_layers=n, index_n_heads=64,
                   compress_ratios=[0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, n)])


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def metadata() -> dict:
    meta = {
        "date_utc": utc_now(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "host": platform.node(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0"),
    }
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        meta["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        meta.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    sm_count=p.multi_processor_count,
                    device_memory_gib=round(p.total_memory / 2**30, 1))
    else:
        meta["device"] = "cpu"
    if os.environ.get("DHISPARSE_COMMIT"):  # the device copy of the tree may carry no .git
        meta["git_commit"] = os.environ["DHISPARSE_COMMIT"]
        return meta
    try:
        meta["git_commit"] = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
            text=True, timeout=5).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        meta["git_commit"] = None
    return meta


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ------------------------------------------------------------------ kernels
def resolve_and_copy(resolve_fn, gather_fn, st, selections, req_slots):
    """The production call (what the Resolver façade does for one plane): the Triton
    ``resolve`` is handed the row tensors and copies the misses itself (fused
    into its kernel when K*k is small, else by a gather launch); the reference
    resolves, then gathers."""
    args = st.resolve_args(selections, req_slots)
    if getattr(resolve_fn, "__module__", "").endswith("triton_kernels.resolve"):
        return resolve_fn(*args, host_rows=st.host_rows, device_rows=st.device_rows)
    out = resolve_fn(*args, num_device_rows=st.device_rows.shape[0])
    gather_fn(st.host_rows, st.device_rows, out[1], out[2], out[3])
    return out


def load_impl(impl: str):
    """(resolve_fn, gather_fn) for ``triton``, ``torch`` (the CPU path) or ``reference``."""
    from vllm_dhisparse.triton_kernels import reference
    if impl == "reference":
        return reference.resolve_reference, reference.gather_reference
    if impl == "torch":
        from vllm_dhisparse.triton_kernels.resolve_torch import resolve_torch
        return resolve_torch, reference.gather_reference
    if impl == "triton":
        from vllm_dhisparse.triton_kernels.gather import gather_rows
        from vllm_dhisparse.triton_kernels.resolve import resolve
        return resolve, gather_rows
    raise ValueError(f"impl {impl!r} is not one of ('triton', 'torch', 'reference')")


# ------------------------------------------------------------------ memory
def pinned_rows(n_rows: int, row_bytes: int, seed: int = 0) -> torch.Tensor:
    """Pinned uint8 [n_rows, row_bytes] filled with random bytes (never zeros).

    On CUDA the bytes are generated on the GPU in chunks and copied down, which
    is far faster than a CPU RNG for multi-GB pools."""
    pin = torch.cuda.is_available()
    out = torch.empty((n_rows, row_bytes), dtype=torch.uint8, pin_memory=pin)
    g = torch.Generator(device="cuda" if pin else "cpu").manual_seed(seed)
    chunk = max(1, (256 << 20) // max(row_bytes, 1))
    for a in range(0, n_rows, chunk):
        b = min(n_rows, a + chunk)
        if pin:
            blk = torch.randint(0, 256, (b - a, row_bytes), dtype=torch.uint8, device="cuda",
                                generator=g)
            out[a:b].copy_(blk)
        else:
            out[a:b] = torch.randint(0, 256, (b - a, row_bytes), dtype=torch.uint8, generator=g)
    if pin:
        torch.cuda.synchronize()
    return out


def host_to_device_rows(host: torch.Tensor, dev_rows: torch.Tensor, host_idx: torch.Tensor,
                        dev_idx: torch.Tensor) -> None:
    """dev_rows[dev_idx] = host[host_idx] (setup only; not timed)."""
    if host_idx.numel() == 0:
        return
    data = host.index_select(0, host_idx.cpu().long())
    dev_rows[dev_idx.to(dev_rows.device).long()] = data.to(dev_rows.device)


_flush_buf = None


def flush_l2() -> None:
    global _flush_buf
    if not torch.cuda.is_available():
        return
    if _flush_buf is None:
        _flush_buf = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    _flush_buf.fill_(7)


# ------------------------------------------------------------------ timing
@dataclass
class Timing:
    times_ms: list = field(default_factory=list)
    mode: str = "eager"

    @property
    def median(self) -> float:
        return statistics.median(self.times_ms)

    def summary(self) -> dict:
        t = sorted(self.times_ms)
        q = lambda f: t[min(len(t) - 1, int(f * (len(t) - 1) + 0.5))]  # noqa: E731
        return {"median_ms": statistics.median(t), "min_ms": t[0], "max_ms": t[-1],
                "p10_ms": q(0.1), "p90_ms": q(0.9), "n": len(t), "mode": self.mode}


def _spacer_cycles(us: float) -> int:
    return int(us * 2.0e3)  # ~2 GHz SM clock; only needs to be roughly right


def time_gpu(fn, setup=None, reps: int = 20, warmup: int = 3, spacer_us: float = 300.0,
             flush: bool = True, graph: bool = False) -> Timing:
    """Median-ready per-iteration times of ``fn`` (ms), each after ``setup``.

    ``setup`` (state restore) and the L2 flush run before the start event.
    With ``graph=True`` we try to capture ``fn`` in a CUDA graph and time its
    replays; on failure we fall back to eager (``Timing.mode`` says which).
    On CPU (interpreter smoke runs) we use perf_counter and no warm-up: the interpreter
    compiles nothing, and CPU times there only show that the call runs.
    """
    if not torch.cuda.is_available():
        out = Timing(mode="cpu-wall")
        warmup = 0
        for i in range(warmup + reps):
            if setup:
                setup()
            t0 = time.perf_counter()
            fn()
            if i >= warmup:
                out.times_ms.append((time.perf_counter() - t0) * 1e3)
        return out
    run, mode = fn, "eager"
    if graph:
        try:
            if setup:
                setup()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()  # warm up (compile) outside the capture
            torch.cuda.current_stream().wait_stream(s)
            if setup:
                setup()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                fn()
            run, mode = g.replay, "cuda-graph"
        except Exception as e:  # noqa: BLE001 - any capture failure -> eager
            print(f"  [timing] graph capture failed ({type(e).__name__}: {e}); timing eagerly")
            torch.cuda.synchronize()
    for _ in range(warmup):
        if setup:
            setup()
        run()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for i in range(reps):
        torch.cuda._sleep(_spacer_cycles(spacer_us))
        if setup:
            setup()
        if flush:
            flush_l2()
        starts[i].record()
        run()
        ends[i].record()
    torch.cuda.synchronize()
    return Timing([s.elapsed_time(e) for s, e in zip(starts, ends)], mode)


def time_host(fn, setup=None, reps: int = 10, warmup: int = 2) -> Timing:
    """Wall-clock of ``fn(); synchronize()`` for host-driven work."""
    out = Timing(mode="host-wall")
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for i in range(warmup + reps):
        if setup:
            setup()
        flush_l2()
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if i >= warmup:
            out.times_ms.append((time.perf_counter() - t0) * 1e3)
    return out


def pinned_h2d_gbps(nbytes: int = 1 << 30, reps: int = 10) -> dict:
    """Pinned host -> device ``copy_`` bandwidth (GB/s = 1e9 B/s), median of reps."""
    if not torch.cuda.is_available():
        return {"bytes": 0, "median_gbps": float("nan"), "note": "no CUDA"}
    src = pinned_rows(nbytes // 4096, 4096, seed=123).view(-1)
    dst = torch.empty(src.numel(), dtype=torch.uint8, device="cuda")
    t = time_gpu(lambda: dst.copy_(src, non_blocking=True), reps=reps, warmup=2,
                 spacer_us=10.0, flush=False)
    gbps = [src.numel() / (ms * 1e-3) / 1e9 for ms in t.times_ms]
    del src, dst
    return {"bytes": nbytes, "median_gbps": statistics.median(gbps), "min_gbps": min(gbps),
            "max_gbps": max(gbps)}


def linear_fit(xs: list, ys: list) -> dict:
    """Least squares y = a + b x; returns slope, intercept, r2."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    sxy = sum((x - mx) * (y - my) for x, y in zip(xs, ys))
    b = sxy / sxx if sxx else float("nan")
    a = my - b * mx
    ss_res = sum((y - (a + b * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return {"slope": b, "intercept": a, "r2": 1 - ss_res / ss_tot if ss_tot else float("nan")}


# ------------------------------------------------------------------ states
@dataclass
class SynthState:
    """SourceState-compatible tables for ``n_req_slots`` requests of ``rows`` rows each."""
    page_table: torch.Tensor
    page_size: int
    hot_pos: torch.Tensor
    hot_loc: torch.Tensor
    hot_stamp: torch.Tensor
    hot_clock: torch.Tensor
    hot_slot_of: torch.Tensor
    host_base: torch.Tensor
    seq_lens: torch.Tensor
    staging_rows: torch.Tensor
    device_rows: torch.Tensor
    host_rows: torch.Tensor
    rows: int
    snapshot: dict = field(default_factory=dict)

    def resolve_args(self, selections: torch.Tensor, req_slots: torch.Tensor):
        return (selections, req_slots, self.page_table, self.page_size, self.hot_pos,
                self.hot_loc, self.hot_stamp, self.hot_clock, self.hot_slot_of, self.staging_rows,
                self.host_base)

    def save(self) -> None:
        self.snapshot = {k: getattr(self, k).clone() for k in STATE_KEYS}

    def restore(self) -> None:
        for k in STATE_KEYS:
            getattr(self, k).copy_(self.snapshot[k], non_blocking=True)

    def clone_tables(self) -> dict:
        return {k: getattr(self, k).clone() for k in STATE_KEYS}


def build_state(*, n_req_slots: int, rows: int, row_bytes: int, budget: int, staging_cols: int,
                page_size: int = 64, direct_rows: int = 0, host_rows: torch.Tensor | None = None,
                dev: torch.device | None = None, seed: int = 0) -> SynthState:
    """Empty (cold) hot caches; the first ``direct_rows`` rows of every slot
    published in the direct map (device copy made here).

    Device row layout: [hot: n_req_slots*budget][staging: n_req_slots*staging_cols]
    [direct: n_req_slots*direct_rows]."""
    dev = dev or device()
    if direct_rows % page_size:
        raise ValueError(f"direct_rows {direct_rows} must be a multiple of page_size {page_size}")
    if host_rows is None:
        host_rows = pinned_rows(n_req_slots * rows, row_bytes, seed=seed)
    if host_rows.shape[0] < n_req_slots * rows or host_rows.shape[1] != row_bytes:
        raise ValueError(f"host pool {tuple(host_rows.shape)} too small for {n_req_slots}x{rows}x{row_bytes}")
    i32 = dict(dtype=torch.int32, device=dev)
    hot0, stage0 = 0, n_req_slots * budget
    direct0 = stage0 + n_req_slots * staging_cols
    n_dev = direct0 + n_req_slots * direct_rows
    device_rows = torch.empty((max(n_dev, 1), row_bytes), dtype=torch.uint8, device=dev)
    device_rows.fill_(0xA5)  # poison: a wrong location reads this, not the host bytes
    max_pages = -(-rows // page_size)
    page_table = torch.full((n_req_slots, max_pages), -1, **i32)
    slots = torch.arange(n_req_slots, **i32)
    if direct_rows:
        n_pages = direct_rows // page_size
        base = direct0 + slots[:, None] * direct_rows + torch.arange(n_pages, **i32)[None] * page_size
        page_table[:, :n_pages] = base
        for s in range(n_req_slots):  # contiguous copies: host [s*rows, +direct_rows) -> device
            a = direct0 + s * direct_rows
            device_rows[a:a + direct_rows].copy_(host_rows[s * rows:s * rows + direct_rows])
    hot_loc = (hot0 + slots[:, None] * budget + torch.arange(budget, **i32)[None]).contiguous()
    staging = (stage0 + slots[:, None] * staging_cols
               + torch.arange(staging_cols, **i32)[None]).contiguous()
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    # a steady state's recency: ages 1 .. 4095 calls (two radix passes when victims are chosen)
    clock = torch.full((n_req_slots,), 2**20, **i32)
    ages = torch.randint(1, 4096, (n_req_slots, budget), generator=g).to(**i32)
    st = SynthState(
        page_table=page_table, page_size=page_size,
        hot_pos=torch.full((n_req_slots, budget), -1, **i32), hot_loc=hot_loc,
        hot_stamp=(clock[:, None] - ages).contiguous(), hot_clock=clock,
        hot_slot_of=torch.full((n_req_slots, rows), -1, **i32),
        host_base=(slots.long() * rows).contiguous(),
        seq_lens=torch.full((n_req_slots,), rows, **i32), staging_rows=staging,
        device_rows=device_rows, host_rows=host_rows, rows=rows)
    return st


def make_hot(st: SynthState, hot: list) -> None:
    """Fills hot caches: ``hot[s]`` = rows (1-D tensor, len <= B) put in slots 0.. of slot s,
    with their bytes copied to the hot device rows."""
    dev = st.hot_pos.device
    for s, r in enumerate(hot):
        r = r.to(device=dev, dtype=torch.int32)
        m = r.numel()
        st.hot_pos[s, :m] = r
        st.hot_slot_of[s, r.long()] = torch.arange(m, dtype=torch.int32, device=dev)
        host_to_device_rows(st.host_rows, st.device_rows, r.long() + int(st.host_base[s]),
                            st.hot_loc[s, :m])


# ---------------------------------------------------------------- checking
def check_against_reference(st: SynthState, selections: torch.Tensor, req_slots: torch.Tensor,
                            resolve_fn, gather_fn, sample: int = 4096, seed: int = 0,
                            ref_cache: dict | None = None) -> dict:
    """Runs ``resolve_fn``+``gather_fn`` and the torch reference from the same
    state; compares outputs and state updates exactly, then checks the payload
    eq. 12 on a random sample of selections.  Restores the state afterwards.
    ``ref_cache`` (a dict kept per case) holds the reference's answer so that
    several variants on one case run the reference once.
    Returns a dict with ``ok`` and a message."""
    from vllm_dhisparse.triton_kernels.reference import resolve_reference
    st.restore()
    if ref_cache is not None and "ref" in ref_cache:
        ref_tables, (r_loc, r_src, r_dst, r_cnt, r_ctr) = ref_cache["ref"]
    else:
        ref_tables = st.clone_tables()
        ref_args = (selections, req_slots, st.page_table, st.page_size, ref_tables["hot_pos"],
                    st.hot_loc, ref_tables["hot_stamp"], ref_tables["hot_clock"],
                    ref_tables["hot_slot_of"],
                    st.staging_rows, st.host_base)
        r_loc, r_src, r_dst, r_cnt, r_ctr = resolve_reference(
            *ref_args, num_device_rows=st.device_rows.shape[0])
        if ref_cache is not None:
            ref_cache["ref"] = (ref_tables, (r_loc, r_src, r_dst, r_cnt, r_ctr))
    loc, src, dst, cnt, ctr = resolve_and_copy(resolve_fn, gather_fn, st, selections, req_slots)
    msgs = []
    if not torch.equal(loc, r_loc):
        bad = (loc != r_loc).nonzero()
        msgs.append(f"locations differ at {bad.shape[0]} places, first {bad[0].tolist()}")
    if not torch.equal(cnt, r_cnt):
        msgs.append(f"miss_count differs: {cnt[:8].tolist()} vs {r_cnt[:8].tolist()}")
    else:
        w = r_src.shape[1]
        mask = torch.arange(w, device=cnt.device)[None] < cnt[:, None].long()
        if not torch.equal(src[mask], r_src[mask]) or not torch.equal(dst[mask], r_dst[mask]):
            msgs.append("miss_src/miss_dst differ in the valid prefix")
    if not torch.equal(ctr, r_ctr):
        msgs.append(f"counters differ: {ctr[0].tolist()} vs {r_ctr[0].tolist()}")
    for k in STATE_KEYS:
        rows = req_slots.long()
        if not torch.equal(getattr(st, k)[rows], ref_tables[k][rows]):
            msgs.append(f"{k} differs after the call")
    # payload: device_rows[loc] == host_rows[host_base[slot] + sel] on a sample
    valid = (selections >= 0).nonzero()
    g = torch.Generator(device="cpu").manual_seed(seed)
    pick = valid[torch.randperm(valid.shape[0], generator=g)[:sample].to(valid.device)]
    n, j, i = pick[:, 0], pick[:, 1], pick[:, 2]
    host_idx = st.host_base[req_slots[n].long()] + selections[n, j, i].long()
    want = st.host_rows.index_select(0, host_idx.cpu())
    got = st.device_rows[loc[n, j, i].long()].cpu()
    if not torch.equal(want, got):
        nbad = int((want != got).any(1).sum())
        msgs.append(f"payload wrong for {nbad}/{pick.shape[0]} sampled selections")
    st.restore()
    return {"ok": not msgs, "message": "; ".join(msgs) or "exact match",
            "unique_misses": int(r_cnt.sum()), "counters": r_ctr.sum(0).tolist()}


# ------------------------------------------------------------------ output
def apply_overrides(items: list) -> dict:
    """``_NAME=INT`` strings -> set on vllm_dhisparse.triton_kernels.resolve."""
    mod = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    valid = sorted(k for k, v in vars(mod).items()
                   if k.startswith("_") and k[1:].isupper() and type(v) in (int, bool)
                   and k not in ("_INT32_MAX", "_MAX_WIDTH", "_MAX_BUDGET"))  # limits
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        if name not in valid:
            raise SystemExit(f"--set {item!r}: unknown constant {name!r}; valid: {valid}")
        try:
            out[name] = int(value)
        except ValueError:
            raise SystemExit(f"--set {item!r}: value must be an integer") from None
        setattr(mod, name, out[name])
    return out


def write_json(name: str, payload: dict, path: str | Path | None = None) -> Path:
    """``payload`` as ``results/<name>.json``, or at ``path``."""
    path = Path(path) if path else RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump(payload, f, indent=1, default=float)
    print(f"wrote {path}")
    return path


def new_figure(n_panels: int, title: str, meta: dict):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, n_panels, figsize=(5.2 * n_panels, 4.2), squeeze=False)
    fig.suptitle(f"{title}\n{meta.get('device', '?')} | torch {meta.get('torch')} | "
                 f"triton {meta.get('triton')} | {meta.get('date_utc')}", fontsize=9)
    return fig, axes[0]


def save_figure(fig, name: str, path: str | Path | None = None) -> Path:
    """``fig`` as ``results/<name>.png``, or at ``path``."""
    path = Path(path) if path else RESULTS / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")
    return path


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} GB"


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)
