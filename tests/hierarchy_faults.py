"""Fault injection for the core, on the test side only (the package has no hooks).

``fail_next_backup(host, req_id)``: the next backup of ``req_id``'s rows in ``host``
raises ``HostBackupError``, once.  It wraps that store's ``backup_slices``, where every
backup (one copy, a reclaim's runs, a step's pass over many tails) takes its host
destinations one request at a time, so the failure hits exactly that request's backup
and the tests see whether the others go on.
"""
from __future__ import annotations

from vllm_dhisparse.hierarchy.host_store import HostBackupError, HostStore


class _FailingBackups:
    """``HostStore.backup_slices`` of one store, failing once per request in ``pending``."""

    def __init__(self, host: HostStore):
        self.host = host
        self.backup_slices = host.backup_slices
        self.pending: set[str] = set()

    def __call__(self, req_id: str, firsts: list[int], count: int):
        if req_id in self.pending:
            self.pending.discard(req_id)
            raise HostBackupError(f"host store {self.host.name!r}: backup of request {req_id!r} "
                                  f"failed (injected fault)", req_id=req_id)
        return self.backup_slices(req_id, firsts, count)


def fail_next_backup(host: HostStore, req_id: str) -> None:
    """``host`` refuses the next backup of ``req_id``'s rows, once."""
    faults = vars(host).get("backup_slices")
    if not isinstance(faults, _FailingBackups):
        faults = host.backup_slices = _FailingBackups(host)
    faults.pending.add(req_id)
