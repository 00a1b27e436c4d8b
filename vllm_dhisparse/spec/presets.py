"""DSpark / DFlash2 presets: a drafter directory and K -> vLLM's ``speculative_config``.

vLLM selects the speculator from ``speculative_config.method`` and the drafter's
``architectures`` (``v1/worker/gpu/spec_decode/__init__.py``): DSpark is method
``dspark``; DFlash2 is method ``dflash`` with a ``DFlash2DraftModel`` drafter.  Both
exist only in Model Runner V2.  Everything here reads configs, never weights.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_dhisparse.hierarchy.sizing import draft_ring_rows

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# preset -> (vLLM method, drafter architectures it accepts)
SPEC_METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "dspark": ("dspark", ("Qwen3DSparkModel", "DSparkDraftModel")),
    "dflash2": ("dflash", ("DFlash2DraftModel", "DFlash2BeamDraftModel")),
}


def read_drafter(model: str, method: str) -> dict[str, Any]:
    """The drafter's ``config.json``, checked against the preset's architectures."""
    if method not in SPEC_METHODS:
        raise ValueError(f"spec = {method!r}: allowed values are {sorted(SPEC_METHODS)}")
    path = os.path.join(model, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"spec = {method!r}: drafter directory {model!r} has no config.json "
                         f"(build the demo drafters with vllm_dhisparse/demo_build/drafters.py)")
    with open(path) as f:
        cfg = json.load(f)
    archs = tuple(cfg.get("architectures") or ())
    allowed = SPEC_METHODS[method][1]
    if not set(archs) & set(allowed):
        raise ValueError(f"spec = {method!r}: drafter {model!r} has architectures {list(archs)}; "
                         f"a {method} drafter is one of {list(allowed)}")
    return cfg


def draft_window(drafter_cfg: dict[str, Any]) -> int | None:
    """W of a drafter whose every layer is sliding-window attention, else None (a full-
    attention drafter has no window of its own).  Read as vLLM's DFlash / DSpark layers
    read it (``qwen3_dflash.py``): ``dflash_config.use_swa`` makes every layer sliding,
    else ``layer_types``; the window is ``dflash_config.swa_window_size``, else
    ``sliding_window`` (which transformers drops unless ``use_sliding_window``)."""
    dfl = drafter_cfg.get("dflash_config") or {}
    types = drafter_cfg.get("layer_types")
    if dfl.get("use_swa"):
        sliding = True
    elif types:
        sliding = all(t == "sliding_attention" for t in types)
    else:
        sliding = False
    window = dfl.get("swa_window_size", drafter_cfg.get("sliding_window"))
    if not sliding or not window or drafter_cfg.get("use_sliding_window") is False:
        return None
    return int(window)


@dataclass(frozen=True)
class SpecPreset:
    method: str  # dspark | dflash2
    model: str  # drafter directory
    num_speculative_tokens: int

    def __post_init__(self):
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"num_speculative_tokens = {k!r}: must be an int >= 1")
        read_drafter(self.model, self.method)

    @property
    def k_max(self) -> int:
        return 1 + self.num_speculative_tokens

    def speculative_config(self, cuda: bool = False) -> dict[str, Any]:
        """vLLM's ``speculative_config`` for this preset (``cuda``: for vLLM's CUDA engine)."""
        config = {"method": SPEC_METHODS[self.method][0], "model": self.model,
                  "num_speculative_tokens": self.num_speculative_tokens}
        if cuda:
            # DeepSeek-V4's attention sets the engine's cache dtype to fp8_ds_mla on CUDA; a
            # Qwen3-style drafter would inherit it, and no drafter attention backend stores it
            config["kv_cache_dtype"] = "auto"
        return config


def preset_from_vllm(vllm_config: "VllmConfig") -> tuple[str, int, dict | None] | None:
    """(preset, K, drafter config) of the engine's speculative_config when it is DSpark or
    DFlash2; None without speculation; ("other", K, None) for any other method."""
    spec = vllm_config.speculative_config
    if spec is None:
        return None
    k = int(spec.num_speculative_tokens or 0)
    draft = getattr(spec, "draft_model_config", None)
    archs = set(getattr(draft, "architectures", None) or ())
    hf = getattr(draft, "hf_config", None)
    cfg = hf.to_dict() if hasattr(hf, "to_dict") else None
    for name, (method, allowed) in SPEC_METHODS.items():
        if spec.method == method and archs & set(allowed):
            return name, k, cfg
    return "other", k, None


def check_engine(vllm_config: "VllmConfig", spec: str) -> dict[str, Any] | None:
    """Refuses a speculative setup the hierarchy cannot serve; returns its draft sizes.

    ``spec`` is the connector's key: '' accepts whatever the engine runs, 'dspark' /
    'dflash2' require the engine to run that preset."""
    found = preset_from_vllm(vllm_config)
    name = found[0] if found else None
    if spec and name != spec:
        raise ValueError(f"kv_connector_extra_config['spec'] = {spec!r}, but the engine's "
                         f"speculative_config is {_describe(vllm_config)}; pass "
                         f"--speculative-config from vllm_dhisparse.spec.SpecPreset("
                         f"{spec!r}, DRAFTER_DIR, K).speculative_config() (or `vllm-dhisparse "
                         f"serve --spec {spec}`)")
    if found is None or name == "other":
        return None
    _, k, cfg = found
    if not vllm_config.use_v2_model_runner:
        raise ValueError(f"speculative decoding with {name} needs vLLM's Model Runner V2 "
                         f"(its speculator exists only there); unset VLLM_USE_V2_MODEL_RUNNER=0 "
                         f"or set VLLM_USE_V2_MODEL_RUNNER=1")
    if vllm_config.load_config.load_format == "dummy":  # DSpark is a DFlash-family model too
        raise ValueError(f"load_format='dummy' leaves the {name} drafter (DFlash family) without "
                         f"the fused context-KV weights on CPU; load a real drafter checkpoint")
    window = draft_window(cfg or {})
    if window is None:
        raise ValueError(f"the {name} drafter has no sliding window of its own (its config.json "
                         f"needs every layer in layer_types 'sliding_attention', sliding_window "
                         f"W and use_sliding_window true, or dflash_config use_swa and "
                         f"swa_window_size); the draft ring bounds a drafter's KV by its window "
                         f"W, and a drafter must not inherit the target's "
                         f"(vllm_dhisparse/demo_build/drafters.py --window)")
    # with prefix caching the ring keeps what a prefill step writes (draft_ring.py)
    bounds_prefill = not vllm_config.cache_config.enable_prefix_caching
    return dict(preset=name, num_speculative_tokens=k, k_max=1 + k, draft_window=window,
                draft_ring_bounds_prefill=bounds_prefill)


def ring_sizes(sizes: dict[str, Any], block_size: int) -> dict[str, Any]:
    """R_d (eq. 9) in rows and blocks for the draft group's block size p."""
    rows = draft_ring_rows(sizes["draft_window"], block_size, sizes["k_max"])
    return dict(draft_block_size=block_size, draft_ring_rows=rows,
                draft_ring_blocks=rows // block_size)


def _describe(vllm_config: "VllmConfig") -> str:
    spec = vllm_config.speculative_config
    if spec is None:
        return "not set (no speculation)"
    return f"method {spec.method!r}"
