"""vLLM 0.33's prefill gather over c128a pages inside wider history blocks (CUDA).

With ``history_block_tokens`` a c128a kernel page is 2 rows x 584 B = 1,168 B apart, which
vLLM's CuTe-DSL gather refuses; compat/paged_gather_stride.py sends those pages to vLLM's
Triton gather.  The same pages, 1,168 B apart through the shimmed call and 1,280 B apart
(32-B aligned) through vLLM's own choice, must gather to the same bf16 bits.  Needs a CUDA
GPU and vLLM 0.33; skipped elsewhere.
"""
import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="needs a CUDA GPU of compute capability 9.x or 10.x")]

ROWS, DATA, SCALES, ROW = 2, 576, 8, 584  # a c128a kernel page: 256 tokens / 128
PAGES = 96


def _pages(g: torch.Generator) -> torch.Tensor:
    """[PAGES, ROWS * ROW] uint8: per page, ROWS rows of 448 fp8 + 64 bf16, then their
    8 UE8M0 scale bytes each (7 used)."""
    nope = (torch.rand(PAGES, ROWS, 448, generator=g) * 2 - 1) * 400
    rope = torch.randn(PAGES, ROWS, 64, generator=g).to(torch.bfloat16)
    data = torch.cat([nope.to(torch.float8_e4m3fn).view(torch.uint8),
                      rope.view(torch.uint8)], dim=-1)  # [P, R, 576]
    scales = torch.randint(117, 137, (PAGES, ROWS, SCALES), generator=g, dtype=torch.uint8)
    return torch.cat([data.reshape(PAGES, -1), scales.reshape(PAGES, -1)], dim=1)


def _paged(pages: torch.Tensor, stride: int) -> torch.Tensor:
    buf = torch.zeros(PAGES * stride + ROW, dtype=torch.uint8, device="cuda")
    view = buf.as_strided((PAGES, ROWS * ROW), (stride, 1))
    view.copy_(pages.cuda())
    return buf.as_strided((PAGES, ROWS, ROW), (stride, ROW, 1))


def test_misaligned_pages_gather_the_bits_aligned_pages_gather():
    pytest.importorskip("vllm")
    import vllm
    if not vllm.__version__.startswith("0.33"):
        pytest.skip(f"needs vLLM 0.33, found {vllm.__version__}")
    from vllm.models.deepseek_v4.nvidia import flashmla
    from vllm.utils.import_utils import has_cutedsl

    from vllm_dhisparse.compat import paged_gather_stride

    if not has_cutedsl():  # both strides would take the Triton gather: nothing compared
        pytest.skip("CuTe DSL is not installed: vLLM gathers every page with Triton")

    g = torch.Generator().manual_seed(0)
    pages = _pages(g)
    seq_rows = torch.tensor([37, 48, 5, 1], dtype=torch.int32, device="cuda")
    table = torch.randperm(PAGES, generator=g)[:4 * 24].view(4, 24).to(torch.int32).cuda()
    upstream = flashmla.dequantize_and_gather_k_cache
    with pytest.raises(Exception, match="divisible by 32"):  # what the shim is for
        upstream(torch.zeros(4, 48, 512, dtype=torch.bfloat16, device="cuda"),
                 _paged(pages, 1168), seq_rows, None, table, ROWS, 0)
    paged_gather_stride.apply()
    try:
        outs = {}
        for stride in (1168, 1280):
            out = torch.zeros(4, 48, 512, dtype=torch.bfloat16, device="cuda")
            flashmla.dequantize_and_gather_k_cache(out, _paged(pages, stride), seq_rows, None,
                                                   table, ROWS, 0)
            outs[stride] = out
        torch.cuda.synchronize()
    finally:
        flashmla.dequantize_and_gather_k_cache = upstream
    assert outs[1280].abs().sum() > 0
    assert torch.equal(outs[1168].view(torch.int16), outs[1280].view(torch.int16))
