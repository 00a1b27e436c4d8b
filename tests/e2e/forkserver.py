"""A process that imports vLLM once and forks one child per offline run.

Importing vLLM takes about half of a small E2E run's start on two cores (~6.5 s of ~12 s),
and the suite starts dozens of engines.  Each child is a fresh engine in a fresh address
space (copy-on-write of the imported modules only): nothing of one run outlives it, as with
``python -m harness.offline_run`` in its own process.  The server itself runs no engine and
no torch operation, so the children start with no OpenMP pool to inherit.

One server serves one environment: it is started with the exact environment its runs get
(variables read at import time, such as the ISA emulation's ``PYTHONPATH``, see the same
values a fresh process would), and the client keeps one server per environment
(conftest.run_offline).

Protocol, one JSON object per line: the client writes ``{"argv": [...], "out": PATH,
"err": PATH}`` on the server's stdin; the server answers ``{"pid": N}`` when the child
starts and ``{"rc": N}`` when it has ended; the child's stdout and stderr go to the two
files.  ``{"ready": true}`` is the first line, once the imports are done.
"""
from __future__ import annotations

import atexit
import ctypes
import json
import os
import signal
import sys
import threading
import traceback


def _die_with_parent() -> None:
    """SIGKILL when the parent process ends (Linux prctl PR_SET_PDEATHSIG): a test session
    that is killed leaves no server, and a server that is killed no engine."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _child(req: dict) -> None:
    _die_with_parent()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    for fd, path in ((1, req["out"]), (2, req["err"])):
        f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(f, fd)
        os.close(f)
    sys.argv = ["harness/offline_run.py", *req["argv"]]
    rc = 1
    try:
        from harness import offline_run
        rc = offline_run.main(req["argv"]) or 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            rc = e.code or 0
        else:  # as the interpreter does: the message to stderr, exit status 1
            print(e.code, file=sys.stderr)
            rc = 1
    except BaseException:  # noqa: BLE001 -- reported in the run's stderr, as a process would
        traceback.print_exc()
    try:  # what an interpreter's normal exit runs (vLLM's shutdown hooks)
        atexit._run_exitfuncs()
    except BaseException:  # noqa: BLE001
        traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)


def main() -> None:
    # the protocol keeps the pipe the client reads; fd 1 goes to stderr, because vLLM's
    # logger writes to stdout and would interleave with the answers
    _die_with_parent()
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    import vllm  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401
    from harness import offline_run  # noqa: F401
    # a thread would not survive the fork (its locks could be held forever in the child)
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    answers.write(json.dumps({"ready": not threads, "threads": threads}) + "\n")
    if threads:
        return
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            _child(req)
        answers.write(json.dumps({"pid": pid}) + "\n")
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"rc": os.waitstatus_to_exitcode(status)}) + "\n")


if __name__ == "__main__":
    main()
