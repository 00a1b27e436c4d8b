"""The draft ring's spec conversion and prefill bound (vLLM's spec classes, no engine)."""
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm", reason="the draft ring subclasses vLLM's sliding-window spec")

import torch  # noqa: E402
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec  # noqa: E402

from vllm_dhisparse.hierarchy.sizing import draft_ring_rows  # noqa: E402
from vllm_dhisparse.integration.draft_ring import (DraftRingManager, DraftRingSpec,  # noqa: E402
                                                   ring_block_size, ring_specs)


def attn(cls, **kw):
    return cls(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **kw)


def test_draft_layers_get_the_ring_with_the_drafters_window():
    specs = {"target.attn": object(), "draft.0": attn(SlidingWindowSpec, sliding_window=4096),
             "draft.1": attn(FullAttentionSpec)}
    out = ring_specs(specs, ["draft.0", "draft.1"], window=128, k_max=4)
    assert out["target.attn"] is specs["target.attn"]
    for name in ("draft.0", "draft.1"):
        assert isinstance(out[name], DraftRingSpec)
        assert (out[name].sliding_window, out[name].k_max, out[name].block_size) == (128, 4, 256)
    scheduler = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=out["draft.0"])])
    worker = SimpleNamespace(kv_cache_groups=[  # the worker's groups wrap per-layer specs
        SimpleNamespace(kv_cache_spec=SimpleNamespace(kv_cache_specs={"t": specs["draft.1"]})),
        SimpleNamespace(kv_cache_spec=SimpleNamespace(kv_cache_specs={"d": out["draft.0"]}))])
    assert ring_block_size(scheduler) == ring_block_size(worker) == 256
    assert ring_block_size(SimpleNamespace(kv_cache_groups=worker.kv_cache_groups[:1])) is None


@pytest.mark.parametrize("num_tokens", [1, 300, 387, 388, 2000, 7000, 7004])
def test_blocks_a_step_allocates_stay_within_r_d(num_tokens):
    """The blocks left real after the null padding cover [ring start, num_tokens): at
    most R_d / p of them, and every position a draft query reads
    (>= num_tokens - K_max - W + 1) is inside them."""
    mgr = SimpleNamespace(sliding_window=128, k_max=4, block_size=256)
    start = DraftRingManager.ring_start_blocks(mgr, num_tokens)
    real = -(-num_tokens // 256) - start
    assert real <= draft_ring_rows(128, 256, 4) // 256
    assert start * 256 <= max(0, num_tokens - 4 - 128 + 1)


def test_a_non_attention_draft_spec_is_refused():
    with pytest.raises(ValueError, match="standard"):
        ring_specs({"d": SimpleNamespace()}, ["d"], 128, 4)
