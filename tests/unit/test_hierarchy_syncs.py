"""The hierarchy's load path never waits for the device.

Admissions that reclaim, finishes, appends, resolves without the per-call check, and
``step()`` with backups and repopulation run under torch's sync debug mode set to
"error": any call that synchronises the host with the device (an ``.item()``, a copy
of a Python scalar into a device tensor, a blocking host-to-device copy) raises.
Waiting on a copy's event (a reclaim's backups) is not such a call.  On CPU the same
flow runs without the mode and checks only that repopulated pages hold their rows.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy

DEV = "cuda" if torch.cuda.is_available() else "cpu"
PS, HIST, N = 16, 256, 6  # max_rows leaves room for 4 pages of appends


@contextlib.contextmanager
def no_sync():
    if DEV == "cpu":
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def build():
    max_rows = HIST + 8 * PS
    specs = [dict(name=name, row_bytes=24, page_size=PS, plane_bytes=planes,
                  device_pages=N * 4 + 2 * HIST // PS, host_rows=(N + 1) * max_rows,
                  hot_cache_rows=2 * PS, tail_pages=2, max_req_slots=N + 1, max_rows=max_rows)
             for name, planes in (("one", None), ("two", (16, 8)))]
    h = KVHierarchy(specs, device=DEV, repopulate_pages_per_step=4)
    g = torch.Generator(device=DEV).manual_seed(0)
    truth = torch.randint(0, 256, (N + 2, max_rows, 24), generator=g, dtype=torch.uint8,
                          device=DEV)
    return h, truth, max_rows


def test_admission_reclaim_step_repopulation_and_finish_do_not_synchronise():
    h, truth, max_rows = build()
    ids = [f"r{i}" for i in range(N + 1)]
    for i in range(N):
        with no_sync():
            assert h.admit(ids[i], max_rows, {s: truth[i, :HIST + 3] for s in h.sources})
    with no_sync():  # the pool is full of optional history: this one reclaims
        assert h.admit(ids[N], max_rows, {s: truth[N, :HIST + 3] for s in h.sources})
    reclaimed = sum(p.residency.counters.pages_reclaimed for p in h.sources.values())
    assert reclaimed > 0
    sel = torch.randint(0, HIST, (N + 1, 1, 8), dtype=torch.int32, device=DEV)
    steps = 3 * PS  # a row per request and step: tail pages complete and are backed up
    with no_sync():
        h.finish(ids[N])
        for step in range(steps):
            for s in h.sources:
                h.append_batch(s, ids[:N], truth[:N, HIST + 3 + step])
                h.resolve(s, ids[:N], sel[:N], validate=False)
            h.step()
    if DEV == "cuda":
        torch.cuda.synchronize()
    counters = [p.residency.counters for p in h.sources.values()]
    assert sum(c.pages_repopulated for c in counters) > 0
    assert sum(c.host_pages_written for c in counters) > reclaimed  # tail backups too
    # the finished request's slot opens again without a reset; the newcomer decodes too
    ids.append("again")
    with no_sync():
        assert h.admit("again", max_rows, {s: truth[N + 1, :HIST + 3] for s in h.sources})
        for step in range(PS):
            for s in h.sources:
                rows = torch.cat([truth[:N, HIST + 3 + steps + step],
                                  truth[N + 1:, HIST + 3 + step]])
                h.append_batch(s, ids[:N] + ["again"], rows)
                h.resolve(s, ids[:N] + ["again"], sel, validate=False)
            h.step()
    lens = {rid: HIST + 3 + steps + PS for rid in ids[:N]} | {"again": HIST + 3 + PS}
    rows_of = {rid: truth[i] for i, rid in enumerate(ids[:N])} | {"again": truth[N + 1]}
    for s in h.sources:  # every location reads its row: repopulated, backed-up, appended
        parts = h.source(s)
        for rid in lens:
            for first in range(0, lens[rid] - 16 + 1, 16):
                rows = torch.arange(first, first + 16, dtype=torch.int32, device=DEV)
                loc, _ = h.resolve(s, [rid], rows.view(1, 1, -1))
                assert torch.equal(parts.pool.read(loc[0, 0].long()).to(DEV),
                                   rows_of[rid][first:first + 16]), (s, rid, first)
