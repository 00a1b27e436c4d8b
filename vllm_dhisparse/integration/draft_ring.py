"""The draft_ring: a drafter's KV is window-bounded on device, in prefill too without prefix
caching (eq. 9-10).

A DSpark / DFlash2 drafter attends to the last W tokens only, but vLLM gives it a
``SlidingWindowSpec`` whose manager frees blocks behind the window from the first
decode step on: in the prefill step it allocates a block for every prompt token
(the drafter's context-KV injection then writes all of them), so a 7000-token prompt
holds 28 draft blocks at p = 256 for one step.  A drafter without a per-layer window
inherits the target's ``sliding_window`` silently (``attention.py``: the model-level
window is the fallback).

Here the drafter's layers (``get_draft_kv_cache_layer_names`` of the loaded drafter)
get :class:`DraftRingSpec`, a ``SlidingWindowSpec`` with the drafter's own window W
and K_max, managed by :class:`DraftRingManager`: a new block that lies wholly before
``num_tokens - W - K_max`` (no draft query of this step or a later one reads it) is
the null block, whose slots the injection skips, and the real blocks of earlier
prefill chunks behind that point are freed at once.  So a request holds at most
``R_d / p = ceil((W + p - 1 + K_max) / p)`` draft blocks at every step, chunked
prefill included (without prefix caching; below).  The null blocks are returned with
the new ones, because the worker appends what an allocation returns to its block
table.  Decode frees as vLLM's sliding window does.  The connector refuses a drafter
without a window of its own (spec/presets.py), and the ring refuses a layer that attends
over another window.

Admission counts the ring too: the spec's per-request cap (vLLM's startup sizer and
its admission gate) is R_d / p without prefix caching, and the manager's count of
blocks an allocation needs is the real blocks the ring will take, so a long prompt is
admitted on its ring, not on every prompt block.

With prefix caching the prefill bound is off (``DraftRingSpec.bounds_prefill``): a
later request's hit at h tokens needs the drafter's KV of the W tokens before h, and
that KV exists only if the earlier request's prefill wrote it into blocks that outlive
the step, freed behind the window into the prefix cache as vLLM's sliding window does.
A ring of null blocks behind its window finds no hit, and vLLM takes the smallest hit
over the groups: every group of a speculating request would recompute its whole prompt.
So prefill steps then hold what they write (at most the step's token budget / p blocks
on top of the ring), admission and the start-up sizer count as vLLM's window does, hits
equal resident serving's, and decode holds R_d / p as before.  The scheduler's manager
refuses a spec whose mode disagrees with its own prefix caching (vLLM can turn caching
off after the worker built the specs, e.g. for a non-causal layer).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Self

from vllm.logger import init_logger
from vllm.utils.math_utils import cdiv
from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
from vllm.v1.kv_cache_interface import SlidingWindowSpec

from vllm_dhisparse.compat.targets import expect
from vllm_dhisparse.hierarchy.sizing import draft_ring_rows

from .kv_spec import MANAGERS, check_instance

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level


def check() -> None:
    """What the ring's spec and manager need from vLLM, checked at start-up."""
    spec = "vllm.v1.kv_cache_interface:SlidingWindowSpec"
    expect(f"{spec}.merge", ("specs",), exact=True)
    expect(f"{spec}.max_admission_blocks_per_request",
           ("max_in_flight_tokens", "max_model_len"), exact=True)
    base = f"{MANAGERS}:SlidingWindowManager"
    expect(f"{base}.get_num_blocks_to_allocate",
           ("request_id", "num_tokens", "new_computed_blocks", "total_computed_tokens",
            "num_local_computed_tokens", "num_tokens_main_model", "apply_admission_cap",
            "prefill_end"), exact=True)
    expect(f"{base}.allocate_new_blocks", ("request_id", "num_tokens", "num_tokens_main_model"),
           exact=True)
    expect(f"{base}._get_num_evictable_blocks", ("blocks",))
    expect(f"{base}._has_partial_local_hit",
           ("new_computed_blocks", "num_local_computed_tokens"))
    expect(f"{base}._remove_blocks_in_range", ("request_id", "first_block"))


@dataclass(frozen=True, kw_only=True)
class DraftRingSpec(SlidingWindowSpec):
    """A drafter layer's KV: sliding window W, bounded in prefill as well unless prefix
    caching needs the prefill's blocks."""
    k_max: int = 1  # verification queries per request: drafts read K_max - 1 slots ahead
    bounds_prefill: bool = True  # False with prefix caching

    @classmethod
    def merge(cls, specs: list[Self]) -> Self:
        k_max = {s.k_max for s in specs}
        bounds = {s.bounds_prefill for s in specs}
        assert len(k_max) == 1, f"draft layers disagree on k_max: {k_max}"
        assert len(bounds) == 1, f"draft layers disagree on bounds_prefill: {bounds}"
        merged = SlidingWindowSpec.merge.__func__(cls, specs)
        return replace(merged, k_max=k_max.pop(), bounds_prefill=bounds.pop())

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        """R_d / p whatever the chunk: the ring frees behind itself before it allocates
        (vLLM's window holds the in-flight tokens on top, as the ring does when it keeps
        prefill blocks for the prefix cache)."""
        if not self.bounds_prefill:
            return super().max_admission_blocks_per_request(max_in_flight_tokens, max_model_len)
        rows = draft_ring_rows(self.sliding_window, self.block_size, self.k_max)
        return min(rows // self.block_size, cdiv(max_model_len, self.block_size))


class DraftRingManager(SlidingWindowManager):
    def __init__(self, kv_cache_spec, **kwargs) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        check_instance(self, ("num_cached_block", "_null_block", "enable_caching",
                              "sliding_window"))
        specs = getattr(kv_cache_spec, "kv_cache_specs", None)  # a uniform-type wrapper
        specs = list(specs.values()) if specs else [kv_cache_spec]
        self.k_max = max(s.k_max for s in specs)
        self.bounds_prefill = all(s.bounds_prefill for s in specs)
        if self.bounds_prefill == self.enable_caching:
            # a bounded ring finds no prefix hit; an unbounded one without caching holds
            # the prefill's blocks for nothing
            raise ValueError(f"the draft ring was built for prefix caching "
                             f"{'off' if self.bounds_prefill else 'on'}, but the scheduler "
                             f"runs with it {'on' if self.enable_caching else 'off'}; start "
                             f"with --enable-prefix-caching or --no-enable-prefix-caching "
                             f"explicitly")

    def ring_start_blocks(self, num_tokens: int) -> int:
        """Leading blocks no draft query reads once ``num_tokens`` slots exist."""
        return max(0, num_tokens - self.sliding_window - self.k_max) // self.block_size

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks,
                                   total_computed_tokens, num_local_computed_tokens,
                                   num_tokens_main_model, apply_admission_cap=False,
                                   prefill_end=0) -> int:
        """The blocks ``allocate_new_blocks`` will take from the pool: the real ones from
        the ring start on (the pool gets the ones behind it back first), plus what vLLM
        counts for a new request's prefix hit (hit blocks leaving the free queue, the
        copy of a partial hit).  Never more than vLLM's sliding-window count, and
        vLLM's count itself when a connector supplies tokens (their blocks are taken
        before the ring frees anything)."""
        vllm_count = super().get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks, total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model, apply_admission_cap, prefill_end)
        if not self.bounds_prefill:
            return vllm_count
        new = request_id not in self.num_cached_block
        if new and total_computed_tokens > num_local_computed_tokens:
            return vllm_count
        held = len(self.req_to_blocks.get(request_id, ())) + len(new_computed_blocks)
        ring = max(0, cdiv(num_tokens, self.block_size)
                   - max(held, self.ring_start_blocks(num_tokens)))
        if new:
            ring += self._get_num_evictable_blocks(new_computed_blocks)
            ring += int(self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens))
        return min(vllm_count, ring)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int):
        if not self.bounds_prefill:
            return super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
        blocks = self.req_to_blocks[request_id]
        start = self.ring_start_blocks(num_tokens)
        # blocks of earlier chunks behind this step's ring are freed now, not one step
        # later (vLLM frees behind the *processed* tokens), so a chunked prefill holds R_d;
        # the real blocks then always form one run at the end, which vLLM's backward free
        # (it stops at the first null) reaches whole
        self._remove_blocks_in_range(request_id, 0, min(start, len(blocks)))
        pad = [self._null_block] * max(0, start - len(blocks))
        blocks.extend(pad)
        # the worker appends what is returned to its block table: the null blocks too, so
        # both tables keep one layout (a later chunk's blocks land at their positions)
        return pad + super().allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)


def ring_block_size(kv_cache_config) -> int | None:
    """p of the KV cache group that holds the draft ring, None without one."""
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or ():
        spec = group.kv_cache_spec  # the worker's groups wrap their layers' specs
        for s in (getattr(spec, "kv_cache_specs", None) or {"": spec}).values():
            if isinstance(s, DraftRingSpec):
                return s.block_size
    return None


def ring_specs(specs: dict, draft_layers: list[str], window: int, k_max: int,
               bounds_prefill: bool = True) -> dict:
    """``specs`` with every draft layer's spec turned into a :class:`DraftRingSpec` of the
    same window: the window the layer attends with (its own spec's) must be ``window``,
    the W that sizes R_d."""
    out = dict(specs)
    for name in draft_layers:
        spec = out.get(name)
        if spec is None:
            continue
        if type(spec) is not SlidingWindowSpec:
            raise ValueError(f"draft layer {name!r} has a {type(spec).__name__}; the draft ring "
                             f"bounds standard sliding-window attention layers only")
        if spec.sliding_window != window:
            raise ValueError(f"draft layer {name!r} attends over {spec.sliding_window} tokens, "
                             f"but the drafter's config says {window}; the draft ring needs the "
                             f"window the layer uses")
        keep = {f.name: getattr(spec, f.name) for f in fields(spec)}
        out[name] = DraftRingSpec(**keep, k_max=k_max, bounds_prefill=bounds_prefill)
    return out


def with_draft_ring(vllm_config, model_runner, specs: dict) -> dict:
    """``specs`` (the worker's KV cache specs) with a DSpark / DFlash2 drafter's layers
    turned into :class:`DraftRingSpec`; unchanged without such a drafter."""
    sizes = _draft_sizes(vllm_config)
    model = getattr(getattr(model_runner, "speculator", None), "model", None)
    if sizes is None or model is None:
        return specs
    names = getattr(model, "get_draft_kv_cache_layer_names", None)
    if names is None:
        raise ValueError(f"the {sizes['preset']} drafter {type(model).__name__} does not name "
                         f"its KV layers (get_draft_kv_cache_layer_names); the draft ring "
                         f"cannot bound it")
    out = ring_specs(specs, list(names()), sizes["draft_window"], sizes["k_max"],
                     sizes["draft_ring_bounds_prefill"])  # checks W
    logger.info("DHiSparse draft ring: %d drafter layers, window %d, K_max %d, %s",
                len(names()), sizes["draft_window"], sizes["k_max"],
                "bounded in prefill" if sizes["draft_ring_bounds_prefill"] else
                "prefill blocks kept for the prefix cache")
    return out


def _draft_sizes(vllm_config) -> dict | None:
    """spec.check_engine's sizes when DHiSparseConnector runs a DSpark / DFlash2 drafter."""
    from vllm_dhisparse.spec import check_engine

    from .support import connector_config
    cfg = connector_config(vllm_config)
    return None if cfg is None else check_engine(vllm_config, cfg.spec)
