"""A failure in one request's hierarchy work fails that request alone.

Admission, committing rows, resolving and host backups run per request inside
:meth:`Failures.isolated`: an exception there marks the request failed, releases it
from the hierarchy and records why; every other request goes on.  The worker
reports the failed requests to the scheduler in its connector worker metadata
(``take_unreported``), and the connector's scheduler finishes them with an error
(scheduler.py).
"""
from __future__ import annotations

import contextlib

from vllm.logger import init_logger

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.host_store import HostBackupError

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


class Failures:
    def __init__(self, hierarchy: KVHierarchy, requests: dict):
        self.hierarchy = hierarchy
        self.requests = requests  # request id -> TrackedRequest (the worker's table)
        self.failed: dict[str, str] = {}  # request id -> why, until the request ends
        self.unreported: dict[str, str] = {}  # for the scheduler's next output
        self.total = 0

    @contextlib.contextmanager
    def isolated(self, req):
        """Per-request hierarchy work: an exception fails this request alone (finish
        reason ``error``); the hierarchy releases it, every other request goes on."""
        try:
            yield
        except HostBackupError as e:
            self.fail(req, str(e))
        except Exception as e:  # noqa: BLE001 -- isolation is the point; logged in full
            logger.exception("DHiSparse: request %s: hierarchy work failed", req.req_id)
            self.fail(req, f"{type(e).__name__}: {e}")
        finally:
            self.take_hierarchy_failures()

    def take_hierarchy_failures(self) -> None:
        """Requests the hierarchy released on its own (a victim whose deferred backup
        failed during another request's admission, a failed tail backup)."""
        for rid, why in self.hierarchy.take_failures().items():
            req = self.requests.get(rid)
            if req is not None:
                req.admitted = False  # already released
                self.fail(req, why)

    def fail(self, req, why: str) -> None:
        """The request cannot be served exactly any more: it fails alone."""
        if req.failed:
            return
        req.failed = why
        self.failed[req.req_id] = why
        self.unreported[req.req_id] = why
        self.total += 1
        if req.admitted and req.req_id in self.hierarchy.requests:
            self.hierarchy.preempt(req.req_id)
        req.admitted = False
        logger.error("DHiSparse: request %s failed: %s", req.req_id, why)

    def forget(self, req_id: str) -> None:
        """The request ended (finished, preempted)."""
        self.failed.pop(req_id, None)

    def take_unreported(self) -> dict[str, str]:
        out, self.unreported = self.unreported, {}
        return out
