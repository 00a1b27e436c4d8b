"""The hierarchy through a load step (admissions that reclaim, then repopulation) at DeepSeek-V4.1-Flash shapes.

    python3 benchmarks/bench_hierarchy_load.py                          # H200, full sizes
    TRITON_INTERPRET=1 python benchmarks/bench_hierarchy_load.py --smoke   # CPU, tiny

Shapes, selections and the decode step are those of ``bench_hierarchy_step.py``
(four sources, k = 512, 584-byte rows in two planes, five resolve calls on ``c4a``
and one on each other source, a row appended per source every ``--compress``
steps, ``--miss`` of k fresh host rows per call).  ``--batch`` sessions are
admitted with ``--history`` rows per source into device pools with room for
``--resident`` of that history beyond the required pages, so optional history
fills the spare pages; then three phases:

* base: decode steps of the base sessions;
* burst: ``--burst`` sessions with the same history arrive together.  Each
  admission needs required pages the pool does not have free: it reclaims whole
  requests' optional history (eq. 4, largest first), backing up device-only pages
  first, and places its own history resident-first, the rest on host.  Then
  decode steps of every session;
* drain: the burst sessions finish, and the base sessions decode while ``step()``
  repopulates the reclaimed history (``--repopulate`` pages per source and step)
  until coverage (ready optional rows / eligible history rows) is back to its
  base value, or ``--drain-steps``.

Checked: every ``--check-every``-th step of each phase reads the bytes at every
location of sampled base and burst sessions against the truth (eq. 12); checked
steps are not timed.  Timed: each admission and each finish (wall clock,
synchronised, host synchronisations, pages reclaimed, bytes written to host), and
each decode step (wall clock, host synchronisations, bytes fetched, coverage,
pages repopulated).  Results: ``results/bench_hierarchy_load.{json,png}``.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hierarchy_step as S  # noqa: E402
import common as C  # noqa: E402

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy  # noqa: E402

FULL = dict(S.FULL, batch=512, burst=64, steps=8, drain_steps=1200, check_every=8, cycle=8)
SMOKE = dict(S.SMOKE, batch=4, burst=2, steps=3, drain_steps=12, check_every=2, cycle=2)


def build(cfg: dict, dev: torch.device, resident: float, repopulate: int):
    """The hierarchy with the base sessions admitted, and the truth of every session
    (base and burst): ``truth[source][i]`` is session ``s{i}``'s rows."""
    n, m, ps, hist = cfg["batch"], cfg["burst"], cfg["page_size"], cfg["history"]
    steps = 2 * cfg["steps"] + cfg["drain_steps"]
    max_rows = hist + steps // cfg["compress"] + 2 * ps
    specs = []
    for name, budget in zip(S.SOURCES, cfg["budgets"]):
        per_req = -(-budget // ps) + 2  # hot, tail
        specs.append(dict(name=name, row_bytes=cfg["row_bytes"], page_size=ps,
                          device_pages=n * per_req + int(resident * n * (hist // ps)),
                          host_rows=(n + m) * max_rows, hot_cache_rows=budget, tail_pages=2,
                          max_req_slots=n + m, max_rows=max_rows,
                          plane_bytes=cfg["plane_bytes"]))
    h = KVHierarchy(specs, device=dev, repopulate_pages_per_step=repopulate)
    g = torch.Generator(device=dev).manual_seed(n)
    truth = {s: torch.randint(0, 256, (n + m, max_rows, cfg["row_bytes"]), generator=g,
                              dtype=torch.uint8, device=dev) for s in S.SOURCES}
    ids = [f"s{i}" for i in range(n + m)]
    lens = S.history_lengths(cfg, n + m)  # staggered: tail pages complete in different steps
    for i in range(n):
        assert h.admit(ids[i], max_rows, {s: truth[s][i, :lens[i]] for s in S.SOURCES}), ids[i]
    return h, ids, truth, max_rows, lens


def coverage(h) -> float:
    st = h.stats()["sources"]
    eligible = sum(p["eligible_history_rows"] for p in st.values())
    return sum(p["ready_optional_rows"] for p in st.values()) / max(1, eligible)


def totals(h) -> dict:
    out = dict.fromkeys(("direct", "hot", "host", "bytes_fetched", "pages_reclaimed",
                         "pages_repopulated", "host_pages_written"), 0)
    for p in h.sources.values():
        t = p.resolver.totals()
        for f in ("direct", "hot", "host", "bytes_fetched"):
            out[f] += getattr(t, f)
        for f in ("pages_reclaimed", "pages_repopulated", "host_pages_written"):
            out[f] += getattr(p.residency.counters, f)
    return out


class Phase:
    """The selections of one phase's batch, drawn before timing (generation is not the
    hierarchy's); calls cycle through ``cfg['cycle']`` drawn steps."""

    def __init__(self, h, cfg, ids, miss, dev, seed, rows: int, graph: bool = False):
        """``rows``: selections draw from the first ``rows`` rows (every session has them).
        ``graph``: the phase's resolve calls are captured in one CUDA graph (as vLLM
        captures a decode step) and each step replays it; no slot may open or close
        while the phase runs."""
        self.ids = ids
        self.calls = {}
        for key, plan in S.selection_plan(h, cfg, ids, seed).items():
            self.calls[key] = [S.selections(cfg, plan, rows, miss, seed * 100 + j, dev)
                               for j in range(cfg["cycle"])]
        self.graph = S.capture_resolves(h, cfg, ids, {k: (None, None, None, c) for k, c in
                                                      self.calls.items()}) if graph else None


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def decode_step(h, cfg, phase: Phase, truth, step_no: int, dev, positions) -> str | None:
    """Appends (every ``compress`` steps, at each session's own length), the step's
    resolve calls, ``step()``; ``positions``: sessions whose locations are checked."""
    ids = phase.ids
    if step_no % cfg["compress"] == 0:
        who = torch.arange(len(ids), device=dev)
        for s in S.SOURCES:
            st = h.source(s).state
            pos = torch.from_numpy(st.seq_lens_of(st.req_slot_array(ids))).to(dev, non_blocking=True)
            failed = h.append_batch(s, ids, truth[s][who, pos])
            if failed:
                raise RuntimeError(f"append_batch to {s} failed for {failed}")
    err = None
    if phase.graph is not None:
        g, inputs, outputs, stacked, slots = phase.graph
        for s, captured in slots.items():
            if h.source(s).state.req_slot_tensor(ids) is not captured:
                raise RuntimeError(f"{s}: the batch's slot tensor changed since capture")
        inputs.copy_(stacked[step_no % stacked.shape[0]])
        g.replay()
        for i, key in enumerate(phase.calls):
            if positions and err is None:
                err = S.check_locations(h, key[0], ids, inputs[i], outputs[i], truth, positions)
    for key, calls in phase.calls.items() if phase.graph is None else ():
        sel = calls[step_no % len(calls)]
        loc, _ = h.resolve(key[0], ids, sel, validate=False)
        if positions and err is None:
            err = S.check_locations(h, key[0], ids, sel, loc, truth, positions)
    h.step()
    bad = {s: n for s, n in h.invalid_selections().items() if n}  # one host read per step
    return err or (f"invalid selections (resolved as padding): {bad}" if bad else None)


def run_steps(h, cfg, phase, truth, first: int, count: int, dev, positions, name: str,
              sites: Counter, stop_at: float | None = None):
    """``count`` decode steps (fewer when coverage reaches ``stop_at``); returns
    (per-step records, errors).  ``sites`` counts the unchecked steps' sync sites."""
    records, errors = [], []
    for j in range(count):
        no = first + j
        checked = j % cfg["check_every"] == 0
        before = totals(h)
        sync(dev)
        t0 = time.perf_counter()
        with S.SyncCounter(None if checked else sites) as sc:
            err = decode_step(h, cfg, phase, truth, no, dev, positions if checked else ())
            sync(dev)
        wall = time.perf_counter() - t0
        if err:
            errors.append(f"{name} step {j}: {err}")
        after = totals(h)
        d = {k: after[k] - before[k] for k in after}
        sel = max(1, d["direct"] + d["hot"] + d["host"])
        records.append(dict(phase=name, step=no, checked=checked, sessions=len(phase.ids),
                            wall_ms=wall * 1e3, host_syncs=sc.count,
                            bytes_fetched=d["bytes_fetched"], host_share=d["host"] / sel,
                            pages_repopulated=d["pages_repopulated"], coverage=coverage(h)))
        if stop_at is not None and records[-1]["coverage"] >= stop_at:
            break
    return records, errors


def timed(dev, fn, sites: Counter):
    sync(dev)
    t0 = time.perf_counter()
    with S.SyncCounter(sites) as sc:
        out = fn()
        sync(dev)
    return out, (time.perf_counter() - t0) * 1e3, sc.count


def profiler(dev, on: bool):
    if not on:
        return contextlib.nullcontext()
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []))


def run(cfg: dict, miss: float, dev, resident: float, repopulate: int,
        profile: bool = False, graph: bool = False) -> dict:
    """The three phases; with ``profile`` the burst's admissions and the drain run under
    torch.profiler (``profiles``: part -> profiler); with ``graph`` each phase's resolve
    calls replay one CUDA graph (appends and ``step()`` stay eager, as in vLLM)."""
    n, m = cfg["batch"], cfg["burst"]
    h, ids, truth, max_rows, lens = build(cfg, dev, resident, repopulate)
    rows = min(lens)
    sample = cfg["check_sessions"]
    base_pos = list(range(min(sample, n)))
    base = Phase(h, cfg, ids[:n], miss, dev, seed=1, rows=rows, graph=graph)
    records, errors = [], []
    sites = {k: Counter() for k in ("base", "admission", "burst", "finish", "drain")}
    r, e = run_steps(h, cfg, base, truth, 0, cfg["steps"], dev, base_pos, "base", sites["base"])
    records += r
    errors += e
    base_coverage = coverage(h)
    no = cfg["steps"]

    admissions = []
    prof_adm, prof_drain = profiler(dev, profile), profiler(dev, profile)
    with prof_adm:
        for i in range(n, n + m):
            before = totals(h)
            ok, ms, syncs = timed(dev, lambda: h.admit(ids[i], max_rows,
                                                       {s: truth[s][i, :lens[i]]
                                                        for s in S.SOURCES}),
                                  sites["admission"])
            if not ok:
                errors.append(f"burst: admission of {ids[i]} waited (pool too small for the "
                              f"burst)")
                break
            d = {k: v - before[k] for k, v in totals(h).items()}
            admissions.append(dict(session=ids[i], wall_ms=ms, host_syncs=syncs,
                                   pages_reclaimed=d["pages_reclaimed"],
                                   bytes_to_host=d["host_pages_written"] * cfg["page_size"]
                                   * cfg["row_bytes"]))
    burst_coverage = coverage(h)
    all_pos = base_pos + list(range(n, n + min(sample, len(admissions))))
    everyone = Phase(h, cfg, ids[:n + len(admissions)], miss, dev, seed=2, rows=rows,
                     graph=graph)
    r, e = run_steps(h, cfg, everyone, truth, no, cfg["steps"], dev, all_pos, "burst",
                     sites["burst"])
    records += r
    errors += e
    no += cfg["steps"]

    finishes = []
    for i in range(n, n + len(admissions)):
        _, ms, syncs = timed(dev, lambda: h.finish(ids[i]), sites["finish"])
        finishes.append(dict(session=ids[i], wall_ms=ms, host_syncs=syncs))
    drain = Phase(h, cfg, ids[:n], miss, dev, seed=3, rows=rows, graph=graph)
    with prof_drain:
        r, e = run_steps(h, cfg, drain, truth, no, cfg["drain_steps"], dev, base_pos, "drain",
                         sites["drain"], stop_at=base_coverage)
    records += r
    errors += e
    timed_of = {p: sum(1 for x in records if x["phase"] == p and not x["checked"])
                for p in ("base", "burst", "drain")}
    per = dict(timed_of, admission=len(admissions), finish=len(finishes))
    return dict(records=records, admissions=admissions, finishes=finishes, errors=errors,
                sync_sites_per_event={k: S.top_sites(c, per[k]) for k, c in sites.items()},
                coverage=dict(base=base_coverage, after_burst=burst_coverage,
                              end=coverage(h)),
                drain_steps_to_recover=len(r) if r and r[-1]["coverage"] >= base_coverage
                else None,
                **(dict(profiles=dict(admission=prof_adm, drain=prof_drain)) if profile else {}))


def summary(result: dict) -> dict:
    med = lambda xs: sorted(xs)[len(xs) // 2] if xs else None  # noqa: E731
    out = {}
    for phase in ("base", "burst", "drain"):
        rec = [r for r in result["records"] if r["phase"] == phase and not r["checked"]]
        out[phase] = dict(step_ms_median=med([r["wall_ms"] for r in rec]),
                          step_ms_max=max((r["wall_ms"] for r in rec), default=None),
                          host_syncs_median=med([r["host_syncs"] for r in rec]),
                          host_share_mean=sum(r["host_share"] for r in rec) / max(1, len(rec)),
                          timed_steps=len(rec))
    adm = result["admissions"]
    out["admission_ms_median"] = med([a["wall_ms"] for a in adm])
    out["admission_ms_max"] = max((a["wall_ms"] for a in adm), default=None)
    out["admission_host_syncs_median"] = med([a["host_syncs"] for a in adm])
    out["pages_reclaimed"] = sum(a["pages_reclaimed"] for a in adm)
    out["finish_ms_median"] = med([f["wall_ms"] for f in result["finishes"]])
    return out


def plot(result: dict, meta: dict, name: str) -> None:
    fig, ax = C.new_figure(3, "KVHierarchy through a load step (burst of admissions, then drain)",
                           meta)
    rec = result["records"]
    colors = {"base": "tab:blue", "burst": "tab:red", "drain": "tab:green"}
    for phase, c in colors.items():
        xs = [r["step"] for r in rec if r["phase"] == phase and not r["checked"]]
        ys = [r["wall_ms"] for r in rec if r["phase"] == phase and not r["checked"]]
        ax[0].plot(xs, ys, ".", color=c, label=phase)
    ax[0].set_xlabel("decode step")
    ax[0].set_ylabel("ms per step (wall, unchecked steps)")
    ax[0].set_yscale("log")
    ax[0].legend(fontsize=7)
    xs = [r["step"] for r in rec]
    ax[1].plot(xs, [r["coverage"] for r in rec], label="coverage (ready / eligible history)")
    ax[1].plot(xs, [r["host_share"] for r in rec], label="host-fetched share of selections")
    ax[1].set_xlabel("decode step")
    ax[1].set_ylim(0, 1.05)
    ax[1].legend(fontsize=7)
    adm = result["admissions"]
    ax[2].bar(range(len(adm)), [a["wall_ms"] for a in adm], color="tab:red")
    ax[2].set_xlabel("admission in the burst")
    ax[2].set_ylabel("ms (wall, reclaim + placement, all sources)")
    C.save_figure(fig, name)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU, interpreter)")
    ap.add_argument("--batch", type=int, help="base sessions")
    ap.add_argument("--burst", type=int, help="sessions that arrive together")
    ap.add_argument("--history", type=int, help="rows of imported history per session and source")
    ap.add_argument("--miss", type=float, default=0.05, help="host misses, fraction of k")
    ap.add_argument("--resident", type=float, default=0.7,
                    help="device room beyond required pages for this fraction of the base "
                         "sessions' history")
    ap.add_argument("--repopulate", type=int, default=16,
                    help="repopulate_pages_per_step (pages per source and step)")
    ap.add_argument("--compress", type=int, default=4, help="decode steps per appended row")
    ap.add_argument("--drain-steps", type=int, help="most decode steps after the burst")
    ap.add_argument("--name", default=None, help="results file stem")
    ap.add_argument("--profile", action="store_true",
                    help="run under torch.profiler and write its op tables next to the JSON "
                         "(times are then the profiler's, not for the record)")
    ap.add_argument("--graph", action="store_true",
                    help="each phase's resolve calls captured in one CUDA graph and replayed "
                         "every step (as vLLM runs decode steps); appends, step() and "
                         "admissions stay eager")
    args = ap.parse_args(argv)
    cfg = dict(SMOKE if args.smoke else FULL, compress=args.compress, graph=args.graph)
    for key in ("batch", "burst", "history", "drain_steps"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    if cfg["batch"] < 1 or cfg["burst"] < 1:
        ap.error(f"--batch {cfg['batch']} and --burst {cfg['burst']} must be >= 1")
    dev = C.device()
    if args.graph and dev.type != "cuda":
        ap.error("--graph needs a CUDA device")
    meta = C.metadata()
    print(f"# bench_hierarchy_load on {meta['device']} ({meta['date_utc']}): {cfg['batch']} "
          f"sessions + a burst of {cfg['burst']}, history {cfg['history']} rows, miss {args.miss:.0%}")
    name = args.name or ("bench_hierarchy_load_smoke" if args.smoke else "bench_hierarchy_load")
    result = run(cfg, args.miss, dev, args.resident, args.repopulate, profile=args.profile,
                 graph=args.graph)
    if args.profile:
        with open(C.RESULTS / f"{name}_profile.txt", "w") as f:
            for part, prof in result.pop("profiles").items():
                table = prof.key_averages()
                for key in ("self_cpu_time_total",) + (
                        ("self_cuda_time_total",) if dev.type == "cuda" else ()):
                    f.write(f"# {part}, sorted by {key}\n{table.table(sort_by=key, row_limit=30)}\n")
    result["summary"] = summary(result)
    C.write_json(name, dict(meta=meta, config=cfg, miss=args.miss, resident=args.resident,
                            profiled=args.profile,
                            repopulate=args.repopulate, **result))
    s, cov = result["summary"], result["coverage"]
    ms = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731 -- a phase may time no step
    for phase in ("base", "burst", "drain"):
        p = s[phase]
        print(f"  {phase:>5}: step median {ms(p['step_ms_median'])} ms (max "
              f"{ms(p['step_ms_max'])}), {p['host_syncs_median']} host syncs, host share "
              f"{p['host_share_mean']:.3f}, {p['timed_steps']} timed steps")
    print(f"  admissions: median {ms(s['admission_ms_median'])} ms (max "
          f"{ms(s['admission_ms_max'])}), {s['admission_host_syncs_median']} host syncs, "
          f"{s['pages_reclaimed']} pages reclaimed; finishes: median {ms(s['finish_ms_median'])} ms")
    print(f"  coverage: base {cov['base']:.3f}, after the burst {cov['after_burst']:.3f}, end "
          f"{cov['end']:.3f}; drain steps to recover: {result['drain_steps_to_recover']}"
          + (f"  ERRORS {result['errors']}" if result["errors"] else ""))
    for event, sites in result["sync_sites_per_event"].items():
        for site, per in list(sites.items())[:6]:
            print(f"      {event:>9}: {per:6.2f} syncs at {site}")
    plot(result, meta, name)
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
