"""scripts/gpu_engine.py without a GPU: what it reads from vLLM's log, the model's checksums,
the comparison of its arms, and its refusals (the GPU run itself is the committed result
benchmarks/results/gpu_engine_2026-12-04_fac52cc.json)."""
import hashlib
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import gpu_engine  # noqa: E402

BAR = "\r{name}: {pct}%|##| {i}/{n} [00:00<00:00, 1.7it/s]"


def capture_log(*modes: str) -> str:
    lines = ["(EngineCore pid=1) INFO [gpu_worker.py:513] Using V2 Model Runner"]
    for m in modes:
        lines.append("".join(BAR.format(name=f"Capturing CUDA graphs ({m})", pct=p, i=i, n=4)
                             for i, p in ((0, 0), (4, 100))))
    lines.append("(EngineCore pid=1) INFO [model_runner.py:1163] Graph capturing finished in "
                 "5 secs, took 0.08 GiB")
    return "\n".join(lines)


def test_full_graphs_are_read_from_vllms_capture_bars():
    got = gpu_engine.captured(capture_log("PIECEWISE", "FULL"))
    assert got == {"cuda_graphs_captured": ["FULL", "PIECEWISE"], "full_cuda_graphs": True,
                   "graph_capture_s": 5}
    # the V1 runner names the batch kind first
    assert gpu_engine.captured(capture_log("decode, FULL"))["full_cuda_graphs"]


def test_piecewise_alone_or_eager_is_not_full():
    assert not gpu_engine.captured(capture_log("PIECEWISE"))["full_cuda_graphs"]
    eager = gpu_engine.captured("INFO Model loading took 0.1 GiB")
    assert eager == {"cuda_graphs_captured": [], "full_cuda_graphs": False,
                     "graph_capture_s": None}


def test_model_checksums_are_checked_and_name_each_file(tmp_path):
    files = {"model-00001-of-00001.safetensors": b"weights", "config.json": b"{}"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    digest = {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}
    (tmp_path / "SHA256SUMS").write_text(
        f"{digest['model-00001-of-00001.safetensors']}  model-00001-of-00001.safetensors\n"
        f"{digest['config.json']} *config.json\n\n")
    assert gpu_engine.model_sums(str(tmp_path)) == digest
    (tmp_path / "config.json").write_bytes(b"{ }")  # not the bytes the sums name
    with pytest.raises(SystemExit, match="config.json: SHA-256 .* does not match"):
        gpu_engine.model_sums(str(tmp_path))
    assert gpu_engine.model_sums(str(tmp_path / "none")) is None


def answer(tokens, logprobs):
    return {"passkey": {"tokens": tokens, "logprobs": logprobs}}


def test_the_arms_are_compared_token_by_token_and_logprob_by_logprob():
    same = gpu_engine.compare({"llm": answer([1, 2], [-0.5, -0.25]),
                               "serve": answer([1, 2], [-0.5, -0.25])})
    assert same == {"same_tokens": True, "same_logprobs": True, "max_abs_logprob_diff": 0.0}
    rounding = gpu_engine.compare({"llm": answer([1, 2], [-0.5, -0.25]),
                                   "serve": answer([1, 2], [-0.5, -0.125])})
    assert rounding == {"same_tokens": True, "same_logprobs": False,
                        "max_abs_logprob_diff": 0.125}
    other = gpu_engine.compare({"llm": answer([1, 2], [-0.5, -0.25]),
                                "serve": answer([1, 3], [-0.5, -0.25])})
    assert not other["same_tokens"]
    assert gpu_engine.compare({"llm": answer([1], [-1.0])}) is None


def test_an_unknown_arm_is_refused_with_the_allowed_ones(capsys):
    with pytest.raises(SystemExit):
        gpu_engine.main(["--arms", "llm,offline"])
    assert "unknown ['offline']; allowed: llm, serve" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_without_a_gpu_it_says_what_to_run_instead():
    with pytest.raises(SystemExit, match="needs a CUDA GPU.*make demo"):
        gpu_engine.main(["--arms", "llm"])


def test_arms_join_a_result_only_of_the_same_model_and_settings(tmp_path):
    path = str(tmp_path / "gpu_engine.json")
    model, engine = {"sha256sums": {"m": "ab"}}, {"kv_cache_memory_bytes": 1}
    first = gpu_engine.record(path, model, engine)
    first["arms"]["llm"] = {"startup_s": 1.0}
    (tmp_path / "gpu_engine.json").write_text(json.dumps(first))
    assert gpu_engine.record(path, model, engine)["arms"] == {"llm": {"startup_s": 1.0}}
    assert gpu_engine.record(path, {"sha256sums": {"m": "cd"}}, engine)["arms"] == {}
    assert gpu_engine.record(path, model, {"kv_cache_memory_bytes": 2})["arms"] == {}


def test_the_prompt_for_another_machine_is_written_without_a_gpu(tmp_path):
    out = tmp_path / "passkey.json"
    assert gpu_engine.main(["--write-prompt", str(out), "--prompt-tokens", "400"]) == 0
    key = json.loads(out.read_text())
    assert 300 <= len(key["ids"]) <= 400 and key["answer"].endswith(".")
    assert len(key["answer_ids"]) >= 2 and all(isinstance(t, int) for t in key["ids"])
