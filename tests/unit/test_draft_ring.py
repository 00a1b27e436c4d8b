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


def test_draft_layers_get_the_ring_with_their_own_window():
    specs = {"target.attn": object(), "draft.0": attn(SlidingWindowSpec, sliding_window=128)}
    out = ring_specs(specs, ["draft.0"], window=128, k_max=4)
    assert out["target.attn"] is specs["target.attn"]
    assert isinstance(out["draft.0"], DraftRingSpec)
    assert (out["draft.0"].sliding_window, out["draft.0"].k_max, out["draft.0"].block_size) == \
        (128, 4, 256)
    scheduler = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=out["draft.0"])])
    worker = SimpleNamespace(kv_cache_groups=[  # the worker's groups wrap per-layer specs
        SimpleNamespace(kv_cache_spec=SimpleNamespace(kv_cache_specs={"t": object()})),
        SimpleNamespace(kv_cache_spec=SimpleNamespace(kv_cache_specs={"d": out["draft.0"]}))])
    assert ring_block_size(scheduler) == ring_block_size(worker) == 256
    assert ring_block_size(SimpleNamespace(kv_cache_groups=worker.kv_cache_groups[:1])) is None


@pytest.mark.parametrize("spec,message", [
    (attn(SlidingWindowSpec, sliding_window=4096), "attends over 4096 tokens"),
    (attn(FullAttentionSpec), "sliding-window attention layers only"),
])
def test_a_draft_layer_the_ring_cannot_bound_is_refused(spec, message):
    with pytest.raises(ValueError, match=message):
        ring_specs({"d": spec}, ["d"], window=128, k_max=4)


def pool_and_ring(blocks=64):
    from vllm.v1.core.block_pool import BlockPool
    pool = BlockPool(num_gpu_blocks=blocks, enable_caching=False, hash_block_size=256)
    spec = DraftRingSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                         sliding_window=128, k_max=4)
    return pool, DraftRingManager(spec, block_pool=pool, enable_caching=False,
                                  kv_cache_group_id=0, scheduler_block_size=256)


@pytest.mark.parametrize("chunk", [7000, 2048, 1000])
def test_chunked_prefill_keeps_both_block_tables_alike_and_within_r_d(chunk):
    """What the scheduler does per step (free behind the window, allocate this step's
    slots) with vLLM's own block pool; the worker's table is built the way the worker
    builds it (the whole list once, then what each allocation returns appended)."""
    pool, mgr = pool_and_ring()
    bound = draft_ring_rows(128, 256, 4) // 256
    free0 = pool.get_num_free_blocks()
    computed, prompt, worker = 0, 7000, None
    while computed < prompt + 12:  # prefill in chunks, then 12 decode steps of 1 + 3 slots
        step = min(chunk, prompt - computed) if computed < prompt else 1
        mgr.remove_skipped_blocks("r", computed)
        new = mgr.allocate_new_blocks("r", computed + step + (3 if computed >= prompt else 0),
                                      computed + step)
        worker = list(mgr.req_to_blocks["r"]) if worker is None else worker + list(new)
        held = [b for b in mgr.req_to_blocks["r"] if not b.is_null]
        # same layout; where the scheduler freed a block behind the window the worker keeps
        # the stale id (vLLM does not tell it), which no draft query reads
        sched = mgr.req_to_blocks["r"]
        assert len(worker) == len(sched)
        assert all(w.block_id == b.block_id for w, b in zip(worker, sched) if not b.is_null)
        assert len(held) <= bound, (computed, [b.block_id for b in mgr.req_to_blocks["r"]])
        assert free0 - pool.get_num_free_blocks() == len(held)  # nothing stranded
        computed += step
    mgr.free("r")
    assert pool.get_num_free_blocks() == free0


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
    with pytest.raises(ValueError, match="sliding-window attention layers only"):
        ring_specs({"d": SimpleNamespace()}, ["d"], 128, 4)


def test_the_spec_caps_admission_at_r_d():
    """vLLM's startup sizer and admission gate read this cap: the ring's R_d / p, where a
    plain sliding window holds the in-flight tokens on top of the window."""
    ring = DraftRingSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                         sliding_window=128, k_max=4)
    window = attn(SlidingWindowSpec, sliding_window=128)
    assert ring.max_admission_blocks_per_request(8192, 32768) == draft_ring_rows(128, 256, 4) // 256
    assert window.max_admission_blocks_per_request(8192, 32768) == 34


@pytest.mark.parametrize("chunk", [7000, 2048, 1000])
def test_admission_counts_the_blocks_the_ring_takes(chunk):
    """Each step asks the manager how many blocks the allocation needs (vLLM checks the
    free pool against it), then allocates: the pool never gives more than was asked for,
    and a 7000-token prompt asks for its ring (2 blocks), not its 28 prompt blocks -- so
    it is admitted into a pool of 4 free blocks that vLLM's own count would refuse."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    pool, mgr = pool_and_ring(blocks=5)  # one block is vLLM's null block
    plain = SlidingWindowManager(attn(SlidingWindowSpec, sliding_window=128), block_pool=pool,
                                 enable_caching=False, kv_cache_group_id=0,
                                 scheduler_block_size=256)
    bound = draft_ring_rows(128, 256, 4) // 256
    full = mgr.get_num_blocks_to_allocate("r", 7000, [], 0, 0, 7000, apply_admission_cap=True)
    assert full <= bound < pool.get_num_free_blocks()
    assert plain.get_num_blocks_to_allocate("r", 7000, [], 0, 0, 7000) == 28
    computed, prompt = 0, 7000
    while computed < prompt + 12:  # prefill in chunks, then decode steps of 1 + 3 slots
        step = min(chunk, prompt - computed) if computed < prompt else 1
        slots = computed + step + (3 if computed >= prompt else 0)
        mgr.remove_skipped_blocks("r", computed)
        asked = mgr.get_num_blocks_to_allocate("r", slots, [], computed, computed,
                                               computed + step)
        assert asked <= bound
        free = pool.get_num_free_blocks()
        assert asked <= free
        mgr.allocate_new_blocks("r", slots, computed + step)
        assert free - pool.get_num_free_blocks() <= asked, (computed, asked)
        computed += step
    mgr.free("r")


def test_tokens_a_connector_supplies_are_counted_as_vllm_counts_them():
    """External (connector) tokens take their blocks before the ring frees anything:
    513 of them plus 131 new tokens need 2 blocks at once, as vLLM's own count says."""
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    pool, mgr = pool_and_ring()
    plain = SlidingWindowManager(attn(SlidingWindowSpec, sliding_window=128), block_pool=pool,
                                 enable_caching=False, kv_cache_group_id=0,
                                 scheduler_block_size=256)
    args = ("r", 644, [], 513, 0, 644)
    assert mgr.get_num_blocks_to_allocate(*args) == plain.get_num_blocks_to_allocate(*args) == 2
    assert mgr.get_num_blocks_to_allocate("r", 644, [], 0, 0, 644) == 1  # no connector: the ring


def test_with_prefix_caching_prefill_blocks_are_kept_as_vllms_window_keeps_them():
    """bounds_prefill False (prefix caching on): a one-step 7000-token prefill takes its
    28 blocks, as vLLM's sliding window does, so they can be hashed and outlive the step
    in the prefix cache; the admission cap is the window's; decode frees back to R_d / p."""
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    ring_spec = DraftRingSpec(block_size=256, num_kv_heads=2, head_size=64,
                              dtype=torch.bfloat16, sliding_window=128, k_max=4,
                              bounds_prefill=False)
    window = attn(SlidingWindowSpec, sliding_window=128)
    assert ring_spec.max_admission_blocks_per_request(8192, 32768) == \
        window.max_admission_blocks_per_request(8192, 32768)
    held = {}
    for name, spec, cls in (("ring", ring_spec, DraftRingManager),
                            ("window", window, SlidingWindowManager)):
        pool = BlockPool(num_gpu_blocks=64, enable_caching=True, hash_block_size=256)
        mgr = cls(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                  scheduler_block_size=256)
        steps, computed = [], 0
        for step in (7000, 1, 1, 1):
            mgr.remove_skipped_blocks("r", computed)
            n = mgr.get_num_blocks_to_allocate("r", computed + step, [], computed, computed,
                                               computed + step)
            new = mgr.allocate_new_blocks("r", computed + step, computed + step)
            steps.append((n, len(new), sum(not b.is_null for b in mgr.req_to_blocks["r"])))
            computed += step
        held[name] = steps
    assert held["ring"] == held["window"]
    assert held["ring"][0] == (28, 28, 28)
    assert held["ring"][-1][2] <= draft_ring_rows(128, 256, 4) // 256


def test_draft_layers_that_disagree_on_the_prefill_bound_are_not_merged():
    a = DraftRingSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                      sliding_window=128, k_max=4)
    assert DraftRingSpec.merge([a, a]).bounds_prefill
    with pytest.raises(AssertionError, match="bounds_prefill"):
        DraftRingSpec.merge([a, DraftRingSpec(**{**a.__dict__, "bounds_prefill": False})])


@pytest.mark.parametrize("caching", [True, False])
def test_a_ring_built_for_the_other_caching_mode_is_refused(caching):
    """vLLM can turn prefix caching off after the worker built the specs: a bounded ring
    under caching would find no hit, an unbounded one without it holds blocks for
    nothing, so the scheduler's manager refuses either."""
    from vllm.v1.core.block_pool import BlockPool
    spec = DraftRingSpec(block_size=256, num_kv_heads=2, head_size=64, dtype=torch.bfloat16,
                         sliding_window=128, k_max=4, bounds_prefill=caching)
    pool = BlockPool(num_gpu_blocks=8, enable_caching=caching, hash_block_size=256)
    with pytest.raises(ValueError, match="prefix caching"):
        DraftRingManager(spec, block_pool=pool, enable_caching=caching, kv_cache_group_id=0,
                         scheduler_block_size=256)
