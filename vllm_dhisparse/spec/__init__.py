"""Speculative decoding over the hierarchy: DSpark and DFlash2 presets.

Proposals and acceptance stay upstream (vLLM's Model Runner V2 speculators and its
lossless rejection sampler); this package maps a preset to vLLM's
``speculative_config``, refuses what cannot work, and sizes the draft ring and the
verification staging (paper eq. 9, 11).
"""
from .presets import (SPEC_METHODS, SpecPreset, check_engine, draft_window,
                      preset_from_vllm, read_drafter, ring_sizes)

__all__ = ["SPEC_METHODS", "SpecPreset", "check_engine", "draft_window", "preset_from_vllm",
           "read_drafter", "ring_sizes"]
