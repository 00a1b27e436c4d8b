"""The hierarchy's pool sizes follow the stated rule (integration/worker/pool_sizing.py)."""
import pytest

pytest.importorskip("vllm", reason="pool_sizing logs through vLLM's logger")

from vllm_dhisparse.config import DHiSparseConfig  # noqa: E402
from vllm_dhisparse.integration.worker.pool_sizing import (  # noqa: E402
    LayerShape, device_pool_bytes, plan_pools, plan_sources, plan_staging, staging_sizes)

LAYER = LayerShape("l0", compress_ratio=4, top_k=512, row_bytes=584, rows_per_block=64,
                   plane_bytes=(576, 8))


def test_auto_is_the_floor_plus_one_hot_cache_per_running_request():
    cfg = DHiSparseConfig(hot_cache_rows=512, tail_pages=2, admission_reserve_pages=3)
    (plan,) = plan_sources(cfg, [LAYER], max_model_len=7100, max_num_seqs=6, max_queries=1)
    # per request: hot 512 rows = 8 pages, tail 2; no staging pages
    assert plan.floor_pages == 6 * 10 + 3
    assert plan.spec.device_pages == plan.floor_pages + 6 * 8
    staging = plan_staging(cfg, [plan, plan])  # 0 overflow + 2 fresh rows per request
    assert (staging.arenas, staging.columns) == (1, 2)
    assert device_pool_bytes([plan, plan], staging) \
        == 2 * plan.spec.device_pages * 64 * 584 + 1 * 6 * 2 * 584


def test_speculation_stages_in_one_arena_shared_by_the_layers():
    cfg = DHiSparseConfig(hot_cache_rows=512)
    plans = plan_sources(cfg, [LAYER, LAYER], max_model_len=7100, max_num_seqs=8, max_queries=4)
    # K*k - B = 1536 overflow rows + ceil(4/4)+1 = 2 fresh rows, in the arena, not the pool
    assert plans[0].overflow_rows == 1536 and plans[0].fresh_rows == 2
    assert plans[0].floor_pages == 8 * (8 + 2)
    staging = plan_staging(cfg, plans)
    assert (staging.arenas, staging.columns) == (1, 1538)
    sizes = staging_sizes(plans, staging, [LAYER, LAYER], k_max=4)
    # one arena for both layers: N x 1538 rows, below M_stage = chi N K_max k d_KV
    assert sizes["staging_reserved_bytes"] == 8 * 1538 * 584
    assert sizes["staging_bound_bytes"] == 8 * 4 * 512 * 584
    two = plan_staging(DHiSparseConfig(hot_cache_rows=512, staging_arenas=2), plans)
    assert device_pool_bytes(plans, two) - device_pool_bytes(plans, staging) == 8 * 1538 * 584


def test_more_arenas_than_sparse_layers_names_the_key():
    cfg = DHiSparseConfig(hot_cache_rows=512, staging_arenas=3)
    plans = plan_sources(cfg, [LAYER, LAYER], max_model_len=7100, max_num_seqs=1, max_queries=4)
    with pytest.raises(ValueError, match=r"'staging_arenas'\] = 3 exceeds the 2 sparse layers; "
                                         r"allowed 1..2"):
        plan_staging(cfg, plans)


def test_explicit_pool_below_the_floor_names_the_key():
    cfg = DHiSparseConfig(hot_cache_rows=512, device_pool_pages=9)
    with pytest.raises(ValueError, match=r"'device_pool_pages'\] = 9 is below .* allowed >= 10"):
        plan_sources(cfg, [LAYER], max_model_len=7100, max_num_seqs=1, max_queries=1)


def test_one_plan_per_process_whoever_asks():
    """The worker's budget (LayerShape, from the loaded model), its check and the worker
    half (SparseLayer, from vLLM's KV cache config) read the same plan object."""
    from vllm_dhisparse.integration.layers.model_probe import SparseLayer
    cfg = DHiSparseConfig(hot_cache_rows=512)
    budget = plan_pools(cfg, [LAYER], 7100, 6, 1)
    layer = SparseLayer("l0", compress_ratio=4, top_k=512, row_bytes=584, rows_per_block=64,
                        group=1)
    assert plan_pools(cfg, [layer], 7100, 6, 1) is budget
    assert budget.device_bytes == device_pool_bytes(list(budget.sources), budget.staging)
    assert plan_pools(cfg, [layer], 7100, 7, 1) is not budget  # other limits: another plan


def test_fresh_rows_cover_this_steps_queries_and_the_previous_steps_unverified_drafts():
    from vllm_dhisparse.integration.worker.pool_sizing import fresh_rows
    for q in range(1, 17):
        for ratio in (4, 128):
            # committed tokens V at any offset in a row; the step reads rows completed by
            # up to V + 2q - 1 tokens (q queries past K = q - 1 unverified drafts)
            worst = max((v + 2 * q - 1) // ratio - v // ratio for v in range(ratio))
            assert fresh_rows(q, ratio) >= worst, (q, ratio)
            assert fresh_rows(q, ratio) >= -(-q // ratio) + 1  # the step's own rows
