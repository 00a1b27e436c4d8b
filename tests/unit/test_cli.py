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
    assert args[-10:-6] == ["--model", "demo_model", "--port", "8001"]
    from vllm_dhisparse.engine_args import class_args
    assert args[-4:] == class_args()
    assert not [a for a in args if "prefix-caching" in a or "chunked-prefill" in a]


def test_serve_keeps_the_users_transfer_config(monkeypatch):
    mine = json.dumps({"kv_connector": "DHiSparseConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"hot_cache_rows": 1024}})
    args = served(monkeypatch, ["demo_model", "--kv-transfer-config", mine])
    assert [a for a in args if a.startswith("{")] == [mine]


def _drafter(tmp_path, arch, **cfg):
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": [arch], **cfg}))
    return str(d)


def test_serve_spec_preset_becomes_vllms_speculative_config(monkeypatch, tmp_path):
    drafter = _drafter(tmp_path, "Qwen3DSparkModel")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "unset")  # restored after the test
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER")
    args = served(monkeypatch, ["demo_model", "--spec", "dspark", f"--spec-model={drafter}",
                                "--spec-tokens", "4", "--port", "8001"])
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "dspark", "model": drafter, "num_speculative_tokens": 4}
    transfer = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert transfer["kv_connector_extra_config"] == {"spec": "dspark"}
    assert not [a for a in args if a.split("=")[0] in cli.SPEC_FLAGS]  # vLLM never sees ours
    assert "--port" in args and cli.os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"


def test_serve_spec_preset_on_cuda_keeps_the_drafters_cache_dtype(monkeypatch, tmp_path):
    import torch
    drafter = _drafter(tmp_path, "Qwen3DSparkModel")
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = served(monkeypatch, ["demo_model", "--spec", "dspark", f"--spec-model={drafter}"])
    spec = json.loads(args[args.index("--speculative-config") + 1])
    assert spec == {"method": "dspark", "model": drafter, "num_speculative_tokens": 3,
                    "kv_cache_dtype": "auto"}


@pytest.mark.parametrize("argv,message", [
    (["--spec", "dspark"], "--spec-model"),
    (["--spec", "eagle", "--spec-model", "X"], "allowed values are ['dflash2', 'dspark']"),
    (["--spec", "dspark", "--spec-model", "/nonexistent"], "has no config.json"),
    (["--spec", "dspark", "--spec-model", "DRAFTER", "--spec-tokens", "x"], "must be an integer"),
    (["--spec", "dspark", "--spec-model", "DRAFTER", "--spec-tokens", "0"], "must be an int >= 1"),
    (["--spec", "dflash2", "--spec-model", "DRAFTER"], "a dflash2 drafter is one of"),
])
def test_serve_spec_refusals_name_the_flag(monkeypatch, tmp_path, capsys, argv, message):
    drafter = _drafter(tmp_path, "Qwen3DSparkModel")
    argv = [drafter if a == "DRAFTER" else a for a in argv]
    monkeypatch.setattr(cli.os, "execv", lambda *a: pytest.fail("must not start the server"))
    assert cli.serve(["demo_model", *argv]) == 2
    assert message in capsys.readouterr().err
