"""Finds the hierarchy-managed KV sources of a loaded model.

For DeepSeek-V4 these are the compressed caches of the layers whose sparse
indexer chooses top-k rows (``compress_ratio == 4``, "c4a").  The dense
compressed (c128a) and sliding-window parts stay in vLLM's cache.
"""
from __future__ import annotations

from dataclasses import dataclass

from vllm.logger import init_logger

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

FP8_DS_MLA_ROW_BYTES = 584  # 448 B fp8 NoPE + 128 B bf16 RoPE + 8 B scales (attention.py:876)
FP8_DS_MLA_PLANE_BYTES = (576, 8)  # a block stores all rows' 576 data bytes, then all scale bytes


@dataclass(frozen=True)
class SparseLayer:
    name: str  # the attention layer's prefix: its KV cache and metadata key
    compress_ratio: int  # raw tokens per stored row (m of eq. 8)
    top_k: int  # rows the indexer selects per query
    row_bytes: int
    rows_per_block: int  # stored rows per vLLM block
    group: int  # KV cache group whose block table addresses this cache
    plane_bytes: tuple[int, ...] = FP8_DS_MLA_PLANE_BYTES  # planes of a row inside a block


def require_sparse_indexer(model_config) -> int:
    """Startup check: the model must have a sparse indexer; returns its top-k."""
    hf = model_config.hf_text_config
    top_k = getattr(hf, "index_topk", None)
    if not top_k:
        raise ValueError(
            f"DHiSparseConnector needs a model with a sparse-attention indexer (config "
            f"'index_topk'); model {model_config.model!r} (architectures "
            f"{getattr(hf, 'architectures', None)}) has none")
    return int(top_k)


def is_sparse_layer(module) -> bool:
    """A c4a attention layer: compress ratio 4 with a top-k indexer."""
    return getattr(module, "compress_ratio", None) == 4 \
        and getattr(module, "topk_indices_buffer", None) is not None


def iter_sparse_modules(vllm_config):
    """``(name, module)`` of the loaded model's c4a attention layers (compress ratio 4
    with a top-k indexer); raises ``ValueError`` if there are none or their cache is not
    ``fp8_ds_mla``."""
    found = []
    for name, module in vllm_config.compilation_config.static_forward_context.items():
        if not is_sparse_layer(module):
            continue
        if getattr(module, "kv_cache_dtype", None) != "fp8_ds_mla":
            raise ValueError(f"layer {name!r}: DHiSparse supports kv_cache_dtype 'fp8_ds_mla' for "
                             f"DeepSeek-V4, got {getattr(module, 'kv_cache_dtype', None)!r}")
        found.append((name, module))
    if not found:
        raise ValueError("DHiSparseConnector found no attention layer with a sparse indexer "
                         "(compress_ratio 4 with top-k); only DeepSeek-V4-architecture models are "
                         "supported in this version")
    return found


def find_sparse_layers(vllm_config, kv_cache_config) -> list[SparseLayer]:
    group_of, group_block = {}, {}
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        for name in group.layer_names:
            group_of[name] = g
        group_block[g] = group.kv_cache_spec.block_size  # tokens per block of this group
    layers = []
    for name, module in iter_sparse_modules(vllm_config):
        if name not in group_of:
            raise ValueError(f"sparse layer {name!r} is in no KV cache group")
        ratio = module.compress_ratio
        layers.append(SparseLayer(
            name=name, compress_ratio=ratio, top_k=int(module.topk_indices_buffer.shape[1]),
            row_bytes=FP8_DS_MLA_ROW_BYTES, rows_per_block=group_block[group_of[name]] // ratio,
            group=group_of[name]))
    logger.info("DHiSparse manages %d sparse layers: %s", len(layers), layers)
    return layers
