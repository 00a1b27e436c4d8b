"""``vllm-dhisparse serve``: the arguments it hands to vLLM's server (no server started)."""
import json

import pytest

from vllm_dhisparse.tools import cli


def served(monkeypatch, argv):
    seen = {}
    monkeypatch.setattr(cli.os, "execv", lambda exe, args: seen.setdefault("args", args))
    cli.serve(argv)
    return seen["args"]


def test_serve_adds_the_connector_and_keeps_vllms_defaults(monkeypatch):
    args = served(monkeypatch, ["demo_model", "--port", "8001"])
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector"] == "DHiSparseConnector"
    assert args[-6:-2] == ["--model", "demo_model", "--port", "8001"]
    assert not [a for a in args if "prefix-caching" in a or "chunked-prefill" in a]


def test_serve_keeps_the_users_transfer_config(monkeypatch):
    mine = json.dumps({"kv_connector": "DHiSparseConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"hot_cache_rows": 1024}})
    args = served(monkeypatch, ["demo_model", "--kv-transfer-config", mine])
    assert [a for a in args if a.startswith("{")] == [mine]
