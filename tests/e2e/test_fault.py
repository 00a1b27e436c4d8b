"""Issue 4, acceptance 3: a failed host backup fails that request alone, with an error.

``DHISPARSE_TEST_FAIL_BACKUP_OF`` (a test hook read from the environment) makes the host store refuse the first backup of
request ``r1``; ``eager_backup`` makes that backup happen at admission, right
after r1's prefill, when vLLM may already free r1's c4a blocks behind the
device window: r1 can no longer be served exactly.  The worker half reports it
in its ``KVConnectorWorkerMetadata``; the scheduler hook
(``integration/scheduler_hooks.py``) finishes it with ``FINISHED_ERROR``
(finish reason ``"error"``).  Every other request must finish with the tokens of resident serving (logprobs
to bf16 rounding: without r1 the later batches differ from resident serving's).
"""
import json

import pytest

from .conftest import run_offline

pytestmark = pytest.mark.e2e

INPROC = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
ARGS = ["--prompt-lens", "2600", "2600", "2600", "--max-tokens", "8", "--max-model-len", "4096"]


def test_backup_failure_fails_one_request(demo_model):
    resident = run_offline(demo_model, *ARGS, env=INPROC)
    got = run_offline(demo_model, *ARGS, "--connector", json.dumps({"eager_backup": True}),
                      env={**INPROC, "DHISPARSE_TEST_FAIL_BACKUP_OF": "r1"})
    failed = got["outputs"][1]
    assert failed["finish_reason"] == "error", failed
    for i in (0, 2):
        g, w = got["outputs"][i], resident["outputs"][i]
        assert g["finish_reason"] == "length"
        assert g["token_ids"] == w["token_ids"], (i, g["token_ids"], w["token_ids"])
        # r1 leaves the batch early, so later steps run smaller batches than resident
        # serving's, and vLLM's dense layers are not batch-invariant on CPU: logprobs
        # agree to bf16 rounding, tokens exactly.
        assert max(abs(a - b) for a, b in zip(g["logprobs"], w["logprobs"])) < 0.05, i
    t = got["stats"]["totals"]
    assert t["failed"] == 1 and t["admissions"] == 2, t
