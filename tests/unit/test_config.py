import pytest

from vllm_dhisparse.config import DHiSparseConfig, describe


def test_defaults_need_no_keys():
    cfg = DHiSparseConfig.from_extra_config({})
    assert cfg.hot_cache_rows_for(512) == 1024
    assert cfg.reclaim_policy == "largest_first"


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError) as e:
        DHiSparseConfig.from_extra_config({"hot_cache_row": 3})
    msg = str(e.value)
    assert "hot_cache_row" in msg and "hot_cache_rows" in msg and "reclaim_policy" in msg


@pytest.mark.parametrize("key,value,needle", [
    ("reclaim_policy", "random", "largest_first"),
    ("tail_pages", 0, ">= 1"),
    ("host_pool_gib", float("nan"), "finite"),
    ("host_pool_gib", float("inf"), "finite"),
    ("optional_residency", "yes", "bool"),
    ("tail_pages", True, "int"),
    ("host_pool_gib", -1.0, ">= 0"),
    ("staging_arenas", 0, "allowed 1..128"),
    ("staging_arenas", 129, "allowed 1..128"),
    ("staging_arenas", 1.5, "int"),
])
def test_bad_values_name_key_and_allowed(key, value, needle):
    with pytest.raises(ValueError) as e:
        DHiSparseConfig.from_extra_config({key: value})
    assert key in str(e.value) and needle in str(e.value)


def test_hot_cache_smaller_than_topk_rejected():
    cfg = DHiSparseConfig.from_extra_config({"hot_cache_rows": 100})
    with pytest.raises(ValueError, match="hot_cache_rows.*top-k 512"):
        cfg.hot_cache_rows_for(512)


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


@pytest.mark.parametrize("key", ["page_size", "debug_corrupt_mapping", "debug_fail_backup_of"])
def test_unused_and_test_only_keys_are_not_config(key):
    """page_size did nothing (pages are vLLM blocks); fault injection is an env test hook."""
    with pytest.raises(ValueError, match="unknown kv_connector_extra_config key"):
        DHiSparseConfig.from_extra_config({key: 1})


def test_no_environment_variable_configures_the_package():
    """Every switch is a key of the config: no DHISPARSE_* name appears in the package."""
    import pathlib
    import re
    pkg = pathlib.Path(__file__).resolve().parents[2] / "vllm_dhisparse"
    names = {(str(p.relative_to(pkg)), m) for p in pkg.rglob("*.py")
             for m in re.findall(r"DHISPARSE_[A-Z_]+", p.read_text())}
    assert names == set(), names


def test_stats_file_is_replaced_atomically(tmp_path):
    pytest.importorskip("vllm")
    from vllm_dhisparse.integration.metrics.stats import write_json_atomic
    target = tmp_path / "stats.json"
    decoy = tmp_path / f"stats.json.tmp{__import__('os').getpid()}"  # the old predictable name
    decoy.write_text("keep me")
    write_json_atomic(str(target), {"a": 1})
    write_json_atomic(str(target), {"a": 2})
    assert target.read_text() == '{"a": 2}' and decoy.read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, decoy.name])


def test_parsed_once_per_process_for_each_mapping(monkeypatch):
    """Every component of a process asks for the config; one parse serves them all."""
    from vllm_dhisparse import config as C
    C._parsed.cache_clear()
    calls = []
    parse = C.DHiSparseConfig._parse.__func__
    monkeypatch.setattr(C.DHiSparseConfig, "_parse",
                        classmethod(lambda cls, extra: calls.append(extra) or parse(cls, extra)))
    first = DHiSparseConfig.from_extra_config({"host_pool_gib": 3.25, "tail_pages": 3})
    again = DHiSparseConfig.from_extra_config({"tail_pages": 3, "host_pool_gib": 3.25})
    other = DHiSparseConfig.from_extra_config({"host_pool_gib": 3.5})
    assert first is again and other.host_pool_gib == 3.5 and len(calls) == 2
    for _ in range(2):  # a bad mapping is refused every time, never remembered as good
        with pytest.raises(ValueError, match="hot_cache_row"):
            DHiSparseConfig.from_extra_config({"hot_cache_row": 3})
