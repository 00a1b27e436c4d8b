"""Ray Serve replicas of the P/D app as the fault tests see them: which replica actor runs
an engine, where it runs, how to kill it, and a streaming client that reports how a
stream ended.

An engine is known by the process id in its ``stats_file`` name (``{pid}``); its replica
is the Ray actor among that process's ancestors.  The actor table (Ray's GCS) gives each
replica's name, process and node.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field


def replica_actors(ray, role: str) -> list[dict]:
    """Alive Serve replica actors of ``role`` (``Prefill`` / ``Decode``): name, pid, node."""
    from ray._private.state import actors
    out = []
    for a in actors().values():
        name = a.get("Name") or ""
        if a["State"] == "ALIVE" and name.startswith("SERVE_REPLICA::") and f"#{role}:" in name:
            out.append(dict(name=name, pid=a["Pid"], node=a["Address"]["NodeID"]))
    return out


def replica_of(ray, role: str, engine_pid: int) -> dict:
    """The replica actor whose process started the engine process ``engine_pid``."""
    import psutil
    ancestors = {p.pid for p in psutil.Process(engine_pid).parents()}
    found = [a for a in replica_actors(ray, role) if a["pid"] in ancestors]
    assert len(found) == 1, f"engine {engine_pid}: replica actors among its parents: {found}"
    return found[0]


def kill_replica(ray, actor: dict, engine_pid: int, timeout_s: float = 60) -> None:
    """Kills the replica actor (as a crash would: no graceful shutdown) and waits, bounded,
    until its engine process is gone too."""
    import psutil
    ray.kill(ray.get_actor(actor["name"], namespace="serve"), no_restart=True)
    try:
        psutil.Process(engine_pid).wait(timeout=timeout_s)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        raise AssertionError(f"engine {engine_pid} of killed replica {actor['name']} still "
                             f"runs after {timeout_s:.0f} s") from None


def cpu_seconds(pid: int) -> float:
    import psutil
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


@dataclass
class Stream:
    """One streamed completion: what arrived and how it ended."""
    chunks: int = 0
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False  # the server sent ``data: [DONE]``
    error: str | None = None  # HTTP error, error chunk or broken connection
    first_chunk_at: float | None = None
    ended_at: float | None = None


def stream_completion(url: str, body: dict, out: Stream, read_timeout_s: float = 120) -> None:
    """Reads one SSE completion stream into ``out``; returns when it ends in any way (every
    socket read is bounded by ``read_timeout_s``)."""
    req = urllib.request.Request(url, data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=read_timeout_s) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    break
                chunk = json.loads(line[len("data: "):])
                if "error" in chunk:
                    out.error = json.dumps(chunk["error"])[:500]
                    break
                out.chunks += 1
                out.first_chunk_at = out.first_chunk_at or time.time()
                for c in chunk.get("choices", []):
                    out.token_ids += c.get("token_ids") or []
                    out.finish_reason = c.get("finish_reason") or out.finish_reason
    except urllib.error.HTTPError as e:
        out.error = f"HTTP {e.code}: {e.read()[:500]!r}"
    except Exception as e:  # noqa: BLE001 -- a broken stream is an outcome here
        out.error = f"{type(e).__name__}: {e}"
    out.ended_at = time.time()


def wait_for(cond, timeout_s: float, what: str, poll_s: float = 0.1):
    """Polls ``cond()`` until it returns a true value (returned), at most ``timeout_s``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(poll_s)
    raise AssertionError(f"not within {timeout_s:.0f} s: {what}")


def pid_of(stats_path: str) -> int:
    """The engine process id in a ``stats_file`` name written with ``{pid}``."""
    return int(os.path.basename(stats_path).rsplit("_", 1)[1].split(".")[0])
