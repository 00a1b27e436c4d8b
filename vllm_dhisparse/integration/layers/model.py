"""DeepSeek-V4 as the connector serves it, registered with vLLM's ``ModelRegistry``.

The plugin registers :class:`DHiSparseDeepseekV4ForCausalLM` under vLLM's own
architecture name ``DeepseekV4ForCausalLM`` (lazily, by qualified name).  It is vLLM's
model class; with DHiSparseConnector configured, its c4a attention layers (compress
ratio 4 with a top-k indexer) become the platform's routed attention class, which reads
their top-k rows through the hierarchy and declares their windowed KV cache spec.  With
``history_block_tokens`` set, the layers whose history vLLM keeps whole on device (the
indexer's key caches, the c128a attention layers) declare it in those wider blocks
(``kv_spec.history_widened``).  Without the connector the model is exactly vLLM's.

The swap changes the class of the already-built layer objects, as vLLM's own CPU
attention does for its compressor and indexer (``cpu/cpu_sparse.py``): weights,
buffers and the layer's place in vLLM's forward context stay as they are.
"""
from __future__ import annotations

from vllm.logger import init_logger
from vllm.models.deepseek_v4 import DeepseekV4ForCausalLM
from vllm.models.deepseek_v4.attention import DeepseekV4Attention, DeepseekV4IndexerCache
from vllm.platforms import current_platform

from vllm_dhisparse.compat.targets import expect, fail

from .. import kv_spec
from .model_probe import is_sparse_layer
from ..support import connector_config

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


def routed_attention_cls() -> type:
    """The routed c4a attention class of this platform."""
    if current_platform.is_cpu():
        from . import cpu_attention
        cpu_attention.check()
        return cpu_attention.RoutedDeepseekV4CPUAttention
    if current_platform.is_cuda():
        from . import cuda_attention
        cuda_attention.check()
        return cuda_attention.RoutedDeepseekV4FlashMLAAttention
    raise fail("DeepSeek-V4 attention", f"no routed attention class for platform "
                                        f"{current_platform.device_name!r}")


def check() -> None:
    """What this module needs from vLLM, checked at start-up."""
    expect("vllm.models.deepseek_v4:DeepseekV4ForCausalLM", ("vllm_config", "prefix"),
           exact=True)
    expect("vllm.models.deepseek_v4.attention:DeepseekV4Attention")
    expect("vllm.models.deepseek_v4.attention:DeepseekV4IndexerCache.get_kv_cache_spec",
           ("vllm_config",), exact=True)
    routed_attention_cls()


def route_sparse_layers(model) -> int:
    """Turns every c4a attention layer of ``model`` into the routed class; their count."""
    routed = routed_attention_cls()
    upstream = routed.__mro__[1]
    n = 0
    for name, module in model.named_modules():
        if not isinstance(module, DeepseekV4Attention) or not is_sparse_layer(module):
            continue
        if type(module) is not upstream and type(module) is not routed:
            raise ValueError(f"DHiSparseConnector: c4a layer {name!r} is a "
                             f"{type(module).__qualname__}, not vLLM's {upstream.__qualname__}; "
                             f"this attention backend is not supported (on CUDA: vLLM's "
                             f"FlashMLA sparse backend, SM90/SM100)")
        module.__class__ = routed
        n += 1
    if not n:
        raise ValueError("DHiSparseConnector found no attention layer with a sparse indexer "
                         "(compress_ratio 4 with top-k) in the DeepSeek-V4 model")
    logger.info("DHiSparse: %d c4a attention layers read through the hierarchy (%s)", n,
                routed.__qualname__)
    return n


class WideHistory:
    """Mixin for a layer whose history vLLM keeps whole on device: its KV cache spec in
    ``history_block_tokens``-token blocks."""

    def get_kv_cache_spec(self, vllm_config):
        return kv_spec.history_widened(super().get_kv_cache_spec(vllm_config), vllm_config)


_WIDE_CLASSES: dict[type, type] = {}


def _wide_history_cls(cls: type) -> type:
    """``cls`` with :class:`WideHistory` in front (one class per platform layer class)."""
    if cls not in _WIDE_CLASSES:
        _WIDE_CLASSES[cls] = type(f"WideHistory{cls.__name__}", (WideHistory, cls),
                                  {"__module__": __name__})
    return _WIDE_CLASSES[cls]


def is_history_layer(module) -> bool:
    """A layer whose compressed history vLLM keeps whole: an indexer's key cache, or a
    c128a attention layer (dense over its compressed rows)."""
    if isinstance(module, DeepseekV4IndexerCache):
        return True
    return isinstance(module, DeepseekV4Attention) and \
        getattr(module, "compress_ratio", None) == 128


def widen_history_layers(model) -> int:
    """Gives every history layer of ``model`` the wider-block spec; their count."""
    n = 0
    for _, module in model.named_modules():
        if is_history_layer(module) and not isinstance(module, WideHistory):
            module.__class__ = _wide_history_cls(type(module))
            n += 1
    return n


class DHiSparseDeepseekV4ForCausalLM(DeepseekV4ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        cfg = connector_config(vllm_config)
        if cfg is not None:
            route_sparse_layers(self)
            if cfg.history_block_tokens:
                if current_platform.is_cuda():
                    from vllm_dhisparse.compat import paged_gather_stride
                    paged_gather_stride.apply()  # c128a pages of 1,168 B in wider blocks
                n = widen_history_layers(self)
                logger.info("DHiSparse: %d history layers (indexer keys, c128a) in %d-token "
                            "blocks", n, cfg.history_block_tokens)


def is_routed(module) -> bool:
    return type(module) is routed_attention_cls()
