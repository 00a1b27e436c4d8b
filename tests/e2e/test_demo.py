"""``make demo`` does what the README says: the same greedy request to vLLM's server
without and with the connector, answers compared token by token and logprob by
logprob, and where the rows came from."""
import re

import pytest

from vllm_dhisparse import demo

pytestmark = pytest.mark.e2e


def test_demo_serves_both_ways_and_compares(demo_model, capsys):
    """The default prompt (2,104 tokens: host fetches, chunked prefill).  Without the
    same CPU reservation in both arms (demo.server_env) the logprobs differ from the
    7th token on: vLLM gives the connector arm's worker another thread count."""
    rc = demo.main(["--model", demo_model, "--max-tokens", "10", "--timeout", "600"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "identical tokens; logprobs bit-identical" in out, out
    assert "rows attention read through the hierarchy" in out, out
    fetched = re.search(r"(\d+) rows \(\d+ bytes\) copied from host", out)
    assert fetched and int(fetched.group(1)) > 0, out  # the hot cache missed: host fetches


def test_a_difference_is_reported_and_fails():
    a = {"logprobs": {"tokens": ["x", "y"], "token_logprobs": [-1.0, -2.0]}}
    b = {"logprobs": {"tokens": ["x", "z"], "token_logprobs": [-1.0, -2.5]}}
    assert demo.compare(a, a) and not demo.compare(a, b)
