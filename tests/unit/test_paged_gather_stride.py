"""compat/paged_gather_stride.py: pages whose stride is not a multiple of 32 B go to vLLM's
Triton gather, every other page to the gather vLLM chose; the arguments pass unchanged."""
import torch

from vllm_dhisparse.compat import paged_gather_stride as pgs


def _calls():
    seen = []

    def upstream(*args, **kw):
        seen.append(("upstream", args[1].stride(0), kw))

    def triton(*args, **kw):
        seen.append(("triton", args[1].stride(0), kw))
    return seen, pgs.takes_any_stride(upstream, triton)


def _pages(stride: int) -> torch.Tensor:
    # [num_pages, page bytes] uint8 views of one buffer, as vLLM's kernel-block mapping makes
    return torch.zeros(8 * stride, dtype=torch.uint8).as_strided((8, 584 * 2), (stride, 1))


def test_misaligned_pages_take_triton_aligned_ones_upstream():
    seen, gather = _calls()
    args = (torch.empty(1), None, None, None, None, 2, 0)
    for stride, use_fnuz in ((1168, False), (8448, True), (1168 * 4, False), (1232, False), (1280, False)):
        a = list(args)
        a[1] = _pages(stride)
        gather(*a, use_fnuz=use_fnuz)
    assert seen == [("triton", 1168, {"use_fnuz": False}),
                    ("upstream", 8448, {"use_fnuz": True}),
                    ("upstream", 4672, {"use_fnuz": False}),
                    ("triton", 1232, {"use_fnuz": False}),
                    ("upstream", 1280, {"use_fnuz": False})]


def test_apply_rebinds_vllms_name_once():
    import importlib

    module = importlib.import_module(pgs.CALLER.split(":")[0])
    before = module.dequantize_and_gather_k_cache
    try:
        pgs.apply()
        wrapped = module.dequantize_and_gather_k_cache
        assert wrapped.upstream is before
        pgs.apply()
        assert module.dequantize_and_gather_k_cache is wrapped
    finally:
        module.dequantize_and_gather_k_cache = before
