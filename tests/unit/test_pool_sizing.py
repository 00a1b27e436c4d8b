"""The hierarchy's pool sizes follow the stated rule (integration/pool_sizing.py)."""
import pytest

pytest.importorskip("vllm", reason="pool_sizing logs through vLLM's logger")

from vllm_dhisparse.config import DHiSparseConfig  # noqa: E402
from vllm_dhisparse.integration.pool_sizing import (LayerShape, device_pool_bytes,  # noqa: E402
                                                    plan_sources)

LAYER = LayerShape("l0", compress_ratio=4, top_k=512, row_bytes=584, rows_per_block=64,
                   segments=(576, 8))


def test_auto_is_the_floor_plus_one_hot_cache_per_running_request():
    cfg = DHiSparseConfig(hot_cache_rows=512, tail_pages=2, admission_reserve_pages=3)
    (plan,) = plan_sources(cfg, [LAYER], max_model_len=7100, max_num_seqs=6, max_queries=1)
    # per request: hot 512 rows = 8 pages, tail 2, staging (0 overflow + 2 fresh rows) 1
    assert plan.floor_pages == 6 * 11 + 3
    assert plan.spec.device_pages == plan.floor_pages + 6 * 8
    assert device_pool_bytes([plan, plan]) == 2 * plan.spec.device_pages * 64 * 584


def test_speculation_adds_verification_staging():
    cfg = DHiSparseConfig(hot_cache_rows=512)
    (plan,) = plan_sources(cfg, [LAYER], max_model_len=7100, max_num_seqs=1, max_queries=4)
    # K*k - B = 1536 overflow rows + ceil(4/4)+1 = 2 fresh rows -> 25 pages
    assert plan.spec.staging_rows == 1538 and plan.floor_pages == 8 + 2 + 25


def test_explicit_pool_below_the_floor_names_the_key():
    cfg = DHiSparseConfig(hot_cache_rows=512, device_pool_pages=10)
    with pytest.raises(ValueError, match=r"'device_pool_pages'\] = 10 is below .* allowed >= 11"):
        plan_sources(cfg, [LAYER], max_model_len=7100, max_num_seqs=1, max_queries=1)
