"""vLLM 0.33's prefill gather of a paged DeepSeek-V4 K cache takes 32-B-aligned pages only.

``models/deepseek_v4/common/ops/cache_utils.py`` ``dequantize_and_gather_k_cache`` (called
by ``models/deepseek_v4/nvidia/flashmla.py``'s prefill for the compressed and the SWA
caches) runs a CuTe-DSL kernel wherever CuTe DSL is installed, and that kernel declares the
cache's page stride a multiple of 32 B: any other tensor stops the engine ("Invalid
k_cache.strides[0] ... expected to be divisible by 32").  With ``history_block_tokens`` vLLM
maps its 256-token kernel blocks inside the wider c128a blocks
(``AttentionGroup.map_kv_cache_to_kernel_blocks``), so a c128a page is 2 rows x 584 B =
1,168 B: 16-B aligned, as the rows' copies need, not 32.  The same function's Triton kernel
reads any page stride; calls whose page stride is not a multiple of 32 B go there, every
other call runs as before.  Both kernels dequantize exactly (fp8 times a power-of-two scale,
stored as bf16), so they gather the same bits.
"""
from __future__ import annotations

from .targets import expect

CALLER = "vllm.models.deepseek_v4.nvidia.flashmla:dequantize_and_gather_k_cache"
TRITON = "vllm.models.deepseek_v4.common.ops.cache_utils:_DEQUANTIZE_AND_GATHER_K_CACHE_KERNEL"
ALIGN = 32  # bytes: the CuTe-DSL kernel's declared page-stride divisibility
PARAMS = ("out", "k_cache", "seq_lens", "gather_lens", "block_table", "block_size", "offset",
          "use_fnuz")


def takes_any_stride(gather, triton_kernel):
    """``gather`` with pages whose stride is not a multiple of :data:`ALIGN` bytes sent to
    ``triton_kernel`` (same arguments)."""
    def dequantize_and_gather_k_cache(out, k_cache, seq_lens, gather_lens, block_table,
                                      block_size, offset, use_fnuz=False):
        run = gather if (k_cache.stride(0) * k_cache.element_size()) % ALIGN == 0 \
            else triton_kernel
        return run(out, k_cache, seq_lens, gather_lens, block_table, block_size, offset,
                   use_fnuz=use_fnuz)
    dequantize_and_gather_k_cache.upstream = gather
    return dequantize_and_gather_k_cache


def apply() -> None:
    """Rebinds the name the CUDA attention module calls (once per process)."""
    import importlib

    gather = expect(CALLER, PARAMS, exact=True)
    if hasattr(gather, "upstream"):
        return
    module = importlib.import_module(CALLER.split(":")[0])
    module.dequantize_and_gather_k_cache = takes_any_stride(gather, expect(TRITON))
