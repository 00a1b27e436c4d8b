"""benchmarks/gpu_capacity.py's parts that run without a GPU: the layer plan of its model
and the merge of arms that separate calls ran (a call's time limit can be shorter than
two arms of a long-context run)."""
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import gpu_capacity as G  # noqa: E402


def _doc(arms: dict, **settings) -> dict:
    base = dict(meta={"device": "test"}, kv_cache_memory_bytes=1 << 30, lengths=[4, 8],
                rate=0.5, arrive_s=10.0, out_tokens=16, max_num_seqs=8, shape="v4flash",
                max_num_batched_tokens=2048, extra_config={"history_block_tokens": 1024})
    return dict(base, **settings, arms=arms)


def _arm(decoding: int, tps: float, steps: dict) -> dict:
    return dict(max_decoding=decoding, output_tokens_per_s=tps, decode_step_ms=steps,
                timeline=[[0.0, 0, 0, 0, 0, 0.0, 0], [1.0, decoding, decoding, 0, 5, 0.5, 0]])


def test_merge_takes_each_files_arms_and_computes_the_ratios(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    # resident serving ignores the connector's config: its file may hold another one
    a.write_text(json.dumps(_doc({"resident": _arm(4, 100.0, {"1-4": 10.0})}, extra_config={})))
    b.write_text(json.dumps(_doc({"connector": _arm(10, 190.0, {"1-4": 11.0, "9-16": 30.0})})))
    assert G.merge([str(a), str(b)], str(tmp_path / "out")) == 0
    doc = json.loads((tmp_path / "out" / "gpu_capacity.json").read_text())
    assert set(doc["arms"]) == {"resident", "connector"}
    assert doc["ratios"] == dict(max_decoding=2.5, output_tokens_per_s=1.9,
                                 decode_step_at_equal_concurrency={"1-4": 1.1})
    assert [m["arms"] for m in doc["merged_from"]] == [["resident"], ["connector"]]
    assert doc["extra_config"] == {"history_block_tokens": 1024}


@pytest.mark.parametrize("other,arm,says", [
    (dict(kv_cache_memory_bytes=2), "connector", "kv_cache_memory_bytes 2 against"),
    (dict(engine_args={"scheduler_reserve_full_isl": False}), "connector", "engine_args"),
    (dict(meta={"device": "another GPU"}), "connector", "meta.device 'another GPU'"),
    ({}, "resident", "arm 'resident' is in both"),
])
def test_merge_refuses_arms_run_otherwise_or_twice(tmp_path, other, arm, says):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc({"resident": _arm(4, 100.0, {})})))
    b.write_text(json.dumps(_doc({arm: _arm(10, 190.0, {})}, **other)))
    with pytest.raises(SystemExit, match=says):
        G.merge([str(a), str(b)], str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_two_connector_files_with_other_configs_do_not_merge(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_doc({"connector": _arm(4, 100.0, {})})))
    b.write_text(json.dumps(_doc({"resident": _arm(10, 190.0, {})}, extra_config={})))
    G.merge([str(a), str(b)], str(tmp_path / "ok"))  # resident ignores the connector's config
    b.write_text(json.dumps(_doc({"connector": _arm(10, 190.0, {})}, extra_config={})))
    with pytest.raises(SystemExit, match="extra_config"):
        G.merge([str(a), str(b)], str(tmp_path / "out"))


@pytest.mark.parametrize("args,says", [
    (["--out-tokens", "8192"], "--max-len 135168 is shorter than the longest prompt"),
    (["--engine-args", "[1]"], "--engine-args"),
    (["--engine-args", "{x"], "--engine-args is not JSON"),
])
def test_settings_vllm_would_not_run_as_asked_are_refused(capsys, args, says):
    with pytest.raises(SystemExit) as e:
        G.main(args)
    assert e.value.code == 2 and says in capsys.readouterr().err


def test_v4flash_model_has_the_flash_layer_plan_and_the_context():
    d = Path(G.model_dir(str(ROOT / "models" / "needle_v4"), 135168, "v4flash"))
    cfg = json.loads((d / "config.json").read_text())
    shutil.rmtree(d)
    ratios = cfg["compress_ratios"]
    assert (cfg["num_hidden_layers"], len(ratios), cfg["index_n_heads"]) == (43, 43, 64)
    assert (ratios.count(0), ratios.count(4), ratios.count(128)) == (2, 21, 20)
    assert cfg["max_position_embeddings"] == 135168
    assert cfg["rope_scaling"]["factor"] * cfg["rope_scaling"][
        "original_max_position_embeddings"] == 135168
