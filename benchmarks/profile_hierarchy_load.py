"""Where the host time of the load step goes: cProfile of the burst's admissions and of
the drain's ``step()`` calls, on the run ``bench_hierarchy_load.py`` makes.

    python3 benchmarks/profile_hierarchy_load.py --graph --drain-steps 300

The GPU waits for the host in both (``bench_hierarchy_load_*_profile.txt``), so the
host's Python frames are what to read: cumulative time per function of the
hierarchy, per admission and per drain step.  Also lists the slowest drain
``step()`` calls with what each did (pages repopulated, pages published, tail
pages backed up).  Times are cProfile's (inflated), for attribution only; the
record is ``bench_hierarchy_load.py``.  Output: ``results/<name>.txt``.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hierarchy_load as L  # noqa: E402
import common as C  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--graph", action="store_true", help="as bench_hierarchy_load --graph")
    ap.add_argument("--drain-steps", type=int, default=300)
    ap.add_argument("--name", default="profile_hierarchy_load")
    args = ap.parse_args(argv)
    cfg = dict(L.SMOKE if args.smoke else L.FULL, compress=4, graph=args.graph,
               drain_steps=args.drain_steps)
    dev = C.device()
    prof = {"admission": cProfile.Profile(), "drain": cProfile.Profile()}
    phase = {"now": None}
    steps = []
    admit, step, run_steps = L.KVHierarchy.admit, L.KVHierarchy.step, L.run_steps

    def admit_profiled(self, *a, **k):
        if phase["now"] != "burst":
            return admit(self, *a, **k)
        prof["admission"].enable()
        try:
            return admit(self, *a, **k)
        finally:
            prof["admission"].disable()

    def step_profiled(self):
        if phase["now"] != "drain":
            return step(self)
        before = L.totals(self)
        t0 = time.perf_counter()
        prof["drain"].enable()
        try:
            step(self)
        finally:
            prof["drain"].disable()
            ms = (time.perf_counter() - t0) * 1e3
            d = {k: v - before[k] for k, v in L.totals(self).items()}
            steps.append(dict(ms=ms, repopulated=d["pages_repopulated"],
                              backed_up=d["host_pages_written"], step=self.step_index))

    def run_steps_tracked(h, cfg_, ph, truth, first, count, dev_, positions, name, *a, **k):
        phase["now"] = name
        try:
            return run_steps(h, cfg_, ph, truth, first, count, dev_, positions, name, *a, **k)
        finally:  # the burst's admissions come right after the base phase's steps
            phase["now"] = "burst" if name == "base" else None

    L.KVHierarchy.admit, L.KVHierarchy.step, L.run_steps = (admit_profiled, step_profiled,
                                                            run_steps_tracked)
    try:
        result = L.run(cfg, 0.05, dev, 0.7, 16, graph=args.graph)
    finally:
        L.KVHierarchy.admit, L.KVHierarchy.step, L.run_steps = admit, step, run_steps
    out = io.StringIO()
    n_adm = len(result["admissions"])
    out.write(f"# {C.metadata().get('device')}, graph={args.graph}: {n_adm} admissions, "
              f"{len(steps)} drain step() calls\n")
    for part, p in prof.items():
        per = n_adm if part == "admission" else len(steps)
        out.write(f"\n## {part}, cumulative (divide by {per})\n")
        pstats.Stats(p, stream=out).sort_stats("cumulative").print_stats(40)
        out.write(f"\n## {part}, own time\n")
        pstats.Stats(p, stream=out).sort_stats("tottime").print_stats(25)
    slow = sorted(steps, key=lambda s: -s["ms"])[:20]
    out.write("\n## slowest drain step() calls\n")
    for s in slow:
        out.write(f"step {s['step']}: {s['ms']:.2f} ms, {s['repopulated']} pages published, "
                  f"{s['backed_up']} pages backed up\n")
    med = sorted(s["ms"] for s in steps)[len(steps) // 2] if steps else None
    out.write(f"median step() {med} ms\n")
    path = C.RESULTS / f"{args.name}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(out.getvalue())
    print(out.getvalue()[:3000])
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
