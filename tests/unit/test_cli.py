"""``vllm-dhisparse serve``: the arguments it hands to vLLM's server (no server started)."""
import json

import pytest

from vllm_dhisparse.tools import cli


def served(monkeypatch, argv):
    seen = {}
    monkeypatch.setattr(cli.os, "execv", lambda exe, args: seen.setdefault("args", args))
    cli.serve(argv)
    return seen["args"]


def test_serve_adds_the_connector_and_turns_off_what_it_refuses(monkeypatch):
    args = served(monkeypatch, ["demo_model", "--port", "8001"])
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "DHiSparseConnector"
    assert "--no-enable-prefix-caching" in args
    assert "--no-enable-chunked-prefill" not in args  # the prompt budget is unknown here
    args = served(monkeypatch, ["demo_model", "--max-model-len=8192"])
    assert args[-3:] == ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "8192"]


@pytest.mark.parametrize("flag", ["--enable-prefix-caching", "--enable-chunked-prefill"])
def test_serve_keeps_the_users_choice(monkeypatch, flag):
    args = served(monkeypatch, ["demo_model", "--max-model-len", "4096", flag])
    name = flag.replace("--no-enable-", "").replace("--enable-", "")
    assert [a for a in args if name in a] == [flag]
