"""Speculative presets: drafter checks, the draft window, and the engine checks the
connector runs at start-up (a stand-in VllmConfig: only the fields they read)."""
import json
import re
from types import SimpleNamespace

import pytest

from vllm_dhisparse.config import DHiSparseConfig
from vllm_dhisparse.hierarchy.sizing import draft_ring_rows, staging_bytes
from vllm_dhisparse.spec import SpecPreset, check_engine, draft_window, ring_sizes


def drafter(tmp_path, arch, **cfg):
    d = tmp_path / arch
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"architectures": [arch], **cfg}))
    return str(d)


def engine(method=None, arch=None, k=3, v2=True, load_format="auto", hf=None, block=256,
           prefix_caching=False):
    spec = None
    if method:
        draft = SimpleNamespace(architectures=[arch],
                                hf_config=SimpleNamespace(to_dict=lambda: dict(hf or {})))
        spec = SimpleNamespace(method=method, num_speculative_tokens=k, draft_model_config=draft)
    return SimpleNamespace(speculative_config=spec, use_v2_model_runner=v2,
                           load_config=SimpleNamespace(load_format=load_format),
                           cache_config=SimpleNamespace(block_size=block,
                                                        enable_prefix_caching=prefix_caching))


def test_presets_map_to_vllms_methods(tmp_path):
    dspark = SpecPreset("dspark", drafter(tmp_path, "Qwen3DSparkModel"), 3)
    assert dspark.speculative_config()["method"] == "dspark" and dspark.k_max == 4
    dflash2 = SpecPreset("dflash2", drafter(tmp_path, "DFlash2DraftModel"), 3)
    assert dflash2.speculative_config() == {"method": "dflash", "model": dflash2.model,
                                            "num_speculative_tokens": 3}
    # on CUDA the drafter keeps its own cache dtype, not V4's fp8_ds_mla
    assert dspark.speculative_config(cuda=True) == {**dspark.speculative_config(),
                                                    "kv_cache_dtype": "auto"}


def test_draft_window_only_when_every_layer_slides():
    assert draft_window({"sliding_window": 128, "layer_types": ["sliding_attention"] * 2}) == 128
    assert draft_window({"sliding_window": 128,
                         "layer_types": ["sliding_attention", "full_attention"]}) is None
    assert draft_window({}) is None
    assert draft_window({"sliding_window": 64, "use_sliding_window": False}) is None
    # as vLLM's DFlash layers read it: use_swa makes every layer sliding, swa_window_size wins
    assert draft_window({"dflash_config": {"use_swa": True, "swa_window_size": 256},
                         "sliding_window": 64}) == 256
    assert draft_window({"dflash_config": {"use_swa": True}, "sliding_window": 64}) == 64


def test_engine_sizes_with_a_windowed_drafter():
    hf = {"sliding_window": 128, "layer_types": ["sliding_attention"] * 2}
    sizes = check_engine(engine("dflash", "DFlash2DraftModel", hf=hf), "dflash2")
    assert sizes["preset"] == "dflash2" and sizes["k_max"] == 4 and sizes["draft_window"] == 128
    ring = ring_sizes(sizes, 256)
    assert ring["draft_ring_rows"] == draft_ring_rows(128, 256, 4) == 512  # eq. 9
    assert ring["draft_ring_blocks"] == 2
    assert sizes["draft_ring_bounds_prefill"]
    # prefix caching needs the prefill's draft blocks (integration/draft_ring.py)
    cached = check_engine(engine("dflash", "DFlash2DraftModel", hf=hf, prefix_caching=True), "")
    assert not cached["draft_ring_bounds_prefill"]
    assert check_engine(engine(), "") is None  # no speculation, nothing to size
    assert check_engine(engine("ngram", None), "") is None  # other methods pass through


def test_staging_bound_is_eq_11():
    assert staging_bytes(1, 8, 4, 512, 584) == 8 * 4 * 512 * 584


@pytest.mark.parametrize("vc,spec,message", [
    (engine(), "dspark", "speculative_config is not set"),
    (engine("dspark", "Qwen3DSparkModel"), "dflash2", "method 'dspark'"),
    (engine("dspark", "Qwen3DSparkModel", v2=False), "", "Model Runner V2"),
    (engine("dflash", "DFlash2DraftModel", load_format="dummy"), "", "load_format='dummy'"),
    (engine("dspark", "Qwen3DSparkModel", load_format="dummy"), "", "load_format='dummy'"),
    (engine("dspark", "Qwen3DSparkModel"), "", "no sliding window of its own"),
])
def test_engine_refusals(vc, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_engine(vc, spec)


def test_spec_key_is_checked_with_its_allowed_values():
    assert DHiSparseConfig.from_extra_config({"spec": "dspark"}).spec == "dspark"
    with pytest.raises(ValueError, match=r"\['spec'\] = 'medusa': allowed values are"):
        DHiSparseConfig.from_extra_config({"spec": "medusa"})
