"""The routed FlashMLA attention class against vLLM 0.33's own DeepSeek-V4 CUDA classes.

vLLM 0.33's Python runs here on a CPU; its FlashMLA and Triton kernels do not.  The
kernel is replaced, in vLLM's module and ours alike, by the torch reference of its V4
sparse decode (``flashmla/reference.py``, held to the real kernel on the H200) and vLLM's
global-index Triton kernel by its torch equivalent.  What this proves: the subclass is
what the registered model swaps in on CUDA, its start-up checks hold against 0.33, and
its ``_forward_decode`` makes upstream's call with exactly two arguments changed and
gives, for every token the hierarchy serves, upstream's output on vLLM's blocks."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import vllm.models.deepseek_v4.nvidia.flashmla as upstream_mod
from vllm.models.deepseek_v4.nvidia.flashinfer_sparse import DeepseekV4FlashInferSM120Attention
from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention

from vllm_dhisparse.compat.targets import IntegrationError
from vllm_dhisparse.flashmla import layout as L
from vllm_dhisparse.flashmla import routing as R
from vllm_dhisparse.flashmla.reference import sparse_decode
from vllm_dhisparse.integration.layers import cuda_attention, model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_fmla_decode as G  # noqa: E402


class Cuda:
    device_name = "cuda"

    def is_cpu(self):
        return False

    def is_cuda(self):
        return True


@pytest.fixture
def on_cuda(monkeypatch):
    monkeypatch.setattr(model, "current_platform", Cuda())


def test_the_cuda_class_is_vllms_flashmla_class_routed(on_cuda):
    cls = model.routed_attention_cls()
    assert cls is cuda_attention.RoutedDeepseekV4FlashMLAAttention
    assert cls.__mro__[1] is DeepseekV4FlashMLAAttention


def test_a_resigned_decode_stops_start_up(on_cuda, monkeypatch):
    def _forward_decode(self, q, kv_cache, swa_metadata, attn_metadata, output):
        pass
    monkeypatch.setattr(DeepseekV4FlashMLAAttention, "_forward_decode", _forward_decode)
    with pytest.raises(IntegrationError, match=r"vllm 0\.33\.0: .*_forward_decode"):
        model.routed_attention_cls()


def layer(cls, prefix="model.layers.0.attn"):
    """A c4a layer object of ``cls`` with what ``_forward_decode`` reads (no weights)."""
    obj = cls.__new__(cls)
    torch.nn.Module.__init__(obj)
    obj.prefix, obj.compress_ratio, obj.scale = prefix, 4, 512 ** -0.5
    return obj


def test_other_backends_are_refused(on_cuda):
    net = torch.nn.Module()
    for name, cls in (("a", DeepseekV4FlashMLAAttention),
                      ("b", DeepseekV4FlashInferSM120Attention)):
        net.add_module(name, layer(cls))
        getattr(net, name).topk_indices_buffer = torch.zeros(1, 1)
    with pytest.raises(ValueError, match="'b' is a DeepseekV4FlashInferSM120Attention.*FlashMLA"):
        model.route_sparse_layers(net)


@pytest.fixture
def reference_kernels(monkeypatch):
    """FlashMLA's V4 decode (the torch reference) in vLLM's module and ours; the calls."""
    calls = []

    def kernel(**kw):
        calls.append(kw)
        out = sparse_decode(kw["q"], kw["k_cache"], kw["indices"], kw["topk_length"],
                            kw["attn_sink"], kw["softmax_scale"], kw["extra_k_cache"],
                            kw["extra_indices_in_kvcache"], kw["extra_topk_length"])
        kw["out"].copy_(out)
        return out, None

    def global_topk(local, token_to_req, block_table, block_size, is_valid):
        return (L.global_indices(block_table, token_to_req, local, block_size),
                R.topk_lengths(local, is_valid))

    monkeypatch.setattr(upstream_mod, "flash_mla_with_kvcache", kernel)
    monkeypatch.setattr(cuda_attention, "flash_mla_with_kvcache", kernel)
    monkeypatch.setattr(upstream_mod, "compute_global_topk_indices_and_lens", global_topk)
    return calls


def same_arg(x, y) -> bool:
    if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)
                and x.shape == y.shape and torch.equal(x, y))
    return x is y or x == y


TILE_SCHED = object()  # vLLM's FlashMLASchedMeta of the step: passed on as it is


def decode(cls, sc, prefix="model.layers.0.attn", routed=None):
    """One ``_forward_decode`` of a ``cls`` layer on the scenario's step, bound to
    ``routed`` if given (as the worker's binding does).  # [T, H, 512]"""
    b, w = sc.bufs, sc.w
    obj = layer(cls, prefix)
    if routed is not None:
        obj.routed = routed
    obj.topk_indices_buffer = b["local"]
    obj.attn_sink = w.sink
    obj.swa_cache_layer = SimpleNamespace(kv_cache=sc.swa.squeeze(-2))  # [blocks, 64, 584]
    swa_meta = SimpleNamespace(
        num_decodes=sc.rows, num_decode_tokens=sc.t, token_to_req_indices=b["token_to_req"],
        query_start_loc=b["query_start_loc"], seq_lens=b["seq_lens"],
        is_valid_token=b["is_valid"], decode_swa_indices=sc.swa_idx,
        decode_swa_lens=sc.swa_len, tile_sched_c4a=TILE_SCHED)
    attn_meta = SimpleNamespace(block_size=256, block_table=b["block_table"])
    out = torch.zeros(sc.t, sc.q.shape[2], 512, dtype=sc.q.dtype)
    obj._forward_decode(sc.q.squeeze(1), sc.cache.squeeze(-2), swa_meta, attn_meta, False, out)
    return out


def test_routed_decode_is_upstreams_call_with_two_arguments_changed(reference_kernels):
    calls = reference_kernels
    sc = G.Scenario(G.SMALL, torch.device("cpu"))
    routed_cls = cuda_attention.RoutedDeepseekV4FlashMLAAttention
    steps = 0
    for want in sc.steps():
        before = sc.rd.counters.clone()
        up = decode(DeepseekV4FlashMLAAttention, sc)
        routed = decode(routed_cls, sc, routed=sc.rd)
        a, r = calls[-2], calls[-1]
        same = {key for key in a if same_arg(a[key], r[key])}
        # "out" is each layer's own buffer
        assert set(a) - same - {"out"} == {"extra_k_cache", "extra_indices_in_kvcache"}
        assert r["extra_k_cache"] is sc.rd.pool_view
        served = sc.served()
        assert served.any() and torch.equal(up[served], routed[served])
        counted = (sc.rd.counters - before).tolist()
        assert counted[G.D.COUNTER_FRESH] == want["fresh"]
        assert counted[G.D.COUNTER_UNROUTED] == want["unrouted"]
        # a layer not bound to a routing is upstream's, token for token
        assert torch.equal(decode(routed_cls, sc, "model.layers.1.attn"), up)
        steps += 1
    assert steps == G.SMALL["steps"]


def test_a_wrong_location_is_seen(reference_kernels, monkeypatch):
    """Negative control: locations one row off differ from upstream for served tokens."""
    sc = G.Scenario(G.SMALL, torch.device("cpu"))
    real = G.D.RoutedDecode.locations

    def off_by_one(self, *a):
        loc, lens = real(self, *a)
        return torch.where(loc >= 0, loc + 1, loc), lens
    monkeypatch.setattr(G.D.RoutedDecode, "locations", off_by_one)
    step = next(sc.steps())
    assert step["tokens"]
    up = decode(DeepseekV4FlashMLAAttention, sc)
    routed = decode(cuda_attention.RoutedDeepseekV4FlashMLAAttention, sc, routed=sc.rd)
    assert not torch.equal(up[sc.served()], routed[sc.served()])


def test_every_extension_point_applies_against_vllm_033(on_cuda):
    """The glue's start-up checks against 0.33's classes, with the CUDA worker as the
    worker's base: what a GPU engine of 0.33 would run them against."""
    from vllm_dhisparse.integration import extension_points as ep
    from vllm_dhisparse.integration import draft_ring, kv_spec
    from vllm_dhisparse.integration.engine_core import scheduler
    from vllm_dhisparse.integration.worker import worker
    for piece, step in ep.REGISTRATIONS.items():
        step()
    for module in (scheduler, kv_spec, draft_ring, cuda_attention):
        module.check()
    worker.check(worker.base_for(Cuda()))
    assert model.routed_attention_cls() is cuda_attention.RoutedDeepseekV4FlashMLAAttention
