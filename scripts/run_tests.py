"""``make test``: the whole suite as two pytest processes at once.

    python scripts/run_tests.py [--logs DIR]     # both shards; exit 1 if either fails
    python scripts/run_tests.py -x tests/unit    # other arguments: one pytest run with them

On two cores (CI's machine, ours) the suite run alone keeps about 1.2 of them busy: the
offline engine runs compute on both, but vLLM's imports, server and Ray starts, the waits on
them and the unit tests run on one thread.  So the ``engines`` shard (the E2E modules that
run offline engines, and the kernel tests) runs beside the ``servers`` shard (every other
test: servers, Ray, benchmark smokes, unit tests).  A module's engines and fixtures stay in
one process, so tests that share a run (the resident run of test_fault and
test_window_exact) still share it; a new test file lands in ``servers`` unless listed here.
Each shard writes its own log (``--logs``, default a temporary folder); when both have ended
both logs are printed, one after the other.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# offline engines computing on both cores (tests/e2e/conftest.py's run_offline)
ENGINES = [f"tests/e2e/test_{m}.py" for m in (
    "capacity", "default_paths", "fault", "forkserver", "host_prefix", "load_step",
    "offline_exact", "spec_decode", "spec_hierarchy", "step_budget", "window_exact")] + [
    "tests/kernels"]
PYTEST = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=30"]


def shards() -> dict[str, list[str]]:
    missing = [p for p in ENGINES if not (REPO / p).exists()]
    if missing:
        raise SystemExit(f"run_tests.py names test paths that do not exist: {missing}")
    return {"engines": ENGINES,
            "servers": ["tests", *(f"--ignore={p}" for p in ENGINES)]}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    logs = None
    if argv[:1] == ["--logs"]:  # folder for the shards' logs
        logs, argv = argv[1], argv[2:]
    if argv:  # anything else is pytest's
        return subprocess.call([*PYTEST, *argv], cwd=REPO)
    logs = Path(logs or tempfile.mkdtemp(prefix="dhisparse-tests-"))
    logs.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    procs = {}
    for name, paths in shards().items():
        log = logs / f"{name}.log"
        with open(log, "w") as f:  # the child keeps its own descriptor
            procs[name] = subprocess.Popen([*PYTEST, *paths], cwd=REPO, stdout=f,
                                           stderr=subprocess.STDOUT)
        print(f"[run_tests] shard {name}: {' '.join(p for p in paths if not p.startswith('--'))}"
              f" -> {log}", flush=True)
    codes = {}
    while len(codes) < len(procs):
        for name, proc in procs.items():
            if name not in codes and proc.poll() is not None:
                codes[name] = proc.returncode
                print(f"[run_tests] shard {name} ended (exit {proc.returncode}) after "
                      f"{time.monotonic() - t0:.0f} s", flush=True)
        time.sleep(1)
    for name in procs:
        print(f"\n{'=' * 30} shard {name} (exit {codes[name]}) {'=' * 30}")
        print((logs / f"{name}.log").read_text(), flush=True)
    failed = [n for n, c in codes.items() if c != 0]
    print(f"[run_tests] {time.monotonic() - t0:.0f} s; "
          + (f"FAILED: {', '.join(failed)}" if failed else "both shards passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
