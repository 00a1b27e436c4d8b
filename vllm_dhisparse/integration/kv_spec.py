"""Bounded device residency of the c4a compressed caches inside vLLM's KV pool.

vLLM sizes and admits requests from per-layer ``KVCacheSpec`` objects; its
``KVCacheSpecRegistry`` (``vllm/v1/kv_cache_spec_registry.py``) is the
out-of-tree plug point for new spec types and their block managers.  We give
the compressed caches of the sparse (c4a) layers a spec of their own,
:class:`DHiSparseCompressedSpec`, managed by :class:`DHiSparseWindowManager`:

* the spec is an ``MLAAttentionSpec`` (same page layout, same metadata
  builders, every ``isinstance`` check in the DeepSeek-V4 code still holds)
  registered with *its own* uniform-type base, so vLLM's packer puts the c4a
  layers into a KV cache group of their own, with their own block table;
  the indexer's K cache and the dense c128a cache stay in the default group
  and keep every block (the indexer must score the whole history);
* once a request's (re)prefill is complete, the manager frees, like a
  sliding window, every block that lies wholly before
  ``num_processed_tokens - device_window_tokens`` (vLLM's
  ``remove_skipped_blocks``, called from ``allocate_slots`` and when a request
  finishes), so a decoding request keeps only a bounded tail of c4a blocks
  and the scheduler admits more requests.

Nothing is skipped while a request is in prefill: chunks after the first
read the earlier chunks' rows from vLLM's cache, and a prefix-cache hit
brings cached blocks whose rows the worker imports.  vLLM's own skipping
(``get_num_skipped_tokens``) pads a hit's leading blocks with null blocks and
frees between chunks, so the window is applied here per request instead:
the manager's ``window_from`` holds, per request, the computed-token count at which
its prefill completes.  It is the connector's scheduler half's register
(``SchedulerSide.window_from``), handed to every window manager by the package's
scheduler class (scheduler.py), all in the engine-core process: the scheduler half
sets an entry for the step that completes the prefill (the worker admits the request
at the end of that forward, reading every row from vLLM's cache) and it is dropped
whenever vLLM frees the request's blocks (finish, abort, preemption), so a resumed
request is in prefill again.  The scheduler frees on the *processed*-token basis, i.e.
after the step's output came back, and the worker runs steps in order.

The packer needs the c4a specs to differ from the indexer's in a field it
buckets on (``UniformTypeKVCacheSpecs.is_uniform_type`` asks only the first
spec of a candidate bucket): we set ``dcp_sharded=False``.  That field only
matters with decode context parallelism, which the connector does not support.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self

from vllm.logger import init_logger
from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
from vllm.v1.kv_cache_interface import MLAAttentionSpec

from vllm_dhisparse.compat.targets import expect, fail

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

MANAGERS = "vllm.v1.core.single_type_kv_cache_manager"


def check() -> None:
    """What the spec and its manager need from vLLM, checked at start-up (the manager
    subclasses vLLM's and uses its block bookkeeping)."""
    expect("vllm.v1.kv_cache_interface:MLAAttentionSpec.merge", ("specs",), exact=True)
    expect("vllm.v1.kv_cache_interface:MLAAttentionSpec.dcp_sharded")
    base = f"{MANAGERS}:FullAttentionManager"
    expect(f"{base}.remove_skipped_blocks",
           ("request_id", "processed_computed_tokens", "num_prompt_tokens"), exact=True)
    expect(f"{base}.pop_blocks_for_free", ("request_id",), exact=True)
    expect(f"{base}._remove_blocks_in_range", ("request_id", "first_block"))
    # history_block_tokens: wider blocks over the backends' kernel blocks
    expect("vllm.v1.kv_cache_interface:MLAAttentionSpec.block_stride_alignment")
    expect("vllm.v1.kv_cache_interface:MLAAttentionSpec.state_content_size_bytes")
    expect("vllm.v1.worker.utils:AttentionGroup.map_kv_cache_to_kernel_blocks", ("kv_cache",))


def check_instance(manager, more: tuple[str, ...] = ()) -> None:
    """The block bookkeeping a manager of vLLM's keeps per instance."""
    for name in ("req_to_blocks", "block_size", *more):
        if not hasattr(manager, name):
            raise fail(f"{type(manager).__mro__[1].__qualname__}.{name}",
                       "the KV cache manager no longer keeps it")


@dataclass(frozen=True, kw_only=True)
class DHiSparseCompressedSpec(MLAAttentionSpec):
    """The c4a compressed cache of one sparse layer, windowed on device."""
    device_window_tokens: int = 0  # raw tokens kept behind the newest processed one; 0 = all

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        windows = {s.device_window_tokens for s in specs}
        assert len(windows) == 1, f"c4a layers disagree on device_window_tokens: {windows}"
        merged = MLAAttentionSpec.merge.__func__(cls, specs)
        return replace(merged, device_window_tokens=windows.pop(), dcp_sharded=False)


def _window_of(spec) -> int:
    w = getattr(spec, "device_window_tokens", None)
    if w is None:  # a UniformTypeKVCacheSpecs wrapper
        specs = getattr(spec, "kv_cache_specs", {}) or {}
        w = max((getattr(s, "device_window_tokens", 0) for s in specs.values()), default=0)
    return int(w or 0)


class DHiSparseWindowManager(FullAttentionManager):
    """Full-attention manager that frees blocks behind a trailing window, per
    request, from the end of its prefill on."""

    def __init__(self, kv_cache_spec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        check_instance(self)
        self.device_window_tokens = _window_of(kv_cache_spec)
        # request id -> computed tokens at which its (re)prefill completes: the scheduler
        # half's register, handed over by DHiSparseScheduler once both exist
        self.window_from: dict[str, int] | None = None

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if self.window_from is None:
            raise RuntimeError("DHiSparseWindowManager has no prefill register: the engine "
                               "must run DHiSparseScheduler (--scheduler-cls), which hands it "
                               "the connector's")
        start = self.window_from.get(request_id)
        if start is None or processed_computed_tokens < start or self.device_window_tokens <= 0:
            return  # in prefill: every block stays
        skipped = processed_computed_tokens - self.device_window_tokens
        if skipped <= 0 or request_id not in self.req_to_blocks:
            return
        blocks = min(skipped // self.block_size, len(self.req_to_blocks[request_id]))
        self._remove_blocks_in_range(request_id, 0, blocks)

    def pop_blocks_for_free(self, request_id: str):
        if self.window_from is not None:
            self.window_from.pop(request_id, None)  # finished, aborted or preempted
        return super().pop_blocks_for_free(request_id)


def windowed(spec, vllm_config):
    """The KV cache spec of a c4a layer served through the hierarchy: with a device
    window configured, :class:`DHiSparseCompressedSpec` (same fields) instead of vLLM's
    ``MLAAttentionSpec``."""
    if spec is None or type(spec) is not MLAAttentionSpec:
        return spec
    window = _configured(vllm_config, "device_window_tokens")
    if window <= 0:
        return spec
    fields = {f: getattr(spec, f) for f in spec.__dataclass_fields__}
    fields.update(device_window_tokens=window, dcp_sharded=False)
    return DHiSparseCompressedSpec(**fields)


def history_widened(spec, vllm_config):
    """The KV cache spec of a layer whose history vLLM keeps whole on device (the indexer's
    keys, a c128a cache), in blocks of ``history_block_tokens`` when that is wider.

    Every block id costs the pool's stride in every group (the widest group's bytes per
    block), so with the c4a caches windowed, history in 256-token blocks still costs a
    whole stride per 256 tokens; in wider blocks it costs one per ``history_block_tokens``.
    The backends keep their 256-token kernel blocks: vLLM maps them inside the wider
    blocks (``AttentionGroup.map_kv_cache_to_kernel_blocks``), which needs the stride to be
    a whole number of kernel pages of ``rows x row bytes``.  vLLM's own alignment for a
    fixed kernel block counts the page padded to 576 B instead (8,640 B, not 8,448 B, for
    the indexer), so the alignment is set here to the rows' bytes, as vLLM's
    ``align_blocks_to_rows`` does for sparse kernels."""
    wide = _configured(vllm_config, "history_block_tokens")
    if spec is None or type(spec) is not MLAAttentionSpec or wide <= spec.block_size:
        return spec
    if wide % spec.block_size:
        raise ValueError(f"kv_connector_extra_config['history_block_tokens'] = {wide}: must "
                         f"be a multiple of vLLM's block size {spec.block_size}")
    kernel_rows = spec.block_size // spec.tokens_per_state
    return replace(spec, block_size=wide,
                   block_stride_alignment=kernel_rows * spec.state_content_size_bytes)


def _configured(vllm_config, key: str) -> int:
    """The connector's ``key`` when DHiSparseConnector is configured, else 0."""
    from .support import connector_config
    cfg = connector_config(vllm_config)
    return 0 if cfg is None else getattr(cfg, key)
