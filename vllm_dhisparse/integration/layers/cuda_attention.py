"""DeepSeek-V4's FlashMLA attention (CUDA, SM90/SM100) with the c4a decode read through
the hierarchy.

``DeepseekV4FlashMLAAttention.forward_mqa`` (vLLM 0.33, ``models/deepseek_v4/nvidia/
flashmla.py``) splits a batch into decode and prefill tokens and calls
``_forward_decode`` for the decode part.  :class:`RoutedDeepseekV4FlashMLAAttention`
overrides only that method, and only for a c4a layer bound to its source's
:class:`~vllm_dhisparse.flashmla.decode.RoutedDecode` (its ``routed``, set by the worker's
binding, decode_binding.py): it makes vLLM's
FlashMLA call with two arguments changed -- ``extra_k_cache`` is the hierarchy's
storage (its rows are byte-identical to vLLM's c4a rows) and
``extra_indices_in_kvcache`` the storage rows ``RoutedDecode.locations`` found on the
device.  The sliding window, its indices, the tile schedule, the lengths and the
sink are vLLM's.  Prefill, the warm-up run and unbound layers stay upstream.

Under vLLM's FULL CUDA graphs ``_forward_decode`` runs in Python only at capture:
the binding is made once, before capture (the worker's ``register_kv_caches``), and
every tensor the captured call reads lives as long as the engine.
"""
from __future__ import annotations

from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
from vllm.v1.attention.ops.flashmla import flash_mla_with_kvcache

from vllm_dhisparse.compat.targets import expect
from vllm_dhisparse.flashmla.decode import RoutedDecode

from .. import kv_spec

UPSTREAM = "vllm.models.deepseek_v4.nvidia.flashmla:DeepseekV4FlashMLAAttention"


def check() -> None:
    """What this module needs from vLLM, checked at start-up."""
    expect(f"{UPSTREAM}._forward_decode",
           ("q", "kv_cache", "swa_metadata", "attn_metadata", "swa_only", "output"), exact=True)
    expect(f"{UPSTREAM}.get_kv_cache_spec", ("vllm_config",), exact=True)
    # vLLM re-exports FlashMLA's interface only where the kernel loads (a stub elsewhere);
    # its keywords are the ones benchmarks/gpu_fmla_*.py call on the H200
    expect("vllm.v1.attention.ops.flashmla:flash_mla_with_kvcache")


class RoutedDeepseekV4FlashMLAAttention(DeepseekV4FlashMLAAttention):
    """A c4a layer (compress ratio 4, top-k indexer) whose history the hierarchy holds."""
    routed: RoutedDecode | None = None  # its source's routing; None: upstream's decode

    def get_kv_cache_spec(self, vllm_config):
        return kv_spec.windowed(super().get_kv_cache_spec(vllm_config), vllm_config)

    def _forward_decode(self, q, kv_cache, swa_metadata, attn_metadata, swa_only, output):
        routed = self.routed
        if routed is None or swa_only or self.compress_ratio != 4:
            return super()._forward_decode(q, kv_cache, swa_metadata, attn_metadata,
                                           swa_only, output)
        t, n = swa_metadata.num_decode_tokens, swa_metadata.num_decodes
        locations, lens = routed.locations(
            self.topk_indices_buffer[:t], swa_metadata.token_to_req_indices[:t],
            swa_metadata.query_start_loc[:n + 1], attn_metadata.block_table[:n],
            swa_metadata.seq_lens[:n], swa_metadata.is_valid_token[:t], kv_cache)
        flash_mla_with_kvcache(
            q=q.unsqueeze(1),  # [T, 1, H, 512]: every token its own batch entry, as upstream
            k_cache=self.swa_cache_layer.kv_cache.unsqueeze(-2),
            block_table=None,
            head_dim_v=512,
            tile_scheduler_metadata=swa_metadata.tile_sched_c4a,
            cache_seqlens=None,
            is_fp8_kvcache=True,
            indices=swa_metadata.decode_swa_indices,
            topk_length=swa_metadata.decode_swa_lens,
            softmax_scale=self.scale,
            attn_sink=self.attn_sink,
            extra_k_cache=routed.pool_view,  # [1, R, 1, 584] the hierarchy's rows in place
            extra_indices_in_kvcache=locations.view(t, 1, -1),
            extra_topk_length=lens,
            out=output.unsqueeze(1),
        )
