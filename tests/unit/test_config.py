import pytest

from vllm_dhisparse.config import DHiSparseConfig, describe


def test_defaults_need_no_keys():
    cfg = DHiSparseConfig.from_extra_config({})
    assert cfg.hot_rows_for(512) == 1024
    assert cfg.reclaim_policy == "largest_first"


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError) as e:
        DHiSparseConfig.from_extra_config({"hot_cache_row": 3})
    msg = str(e.value)
    assert "hot_cache_row" in msg and "hot_cache_rows" in msg and "reclaim_policy" in msg


@pytest.mark.parametrize("key,value,needle", [
    ("reclaim_policy", "random", "largest_first"),
    ("page_size", 0, ">= 1"),
    ("optional_residency", "yes", "bool"),
    ("tail_pages", True, "int"),
    ("host_pool_gib", -1.0, ">= 0"),
])
def test_bad_values_name_key_and_allowed(key, value, needle):
    with pytest.raises(ValueError) as e:
        DHiSparseConfig.from_extra_config({key: value})
    assert key in str(e.value) and needle in str(e.value)


def test_hot_cache_smaller_than_topk_rejected():
    cfg = DHiSparseConfig.from_extra_config({"hot_cache_rows": 100})
    with pytest.raises(ValueError, match="hot_cache_rows.*top-k 512"):
        cfg.hot_rows_for(512)


def test_int_accepted_for_float_and_describe_lists_all():
    assert DHiSparseConfig.from_extra_config({"host_pool_gib": 2}).host_pool_gib == 2.0
    text = describe()
    for key in DHiSparseConfig.__dataclass_fields__:
        assert key in text


def test_device_window_knobs():
    cfg = DHiSparseConfig.from_extra_config({})
    assert cfg.device_window_tokens == 512 and cfg.device_pool_pages == 0
    assert DHiSparseConfig.from_extra_config({"device_window_tokens": 0}).device_window_tokens == 0
    with pytest.raises(ValueError, match="device_window_tokens.*>= 256"):
        DHiSparseConfig.from_extra_config({"device_window_tokens": 100})
    with pytest.raises(ValueError, match="device_pool_pages"):
        DHiSparseConfig.from_extra_config({"device_pool_pages": -1})
