"""A failure in one request's hierarchy work fails that request alone, with an error.

The engine runs the tests' fault injector (tests/fault_injection.py, a subclass of the
connector): the host store refuses the first backup of r1 (``eager_backup`` makes that
backup happen at admission, right after r1's prefill, when vLLM may already free r1's
c4a blocks behind the device window: r1 can no longer be served exactly); the worker's
admission of r2, the first append of r3's committed rows and the first resolve of r4
raise.  The worker half reports each in its ``KVConnectorWorkerMetadata``; the
connector's scheduler (``integration/engine_core/scheduler.py``) finishes it with
``FINISHED_ERROR`` (finish reason ``"error"``) and no token of that step.  r0 and r5 must finish
with the tokens of resident serving (logprobs to bf16 rounding: without the failed
requests the later batches differ from resident serving's), and the engine goes on.
"""
import json

import pytest

from .conftest import FAULTY, SIX_2600, faults, run_offline

pytestmark = pytest.mark.e2e

FAILED = {1: "backup", 2: "admit", 3: "append", 4: "resolve"}


def test_one_failing_request_among_several(demo_model, resident_run):
    resident = resident_run(*SIX_2600)
    got = run_offline(demo_model, *SIX_2600, "--connector", json.dumps({"eager_backup": True}),
                      *FAULTY, env=faults("backup:r1,admit:r2,append:r3,resolve:r4"))
    for i, where in FAILED.items():
        assert got["outputs"][i]["finish_reason"] == "error", (where, got["outputs"][i])
    for i in (0, 5):
        g, w = got["outputs"][i], resident["outputs"][i]
        assert g["finish_reason"] == "length"
        assert g["token_ids"] == w["token_ids"], (i, g["token_ids"], w["token_ids"])
        # vLLM's dense layers are not batch-invariant on CPU: logprobs agree to bf16
        # rounding, tokens exactly
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])) < 0.05, i
    t = got["stats"]["totals"]
    # r3 and r4 were admitted before their failure; r1's admission is undone, r2's never ran
    assert t["failed"] == len(FAILED) and t["admissions"] == 4, t
    # every admitted request was released, the last ones by the step that tells the
    # workers about finished requests (no further request needed)
    assert t["finished"] + t["preempted"] == 4 and t["admitted"] == 0, t
