"""History in wider vLLM blocks (``history_block_tokens``): the specs the history layers
declare and the key's validation (no engine; the E2E check is test_default_paths.py)."""
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowMLASpec

from vllm_dhisparse.config import DHiSparseConfig
from vllm_dhisparse.integration import kv_spec


def engine(wide: int):
    ktc = SimpleNamespace(kv_connector="DHiSparseConnector", kv_connector_module_path=None,
                          kv_role="kv_both", kv_connector_extra_config={
                              "history_block_tokens": wide})
    return SimpleNamespace(kv_transfer_config=ktc)


def indexer_keys():  # DeepSeek-V4's indexer key cache: 132-B rows, 4 tokens a row
    return MLAAttentionSpec(block_size=256, num_kv_heads=1, max_tp_shards=1, head_size=132,
                            dtype=torch.uint8, tokens_per_state=4, alignment=576)


def c128a():  # a c128a compressed cache: 584-B fp8_ds_mla rows, 128 tokens a row
    return MLAAttentionSpec(block_size=256, num_kv_heads=1, max_tp_shards=1, head_size=512,
                            dtype=torch.uint8, tokens_per_state=128, cache_dtype_str="fp8_ds_mla",
                            alignment=576, model_version="deepseek_v4", state_content_bytes=584)


@pytest.mark.parametrize("make,kernel_page", [(indexer_keys, 64 * 132), (c128a, 2 * 584)])
def test_history_specs_take_the_wide_block_and_keep_kernel_pages_whole(make, kernel_page):
    spec = make()
    got = kv_spec.history_widened(spec, engine(1024))
    assert got.block_size == 1024 and got.tokens_per_state == spec.tokens_per_state
    # vLLM maps its 256-token kernel blocks inside: the pool stride must be a whole number
    # of kernel pages of rows x row bytes (not of the 576-B padded page vLLM would use)
    assert got.get_block_stride_alignment() == kernel_page
    assert got.page_size_bytes >= 4 * kernel_page


def test_vllms_alignment_for_a_fixed_kernel_block_would_split_the_indexers_pages():
    """Why the alignment is set: what vLLM derives from the backend's 256-token kernel
    block is the 576-B padded page, which 64 rows of 132 B do not tile."""
    from dataclasses import replace

    from vllm.v1.attention.backend import MultipleOf
    spec = replace(indexer_keys(), block_size=1024, block_stride_alignment=MultipleOf(256))
    assert spec.get_block_stride_alignment() == 8640 and 8640 % (64 * 132)


def test_other_specs_and_vllms_block_size_are_left_alone():
    spec = indexer_keys()
    assert kv_spec.history_widened(spec, engine(0)) is spec
    assert kv_spec.history_widened(spec, engine(256)) is spec
    assert kv_spec.history_widened(spec, SimpleNamespace(kv_transfer_config=None)) is spec
    window = SlidingWindowMLASpec(block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=512,
                                  dtype=torch.uint8, sliding_window=128, alignment=576)
    assert kv_spec.history_widened(window, engine(1024)) is window
    assert kv_spec.history_widened(None, engine(1024)) is None


@pytest.mark.parametrize("value", [100, 300, 1000])
def test_the_key_must_be_a_multiple_of_the_kernel_block(value):
    with pytest.raises(ValueError, match=r"'history_block_tokens'\] = %d: must be 0 .* "
                                         r"multiple of 256" % value):
        DHiSparseConfig.from_extra_config({"history_block_tokens": value})
    with pytest.raises(ValueError, match=r"history_block_tokens.*must be >= 0"):
        DHiSparseConfig.from_extra_config({"history_block_tokens": -256})
    assert DHiSparseConfig.from_extra_config({"history_block_tokens": 2048}).history_block_tokens \
        == 2048
