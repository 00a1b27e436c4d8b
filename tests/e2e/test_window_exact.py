"""With the device window on, vLLM frees c4a blocks and outputs stay bit-exact.

Six 2600-token requests (650 compressed rows each, more than top-k = 512; the batch
of ``test_fault.py``, whose resident run this test shares) in one generous KV pool,
so both arms run the same batches (prefills of later requests mixed with decodes of
earlier ones, and blocks freed behind the window handed to later prefills).  Tokens
*and* logprobs must equal resident serving; a decoding request must hold at most
``window/256 + 1`` c4a blocks.
"""
import json

import pytest

from .conftest import SIX_2600, assert_same_outputs, run_offline

pytestmark = pytest.mark.e2e


def test_window_bit_exact(demo_model, resident_run):
    resident = resident_run(*SIX_2600)
    got = run_offline(demo_model, *SIX_2600, "--connector",
                      json.dumps({"device_window_tokens": 512}))
    assert_same_outputs(got, resident)
    res_blocks, con_blocks = resident["max_decode_blocks_per_group"], got["max_decode_blocks_per_group"]
    # resident groups: (indexer K + c4a + c128a, c4a states, SWA, SWA, c128a state);
    # with the connector the c4a caches are group 4 of six (block sizes 256,4,64,64,256,8)
    assert len(res_blocks) == 5 and len(con_blocks) == 6, (res_blocks, con_blocks)
    assert res_blocks[0] == 11 and con_blocks[0] == 11  # indexer K keeps the whole history
    assert con_blocks[4] <= 3, con_blocks  # c4a: 512-token window + the newest block
    t = got["stats"]["totals"]
    assert t["admissions"] == 6 and t["failed"] == 0, t
