"""The hierarchy's whole decode step (KVHierarchy, not only the kernel) at DeepSeek-V4.1-Flash shapes.

    python3 benchmarks/bench_hierarchy_step.py                      # H200, full sizes
    TRITON_INTERPRET=1 python benchmarks/bench_hierarchy_step.py --smoke   # CPU, tiny

Sources (paper 4.1): ``c4a`` selected by five layers with B = 8192 and three
single-layer sources with B = 4096; k = 512 selections per layer; 584-byte rows
stored as 576 + 8 byte planes (fp8_ds_mla).  Every session is admitted with
``--history`` rows per source, less a per-session offset within a page
(``--stagger``, default: tail pages complete and back up in different steps, as
sessions of different lengths do); optional residency keeps what the device pool has
room for, the rest is on host.  Then it decodes: one row per source every
``--compress`` steps (the model's compression rate; one ``append_batch`` per source, or
with ``--append each`` one ``append`` per session), five resolve calls on ``c4a``
and one on each other source, then ``step()`` (backups, repopulation).  Selections
have locality: a fixed working set per session and layer (hot after its first
use) plus ``--miss`` of k fresh rows per call from the non-resident history
(host misses), the rest from the rows the device holds; the fractions the
hierarchy actually resolved are reported next to them.  ``--validate call`` (default)
bounds-checks the selections in every resolve call, as ``KVHierarchy.resolve`` does
by default (a host synchronisation per call); ``--validate step`` resolves without
it (the kernel bounds each selection by its request's length) and reads the
sources' invalid-selection counts once per step.

Checked first, per batch size: for the first steps every location of every sampled
session reads its original row (eq. 12), from the pool bytes against the imported
truth.  Then timed, per decode step: wall clock (``perf_counter`` around the step,
synchronised before and after), GPU time of the whole step (CUDA events), the
resolve calls' share of the wall clock, host synchronisations (torch's sync debug
mode, one warning per synchronising call), and bytes fetched from host.  Results:
``results/bench_hierarchy_step.{json,png}``.
"""
from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from vllm_dhisparse.hierarchy import pinned  # noqa: E402
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy  # noqa: E402

FULL = dict(batches=(16, 64, 256, 512), top_k=512, row_bytes=584, plane_bytes=(576, 8),
            budgets=(8192, 4096, 4096, 4096), layers=(5, 1, 1, 1), page_size=64,
            history=8192, steps=12, warmup=3, check_steps=2, check_sessions=8)
SMOKE = dict(batches=(2, 4), top_k=8, row_bytes=12, plane_bytes=(8, 4), budgets=(16, 8, 8, 8),
             layers=(2, 1, 1, 1), page_size=4, history=64, steps=3, warmup=1, check_steps=2,
             check_sessions=4)
SOURCES = ("c4a", "src1", "src2", "src3")


def history_lengths(cfg: dict, n: int) -> list[int]:
    """Imported rows per session: ``history``, less an offset spread over a page when
    ``stagger`` is on, so that sessions complete tail pages at different steps (as
    sessions of different lengths do) instead of all in the same step."""
    hist, ps = cfg["history"], cfg["page_size"]
    if not cfg.get("stagger", True):
        return [hist] * n
    return [hist - (i * ps // n) % ps for i in range(n)]


def build(cfg: dict, n: int, dev: torch.device, resident: float):
    """The hierarchy, every session's imported history (kept as the truth) and where
    each session's appended rows start in it (``starts``: a list and a device tensor)."""
    ps, hist = cfg["page_size"], cfg["history"]
    max_rows = hist + cfg["steps"] + cfg["warmup"] + cfg["check_steps"] + ps
    specs = []
    for name, budget in zip(SOURCES, cfg["budgets"]):
        per_req = -(-budget // ps) + 2  # hot, tail (one query per request: no overflow)
        optional = int(resident * n * (hist // ps))
        specs.append(dict(name=name, row_bytes=cfg["row_bytes"], page_size=ps,
                          device_pages=n * per_req + optional, host_rows=n * max_rows,
                          hot_cache_rows=budget, tail_pages=2, max_req_slots=n, max_rows=max_rows,
                          plane_bytes=cfg["plane_bytes"]))
    h = KVHierarchy(specs, device=dev)
    # drawn on the device: at 128K context and 512 sessions the truth is ~40 GB
    g = torch.Generator(device=dev).manual_seed(n)
    truth = {s: torch.randint(0, 256, (n, max_rows, cfg["row_bytes"]), generator=g,
                              dtype=torch.uint8, device=dev) for s in SOURCES}
    ids = [f"s{i}" for i in range(n)]
    lens = history_lengths(cfg, n)
    for i, rid in enumerate(ids):
        assert h.admit(rid, max_rows, {s: truth[s][i, :lens[i]] for s in SOURCES}), rid
    return h, ids, truth, (lens, torch.tensor(lens, dtype=torch.int64, device=dev))


def selection_plan(h, cfg: dict, ids: list, seed: int):
    """Per source and layer: which pages each session has ready, and a seed for its
    working set (``selections`` draws the calls)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    plans = {}
    for s, layers in zip(SOURCES, cfg["layers"]):
        st = h.source(s).state
        ps = st.page_size
        ready = (st.page_table[[st.req_slot(r) for r in ids]] >= 0).cpu()  # [n, pages]
        for layer in range(layers):
            plans[(s, layer)] = (ready, ps, torch.randint(0, 2**31 - 1, (1,), generator=g).item())
    return plans


def selections(cfg, plan, n_rows: int, miss: float, step: int, dev) -> torch.Tensor:
    """[n, 1, k] int32: direct rows (ready pages), a working set (hot after its first
    use) and fresh host misses."""
    ready, ps, seed = plan
    k = cfg["top_k"]
    n = ready.shape[0]
    g = torch.Generator(device="cpu").manual_seed(seed)
    rows = torch.arange(n_rows)
    on_dev = ready[:, rows // ps]  # [n, rows]
    out = torch.full((n, k), -1, dtype=torch.int64)
    for i in range(n):
        dev_rows, host_rows = rows[on_dev[i]], rows[~on_dev[i]]
        # a session whose history is all on device (resident-first admission) has no
        # hot or host rows: its selections are direct
        n_miss = min(max(int(miss > 0), int(round(miss * k))), host_rows.numel())
        n_hot = min(int(round(0.3 * k)), host_rows.numel() - n_miss)
        n_dir = min(k - n_hot - n_miss, dev_rows.numel())
        perm = host_rows[torch.randperm(host_rows.numel(), generator=g)]
        working = perm[:n_hot]  # the same every step: hot after the first
        pool = perm[n_hot:]
        gs = torch.Generator(device="cpu").manual_seed(seed + 7919 * (step + 1) + i)
        fresh = pool[torch.randperm(pool.numel(), generator=gs)[:n_miss]]
        direct = dev_rows[torch.randperm(dev_rows.numel(), generator=gs)[:n_dir]]
        picked = torch.cat([direct, working, fresh])
        out[i, :picked.numel()] = picked
    return out.view(n, 1, k).to(torch.int32).to(dev)


def check_locations(h, source: str, ids: list, sel: torch.Tensor, loc: torch.Tensor, truth,
                    positions) -> str | None:
    """The bytes at the locations of the sessions at batch ``positions`` against the
    truth (``truth[source][i]`` is the session at position i); None when all match."""
    parts = h.source(source)
    pool = parts.pool
    for i in positions:
        valid = (sel[i] >= 0) & (sel[i] < parts.state.seq_len(ids[i]))
        if bool((loc[i][~valid] != -1).any()):
            return f"{source}: session {ids[i]} has a location for a padding or invalid selection"
        got = pool.read(loc[i][valid].long())
        want = truth[source][i, sel[i][valid].long()]
        if not torch.equal(got.to(want.device), want):
            return f"{source}: session {ids[i]} read wrong bytes at {int((got != want).any(-1).sum())} selections"
    return None


class SyncCounter:
    """Counts synchronising CUDA calls (torch's sync debug mode warns once per call).
    With ``sites``, also where: each call adds one to ``sites[key]``, the key naming
    the innermost project frames (``file:line`` of up to three, innermost first)."""

    def __init__(self, sites: Counter | None = None):
        self.sites = sites

    def __enter__(self):
        self.count = 0
        self._w = warnings.catch_warnings()
        self._w.__enter__()
        warnings.simplefilter("always")
        self._prev, warnings.showwarning = warnings.showwarning, self._note
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def _note(self, message, category, filename, lineno, file=None, line=None):
        if "synchronizing" not in str(message):
            return self._prev(message, category, filename, lineno, file, line)
        self.count += 1
        if self.sites is not None:
            self.sites[sync_site(traceback.extract_stack()[:-1])] += 1

    def __exit__(self, *exc):
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self._prev
        self._w.__exit__(*exc)


def sync_site(frames) -> str:
    ours = [f for f in frames if "vllm_dhisparse" in f.filename or "benchmarks" in f.filename]
    return " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(ours[-3:]))


def top_sites(sites: Counter, per: int = 1, n: int = 25) -> dict:
    """The ``n`` commonest sync sites, counts divided by ``per`` (steps or calls)."""
    return {k: round(v / max(1, per), 3) for k, v in sites.most_common(n)}


def decode_step(h, cfg, ids, truth, plans, step_no: int, n_hist: int, miss: float, dev,
                check: bool, times: dict, graph=None, verify: bool = False,
                starts=None) -> str | None:
    """One decode step; with ``graph`` (``capture_resolves``) the resolve calls are one
    replay, and ``verify`` checks the replay's locations against the truth.  Selections
    draw from the first ``n_hist`` rows; appended rows come from the truth at
    ``starts`` (``build``'s) plus the rows appended so far."""
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    t0 = time.perf_counter()
    if step_no % cfg["compress"] == 0:
        lens, lens_dev = starts
        k = step_no // cfg["compress"]
        for s in SOURCES:
            if cfg["append"] == "batch":
                rows = truth[s][torch.arange(len(ids), device=dev), lens_dev + k]
                failed = h.append_batch(s, ids, rows)
                if failed:
                    raise RuntimeError(f"append_batch to {s} failed for {failed}")
            else:
                for i, rid in enumerate(ids):
                    h.append(rid, s, truth[s][i, lens[i] + k:lens[i] + k + 1])
    t1 = time.perf_counter()
    err = None
    if graph is not None:  # this step's selections into the captured inputs, one replay
        g, inputs, outputs, stacked, slots = graph
        for s, captured in slots.items():  # a slot opened or closed would free them
            if h.source(s).state.req_slot_tensor(ids) is not captured:
                raise RuntimeError(f"{s}: the batch's slot tensor changed since capture")
        inputs.copy_(stacked[step_no % stacked.shape[0]])
        g.replay()
        if verify:
            for i, (s, _) in enumerate(plans):
                err = err or check_locations(h, s, ids, inputs[i], outputs[i], truth,
                                             range(min(cfg["check_sessions"], len(ids))))
    for (s, layer), plan in plans.items() if graph is None else ():
        sel = selections(cfg, plan, n_hist, miss, step_no * 16 + layer, dev) if check else \
            plan[3][step_no % len(plan[3])]
        loc, _ = h.resolve(s, ids, sel, validate=cfg["validate"] == "call")
        if check and err is None:
            err = check_locations(h, s, ids, sel, loc, truth,
                                  range(min(cfg["check_sessions"], len(ids))))
    t2 = time.perf_counter()
    h.step()
    if cfg["validate"] == "step":  # the bounds check of the whole step: one host read
        bad = {s: n for s, n in h.invalid_selections().items() if n}
        if bad and err is None:
            err = f"invalid selections (resolved as padding): {bad}"
    sync()
    t3 = time.perf_counter()
    times["append"].append(t1 - t0)
    times["resolve"].append(t2 - t1)
    times["step"].append(t3 - t2)
    return err


def capture_resolves(h, cfg, ids, plans):
    """Every resolve call of a step captured in one CUDA graph, as vLLM captures a decode
    step: the launches' host work is paid once, at capture.  Returns ``(graph, inputs
    [L, n, 1, k] int32, outputs [L] locations, stacked [T, L, n, 1, k] int32, the
    slot tensors it reads)``: before a replay the step's selections are copied into
    ``inputs``.  Replays update the device counters (captured) but not ``Resolver``'s
    Python call count; the replay's GPU time lands in the ``step()`` part, where the
    step synchronises."""
    keys = list(plans)
    stacked = torch.stack([torch.stack([plans[key][3][j] for key in keys])
                           for j in range(len(plans[keys[0]][3]))])
    inputs = stacked[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compiled and warm before capture (torch's graph recipe)
        for i, (s, _) in enumerate(keys):
            h.resolve(s, ids, inputs[i], validate=False)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    # the default ("global") capture mode, as vLLM captures
    with torch.cuda.graph(g):
        outputs = [h.resolve(s, ids, inputs[i], validate=False)[0] for i, (s, _) in enumerate(keys)]
    slots = {s: h.source(s).state.req_slot_tensor(ids) for s, _ in keys}  # what the graph reads
    return g, inputs, outputs, stacked, slots


def _profile(h, cfg, ids, truth, plans, n_hist, miss, dev, graph, starts) -> str:
    """torch.profiler over a few more steps (after the timed ones, not counted in them):
    where the GPU time of a step goes, and how much of the step the GPU is busy."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile
    times = {"append": [], "resolve": [], "step": []}
    steps = 4
    first = cfg["check_steps"] + cfg["warmup"] + cfg["steps"]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for j in range(steps):
            decode_step(h, cfg, ids, truth, plans, first + j, n_hist, miss, dev, False, times,
                        graph=graph, starts=starts)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
    busy = sum(e.self_device_time_total for e in prof.key_averages()
               if e.device_type != DeviceType.CPU) / steps / 1e3
    return f"{steps} steps, GPU busy {busy:.3f} ms per step\n{table}"


def run_batch(cfg: dict, n: int, miss: float, dev, resident: float) -> dict:
    h, ids, truth, starts = build(cfg, n, dev, resident)
    plans = selection_plan(h, cfg, ids, seed=n)
    n_hist = min(starts[0])  # rows every session has
    times = {"append": [], "resolve": [], "step": []}
    errors = []
    for step in range(cfg["check_steps"]):  # checked, not timed
        err = decode_step(h, cfg, ids, truth, plans, step, n_hist, miss, dev, True, times,
                          starts=starts)
        if err:
            errors.append(err)
    # the timed steps' selections, made before timing (generation is not the hierarchy's)
    for key, plan in plans.items():
        calls = [selections(cfg, plan, n_hist, miss, 1000 + j, dev)
                 for j in range(cfg["steps"] + cfg["warmup"])]
        plans[key] = (*plan[:3], calls)
    graph = capture_resolves(h, cfg, ids, plans) if cfg.get("graph") else None
    before = None
    wall, gpu, syncs, sites = [], [], [], Counter()
    times = {"append": [], "resolve": [], "step": []}
    for step in range(cfg["warmup"] + cfg["steps"]):
        no = cfg["check_steps"] + step
        if step == cfg["warmup"]:  # fetched bytes and fractions of the timed steps only
            if dev.type == "cuda":
                torch.cuda.synchronize()
            before = {s: h.source(s).resolver.totals() for s in SOURCES}
        if dev.type == "cuda":
            torch.cuda.synchronize()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
        t0 = time.perf_counter()
        with SyncCounter(sites if step >= cfg["warmup"] else None) as sc:
            # a replayed step's locations are checked during warm-up (checked, then timed)
            err = decode_step(h, cfg, ids, truth, plans, no, n_hist, miss, dev, False, times,
                              graph=graph, verify=graph is not None and step < cfg["warmup"],
                              starts=starts)
        t1 = time.perf_counter()
        if err:
            errors.append(err)
        if step < cfg["warmup"]:
            continue
        wall.append(t1 - t0)
        syncs.append(sc.count)
        if dev.type == "cuda":
            e1.record()
            torch.cuda.synchronize()
            gpu.append(e0.elapsed_time(e1) / 1e3)
    after = {s: h.source(s).resolver.totals() for s in SOURCES}
    profile = _profile(h, cfg, ids, truth, plans, n_hist, miss, dev, graph, starts) \
        if cfg.get("profile") and dev.type == "cuda" else None
    moved = {f: sum(getattr(after[s], f) - getattr(before[s], f) for s in SOURCES)
             for f in ("direct", "hot", "host", "fetched", "bytes_fetched")}
    sel_total = max(1, moved["direct"] + moved["hot"] + moved["host"])
    steps = max(1, len(wall))
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else float("nan")  # noqa: E731
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    w = cfg["warmup"]
    # appends come every `compress` steps: the parts are means over the timed steps
    return dict(
        batch=n, miss=miss, errors=errors,
        step_wall_ms=med(wall) * 1e3, step_wall_mean_ms=mean(wall) * 1e3,
        step_gpu_ms=med(gpu) * 1e3 if gpu else None,
        append_ms=mean(times["append"][w:]) * 1e3, resolve_ms=mean(times["resolve"][w:]) * 1e3,
        step_call_ms=mean(times["step"][w:]) * 1e3,
        host_syncs_per_step=med(syncs), sync_sites_per_step=top_sites(sites, steps),
        profile=profile, bytes_fetched_per_step=moved["bytes_fetched"] / steps,
        resolved_fraction=dict(direct=moved["direct"] / sel_total, hot=moved["hot"] / sel_total,
                               host=moved["host"] / sel_total))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpreter)")
    ap.add_argument("--batches", type=int, nargs="+", help="active sessions per run")
    ap.add_argument("--miss", type=float, default=0.05, help="host misses, fraction of k")
    ap.add_argument("--history", type=int, help="rows of imported history per session and source")
    ap.add_argument("--stagger", action=argparse.BooleanOptionalAction, default=True,
                    help="session i imports history - (i * page_size // sessions) %% page_size "
                         "rows, so tail pages complete (and back up) in different steps; "
                         "--no-stagger: every session at --history, all completing together")
    ap.add_argument("--resident", type=float, default=0.7,
                    help="device room for this fraction of the imported history (optional pages)")
    ap.add_argument("--compress", type=int, default=4, help="decode steps per appended row")
    ap.add_argument("--append", choices=("batch", "each"), default="batch",
                    help="one append_batch per source, or one append per session and source")
    ap.add_argument("--validate", choices=("call", "step"), default="call",
                    help="bounds check of the selections: per resolve call (refuses before the "
                         "kernels run, one host synchronisation per call), or once per step "
                         "(the kernels bound every selection by its request's length)")
    ap.add_argument("--graph", action="store_true",
                    help="capture the step's resolve calls in one CUDA graph and replay it "
                         "(as vLLM runs decode steps); implies --validate step")
    ap.add_argument("--profile", action="store_true",
                    help="also run torch.profiler over 4 more steps per batch (CUDA); the table "
                         "goes to results/<name>_profile_b<batch>.txt")
    ap.add_argument("--host-pages", choices=("huge", "4k"), default="4k",
                    help="pages of the pinned host pools: 4 KiB (the host store's default) or "
                         "advised for transparent huge pages")
    ap.add_argument("--set", action="append", default=[], metavar="_NAME=INT",
                    help="override a launcher constant of the resolve module for this run "
                         "(recorded in the results file), e.g. --set _MANY_MAXNREG=0")
    ap.add_argument("--name", default=None, help="results file stem")
    args = ap.parse_args(argv)
    overrides = C.apply_overrides(args.set)
    pinned.HUGE_PAGES = args.host_pages == "huge"
    cfg = dict(SMOKE if args.smoke else FULL, compress=args.compress, append=args.append,
               stagger=args.stagger,
               validate="step" if args.graph else args.validate, profile=args.profile,
               graph=args.graph, host_pages=args.host_pages, kernel_overrides=overrides)
    if args.batches:
        cfg["batches"] = tuple(args.batches)
    if args.history:
        cfg["history"] = args.history
    dev = C.device()
    if args.graph and dev.type != "cuda":
        ap.error("--graph needs a CUDA device")
    meta = C.metadata()
    print(f"# bench_hierarchy_step on {meta['device']} ({meta['date_utc']}), miss {args.miss:.0%}")
    points = []
    for n in cfg["batches"]:
        p = run_batch(cfg, n, args.miss, dev, args.resident)
        if p["profile"]:
            name = args.name or "bench_hierarchy_step"
            (C.RESULTS / f"{name}_profile_b{n}.txt").write_text(p["profile"])
            print("   ", p["profile"].splitlines()[0])
            p["profile"] = f"{name}_profile_b{n}.txt"
        points.append(p)
        f = p["resolved_fraction"]
        print(f"  batch {n:>4}: step {p['step_wall_ms']:8.2f} ms wall"
              f" ({p['append_ms']:.2f} append, {p['resolve_ms']:.2f} resolve,"
              f" {p['step_call_ms']:.2f} step()), {p['host_syncs_per_step']} host syncs,"
              f" {C.fmt_bytes(p['bytes_fetched_per_step'])} fetched;"
              f" direct / hot / host {f['direct']:.2f} / {f['hot']:.2f} / {f['host']:.2f}"
              + (f"  ERRORS {p['errors']}" if p["errors"] else ""))
        for site, per in list(p["sync_sites_per_step"].items())[:6]:
            print(f"      {per:6.2f} syncs/step at {site}")
    name = args.name or ("bench_hierarchy_step_smoke" if args.smoke else "bench_hierarchy_step")
    C.write_json(name, dict(meta=meta, config={k: v for k, v in cfg.items()}, miss=args.miss,
                            resident=args.resident, points=points))
    fig, ax = C.new_figure(2, "KVHierarchy decode step (append + resolve + step)", meta)
    xs = [p["batch"] for p in points]
    for key, label in (("step_wall_ms", "whole step"), ("append_ms", "append"),
                       ("resolve_ms", "resolve calls"), ("step_call_ms", "step()")):
        ax[0].plot(xs, [p[key] for p in points], marker="o", label=label)
    ax[0].set_xlabel("active sessions")
    ax[0].set_ylabel("ms per decode step (wall: median; parts: mean)")
    ax[0].set_xscale("log")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=7)
    ax[1].plot(xs, [p["host_syncs_per_step"] for p in points], marker="o")
    ax[1].set_xlabel("active sessions")
    ax[1].set_ylabel("host synchronisations per step")
    ax[1].set_xscale("log")
    C.save_figure(fig, name)
    return 1 if any(p["errors"] for p in points) else 0


if __name__ == "__main__":
    sys.exit(main())
