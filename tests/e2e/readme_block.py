"""The documented two-server P/D block (docs/pd_handoff.md, which README's P/D section
points to) as the tests run it: the block's text, bash running it
with its servers in the background (one process group), and what the servers report.

The block ends after its last request; its servers keep running until ``stop_group``.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request

from .conftest import REPO


def readme_pd_block() -> str:
    """The first bash block of docs/pd_handoff.md: two servers and a router's two
    requests."""
    readme = open(os.path.join(REPO, "README.md")).read()
    assert "docs/pd_handoff.md" in readme.split("## Prefill/decode disaggregation", 1)[1]
    text = open(os.path.join(REPO, "docs", "pd_handoff.md")).read()
    block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    assert "kv_producer" in block and "kv_consumer" in block, block
    return block


def metric(text: str, name: str, source: str | None = None) -> float:
    """Sum of a Prometheus metric's samples (``source`` label, if given)."""
    total = 0.0
    for m in re.finditer(rf"^{re.escape(name)}(?:_total)?(\{{[^}}]*\}})? (\S+)$", text, re.M):
        if source is None or f'source="{source}"' in (m.group(1) or ""):
            total += float(m.group(2))
    return total


def post_json(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.load(r)


def run_block(block: str, log, env: dict, cwd) -> subprocess.Popen:
    """Starts ``bash -c block`` in a session of its own (its process group holds the
    servers it puts in the background), output to ``log``."""
    with open(log, "w") as out:
        return subprocess.Popen(["bash", "-c", block], stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=cwd, start_new_session=True)


def completions_in(text: str) -> list[dict]:
    """The completion answers (JSON) printed in the block's output."""
    return [json.JSONDecoder().raw_decode(text[m.start():])[0]
            for m in re.finditer(r'\{"id":"cmpl-', text)]


def wait_for_block(shell: subprocess.Popen, log, timeout_s: float = 900) -> None:
    """Until the block's shell exits; fails early when one of its servers has died (its
    health loop would wait forever).  The servers are found by process group: the shell
    that started them may be gone already."""
    import psutil
    deadline, started = time.time() + timeout_s, time.time()
    while shell.poll() is None:
        servers = 0
        for p in psutil.process_iter(["cmdline"]):
            try:
                servers += os.getpgid(p.pid) == shell.pid and \
                    "api_server" in " ".join(p.info["cmdline"] or [])
            except ProcessLookupError:  # ended while we looked
                pass
        assert servers == 2 or time.time() - started < 60, \
            f"a server of the README block exited:\n{log.read_text()[-6000:]}"
        assert time.time() < deadline, f"README block still running after {timeout_s:.0f} s"
        time.sleep(2)


def stop_group(pgid: int, grace_s: float = 30) -> None:
    """SIGTERM the process group (the servers the block put in the background), SIGKILL
    what is left after ``grace_s``."""
    try:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.time() + grace_s
        while time.time() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.5)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
