"""Fault injection for the worker half, on the test side only (the package has no hooks).

A fault is ``POINT:PREFIX``: requests whose id starts with PREFIX fail at POINT.

* ``admit``: the request's admission into the hierarchy raises;
* ``append``: committing the request's rows raises;
* ``resolve``: the request's share of a layer's resolve raises;
* ``backup``: the request's first host backup fails (``HostBackupError``);
* ``corrupt`` (no prefix): one resolved location of every layer call points at another
  selected row, so outputs must differ from resident serving (the tests can fail);
* ``scramble`` (no prefix): every resolved location points half the storage away, at
  rows of other positions or requests (the needle benchmark's control: retrieval must
  fail when the mapping is wrong, not only the logprobs change).

Unit tests build a worker half with :func:`faulty_worker_side` and their faults.  E2E runs select
:class:`FaultInjectingConnector` (``offline_run --connector-class
tests.fault_injection:FaultInjectingConnector``) and pass the faults in
``DHISPARSE_TEST_FAULTS`` (comma-separated, read in the engine's process).
"""
from __future__ import annotations

import functools
import os

import torch

from vllm_dhisparse.hierarchy.host_store import HostBackupError
from vllm_dhisparse.integration.worker.admission import Admissions
from vllm_dhisparse.integration.connector import DHiSparseConnector
from vllm_dhisparse.integration.layers.step_context import StepContext
from vllm_dhisparse.integration.worker.worker_side import WorkerSide

from tests.hierarchy_faults import fail_next_backup

POINTS = ("admit", "append", "resolve", "backup", "corrupt", "scramble")
GLOBAL = ("corrupt", "scramble")  # points that take no request prefix
ENV = "DHISPARSE_TEST_FAULTS"


def parse(value: str) -> dict[str, tuple[str, ...]]:
    """``"admit:r2,backup:r1,corrupt"`` -> {point: request id prefixes}."""
    out: dict[str, tuple[str, ...]] = {}
    for item in filter(None, (v.strip() for v in value.split(","))):
        point, _, prefix = item.partition(":")
        if point not in POINTS or (point not in GLOBAL and not prefix):
            raise ValueError(f"fault {item!r}: expected POINT:PREFIX, POINT one of {POINTS}")
        out[point] = out.get(point, ()) + (prefix,)
    return out


def _hit(faults: dict, point: str, req_id: str) -> bool:
    return any(req_id.startswith(p) for p in faults.get(point, ()))


def _raise(point: str) -> None:
    raise RuntimeError(f"injected {point} failure")


class FaultyAdmissions(Admissions):
    def __init__(self, *args, faults: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults

    def admit(self, req):
        if _hit(self.faults, "admit", req.req_id):
            _raise("admit")
        if _hit(self.faults, "backup", req.req_id):
            for name in self.layers:
                fail_next_backup(self.hierarchy.source(name).host, req.req_id)
        return super().admit(req)

    def commit(self, req):
        if _hit(self.faults, "append", req.req_id):
            _raise("append")
        return super().commit(req)


class FaultyContext(StepContext):
    def __init__(self, *args, faults: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults

    def fresh_selections(self, req, *args):
        if _hit(self.faults, "resolve", req.req_id):
            _raise("resolve")
        return super().fresh_selections(req, *args)

    def resolve(self, *args, **kwargs):
        locs = super().resolve(*args, **kwargs)
        if "corrupt" in self.faults:
            corrupt_one(locs)
        if "scramble" in self.faults:
            scramble(locs)
        return locs


def corrupt_one(locs: torch.Tensor) -> None:
    """Points one selection at another selected row."""
    flat = locs.view(-1)
    valid = (flat >= 0).nonzero().flatten()
    if valid.numel() >= 2:
        a, b = int(valid[0]), int(valid[1])
        if int(flat[a]) != int(flat[b]):
            flat[a] = flat[b]


def scramble(locs: torch.Tensor) -> None:
    """Every valid location moves half the used storage rows away (wrapping)."""
    valid = locs >= 0
    if valid.any():
        rows = int(locs.max()) + 1
        locs.copy_(torch.where(valid, (locs + max(1, rows // 2)) % rows, locs))


def faulty_locations(locations, faults: dict):
    """The routed FlashMLA decode's ``locations`` (CUDA, flashmla/decode.py) with the
    global location faults applied; eager runs only (the faults read the device)."""
    @functools.wraps(locations)
    def wrapped(*args, **kwargs):
        locs, lens = locations(*args, **kwargs)
        locs = locs.clone()
        if "corrupt" in faults:
            corrupt_one(locs)
        if "scramble" in faults:
            scramble(locs)
        return locs, lens
    return wrapped


class FaultyWorkerSide(WorkerSide):
    """Location faults reach the routed decode where it resolves on the device (CUDA);
    the CPU layers resolve through :class:`FaultyContext`."""

    def __init__(self, *args, faults: dict, **kwargs):
        super().__init__(*args, **kwargs)
        self.faults = faults

    def register_kv_caches(self, *args, **kwargs) -> None:
        super().register_kv_caches(*args, **kwargs)
        binding = getattr(self.decode, "binding", None)
        if binding is not None and any(p in self.faults for p in GLOBAL):
            for routed in binding.routed.values():
                routed.locations = faulty_locations(routed.locations, self.faults)


def faulty_worker_side(*args, faults: dict, **kwargs) -> WorkerSide:
    """A worker half whose admission, commits and resolves fail where ``faults`` say."""
    return FaultyWorkerSide(*args, faults=faults,
                            context_cls=functools.partial(FaultyContext, faults=faults),
                            admissions_cls=functools.partial(FaultyAdmissions, faults=faults),
                            **kwargs)


class FaultInjectingConnector(DHiSparseConnector):
    """DHiSparseConnector whose worker half injects the faults of ``DHISPARSE_TEST_FAULTS``."""

    def new_worker_side(self, *args, **kwargs) -> WorkerSide:
        return faulty_worker_side(*args, faults=parse(os.environ.get(ENV, "")), **kwargs)


__all__ = ["FaultInjectingConnector", "HostBackupError", "faulty_worker_side", "parse"]
