"""``make demo`` does what the README says: the trained model asked for a pass key by
vLLM's server without and with the connector, answers compared token by token and
logprob by logprob, and where the rows came from.  (The other E2E tests serve the seeded
random demo model: its logits depend on every row attention reads, so any wrong row
shows in the logprobs, where the trained model's confident answers could hide it.)"""
import re

import pytest

from vllm_dhisparse import demo

pytestmark = pytest.mark.e2e


def test_demo_finds_the_pass_key_both_ways_and_compares(capsys):
    """``make demo`` as a fresh clone runs it: the trained model (its checksums checked),
    the 7,158-token passkey prompt, both servers answer the key, tokens and logprobs are
    identical, and part of what attention read came from host.  Both servers run in the
    same environment, and their workers on the same CPU cores (vLLM alone reserves one
    more for a KV connector; compat/omp_reserved_cores.py)."""
    rc = demo.main(["--timeout", "600"])
    out = capsys.readouterr().out
    assert rc == 0, out
    key = re.search(r"with the pass key (\d{5}) at token", out)
    assert key, out
    assert out.count(f"' {key.group(1)}.' is the pass key") == 2, out
    assert "identical tokens; logprobs bit-identical" in out, out
    assert "rows attention read through the hierarchy" in out, out
    fetched = re.search(r"(\d+) rows \(\d+ bytes\) copied from host", out)
    assert fetched and int(fetched.group(1)) > 0, out  # the hot cache missed: host fetches


def test_a_difference_is_reported_and_fails():
    a = {"logprobs": {"tokens": ["x", "y"], "token_logprobs": [-1.0, -2.0]}}
    b = {"logprobs": {"tokens": ["x", "z"], "token_logprobs": [-1.0, -2.5]}}
    assert demo.compare(a, a) and not demo.compare(a, b)
