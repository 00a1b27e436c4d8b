"""Eager DeepSeek-V4 model-level ops (vllm_dhisparse/eager_v4/model_ops.py)
against float64 references written here from the ops' documented math, plus
registration under torch.ops._C: vLLM's kernels where the loaded library has them
(x86: the AVX-512 + BF16 build), compared with ours; ours everywhere else."""

import math
import platform

import pytest

torch = pytest.importorskip("torch")

from vllm_dhisparse.eager_v4 import model_ops as mo  # noqa: E402

F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _close(actual, expected, atol, rtol=0.0):
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol, rtol=rtol)


# ------------------------------------------------------------------- GEMMs


def test_convert_weight_packed_is_plain_copy():
    w = torch.randn(2, 64, 96, generator=_gen(0)).to(torch.bfloat16)
    p = mo.convert_weight_packed(w)
    assert p.dtype == w.dtype and p.shape == w.shape and p.is_contiguous()
    assert torch.equal(p, w)
    assert p.data_ptr() != w.data_ptr()
    wt = w.transpose(1, 2)  # non-contiguous input -> contiguous copy
    assert mo.convert_weight_packed(wt).is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bmm_cpu_matches_float64(dtype):
    g = _gen(1)
    b, m, n, k = 2, 5, 64, 256
    mat1 = torch.randn(b, m, k, generator=g).to(dtype)
    w = torch.randn(b, n, k, generator=g).to(dtype)
    packed = mo.convert_weight_packed(w)
    out = torch.empty(b, m, n, dtype=dtype)
    mo.bmm_cpu(out, mat1, packed, True, None)
    ref = torch.einsum("bmk,bnk->bmn", mat1.to(F64), w.to(F64))
    # one rounding to 16 bits of a value of size ~sqrt(k)
    _close(out, ref, atol=0.15, rtol=1e-2)
    # is_vnni=False takes the raw weight: same result
    out2 = torch.empty_like(out)
    mo.bmm_cpu(out2, mat1, w, False, None)
    assert torch.equal(out, out2)


def test_bmm_cpu_writes_into_strided_out_and_fp8_scale():
    g = _gen(2)
    b, m, n, k = 2, 3, 32, 64
    mat1 = torch.randn(b, m, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(b, n, k, generator=g) * 10).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.05)
    base = torch.zeros(m, b, n, dtype=torch.bfloat16)
    out = base.transpose(0, 1)  # [b, m, n] non-contiguous view
    mo.bmm_cpu(out, mat1, w, True, scale)
    ref = torch.einsum("bmk,bnk->bmn", mat1.to(F64), w.to(F64) * 0.05)
    _close(base.transpose(0, 1), ref, atol=0.05, rtol=1e-2)


def test_weight_packed_linear():
    g = _gen(3)
    x = torch.randn(7, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(48, 128, generator=g).to(torch.bfloat16)
    bias = torch.randn(48, generator=g)
    out = torch.empty(7, 48, dtype=torch.bfloat16)
    mo.weight_packed_linear(out, x, mo.convert_weight_packed(w), bias, True)
    ref = x.to(F64) @ w.to(F64).T + bias.to(F64)
    _close(out, ref, atol=0.1, rtol=1e-2)


# ------------------------------------------------------------------- routing


def _ref_sqrtsoftplus(x):
    x = x.to(F64)
    return torch.sqrt(torch.log1p(torch.exp(x)))


def test_sqrtsoftplus_ranges():
    x = torch.tensor([-30.0, -16.0, -14.0, -1.0, 0.0, 3.0, 19.0, 21.0, 60.0])
    got = mo._sqrtsoftplus(x)
    _close(got, _ref_sqrtsoftplus(x), atol=0, rtol=2e-6)


@pytest.mark.parametrize("num_experts,topk", [(64, 6), (256, 8)])
def test_biased_topk_sqrtsoftplus(num_experts, topk):
    g = _gen(4)
    t = 9
    logits = torch.randn(t, num_experts, generator=g) * 3
    bias = torch.randn(num_experts, generator=g) * 0.5
    rsf = 1.5
    w, ids = mo.biased_topk_cpu(logits, logits, bias, topk, True, "sqrtsoftplus", 0, rsf, True)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    assert w.shape == (t, topk) and ids.shape == (t, topk)
    s = _ref_sqrtsoftplus(logits)
    biased = s + bias.to(F64)
    order = torch.argsort(biased, dim=-1, descending=True)[:, :topk]
    assert torch.equal(ids.long(), order)
    sel = s.gather(1, order)
    ref_w = sel / sel.sum(-1, keepdim=True) * rsf
    _close(w, ref_w, atol=1e-6, rtol=1e-5)
    _close(w.sum(-1), torch.full((t,), rsf, dtype=F64), atol=1e-5)


def test_biased_topk_sigmoid_no_renorm_and_none_factor():
    g = _gen(5)
    logits = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    bias = torch.zeros(64)
    w, ids = mo.biased_topk_cpu(logits, logits, bias, 6, False, "sigmoid", 0, None, True)
    s = torch.sigmoid(logits.to(F64))
    ref_w, ref_ids = torch.topk(s, 6, dim=-1)
    assert torch.equal(ids.long(), ref_ids)
    _close(w, ref_w, atol=1e-6)
    # renormalize with routed_scaling_factor None counts as 0 (upstream quirk)
    w0, _ = mo.biased_topk_cpu(logits, logits, bias, 6, True, "sigmoid", 0, None, True)
    assert torch.count_nonzero(w0) == 0
    with pytest.raises(RuntimeError):
        mo.biased_topk_cpu(logits, logits, bias, 6, True, "softmax", 0, 1.0, True)


def test_biased_topk_fused_shared_expert():
    g = _gen(6)
    logits = torch.randn(5, 64, generator=g)
    bias = torch.randn(64, generator=g) * 0.1
    rsf = 2.5
    w, ids = mo.biased_topk_cpu(logits, logits, bias, 7, True, "sigmoid", 1, rsf, True)
    assert bool((ids[:, -1] == 64).all())
    s = torch.sigmoid(logits.to(F64))
    order = torch.argsort(s + bias.to(F64), dim=-1, descending=True)[:, :6]
    assert torch.equal(ids[:, :6].long(), order)
    routed = s.gather(1, order)
    scale = rsf / routed.sum(-1, keepdim=True)
    _close(w[:, :6], routed * scale, atol=1e-6, rtol=1e-5)
    _close(w[:, 6:], routed.sum(-1, keepdim=True) / rsf * scale, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
def test_hash_topk(scoring):
    g = _gen(7)
    t, e, k = 6, 64, 6
    logits = torch.randn(t, e, generator=g) * 2
    vocab_table = torch.randint(0, e, (50, k), generator=g, dtype=torch.int32)
    input_ids = torch.randint(0, 50, (t,), generator=g)
    tid2eid = vocab_table[input_ids]
    rsf = 1.5
    w, ids = mo.hash_topk_cpu(logits, tid2eid, k, scoring, 0, e, rsf)
    assert torch.equal(ids, tid2eid)
    x = logits.to(F64)
    if scoring == "sqrtsoftplus":
        s = _ref_sqrtsoftplus(x)
    elif scoring == "sigmoid":
        s = torch.sigmoid(x)
    else:
        s = torch.softmax(x, dim=-1)
    sel = s.gather(1, tid2eid.long())
    if scoring != "softmax":  # renormalized and scaled; softmax left as is
        sel = sel / sel.sum(-1, keepdim=True) * rsf
    _close(w, sel, atol=1e-6, rtol=1e-5)


def test_hash_topk_fused_shared_and_checks():
    g = _gen(8)
    logits = torch.randn(3, 64, generator=g)
    tid2eid = torch.randint(0, 64, (3, 6), generator=g, dtype=torch.int32)
    w, ids = mo.hash_topk_cpu(logits, tid2eid, 7, "sigmoid", 1, 64, 2.0)
    assert torch.equal(ids[:, :6], tid2eid) and bool((ids[:, 6] == 64).all())
    _close(w[:, :6].sum(-1), torch.ones(3, dtype=F64), atol=1e-6)  # no rsf when fused
    _close(w[:, 6], torch.full((3,), 0.5, dtype=F64), atol=1e-6)
    with pytest.raises(RuntimeError):
        mo.hash_topk_cpu(logits, tid2eid.long(), 6, "sigmoid", 0, 64, 1.0)
    with pytest.raises(RuntimeError):
        mo.hash_topk_cpu(logits, tid2eid, 6, "sigmoid", 0, 128, 1.0)


# ------------------------------------------------------------------- mHC


def _ref_hc_pre(x, fn, scale, base, iters, rms_eps, eps):
    t, hc, d = x.shape
    xf = x.to(F64).reshape(t, hc * d)
    mix = xf @ fn.to(F64).T
    mix = mix / torch.sqrt((xf * xf).mean(-1, keepdim=True) + rms_eps)
    sc, b = scale.to(F64), base.to(F64)
    pre = 1 / (1 + torch.exp(-(mix[:, :hc] * sc[0] + b[:hc]))) + eps
    post = 2 / (1 + torch.exp(-(mix[:, hc : 2 * hc] * sc[1] + b[hc : 2 * hc])))
    c = mix[:, 2 * hc :].reshape(t, hc, hc) * sc[2] + b[2 * hc :].reshape(hc, hc)
    c = torch.exp(c - c.max(-1, keepdim=True).values)
    c = c / c.sum(-1, keepdim=True) + eps
    c = c / (c.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + eps)
        c = c / (c.sum(-2, keepdim=True) + eps)
    y = (pre.unsqueeze(-1) * x.to(F64)).sum(1)
    return y, post, c


def _hc_inputs(seed, t=5, hc=4, d=256):
    g = _gen(seed)
    mix_hc = (2 + hc) * hc
    x = torch.randn(t, hc, d, generator=g).to(torch.bfloat16)
    fn = torch.randn(mix_hc, hc * d, generator=g) * 0.02
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(mix_hc, generator=g) * 0.3
    return x, fn, scale, base


def test_hc_pre_fused_matches_float64():
    x, fn, scale, base = _hc_inputs(9)
    y, post, comb = mo.hc_pre_fused_cpu(x, fn, scale, base, 4, 20, 1e-6, 1e-6)
    assert y.dtype == torch.bfloat16 and y.shape == (5, 256)
    assert post.dtype == torch.float32 and post.shape == (5, 4)
    assert comb.dtype == torch.float32 and comb.shape == (5, 4, 4)
    ry, rpost, rcomb = _ref_hc_pre(x, fn, scale, base, 20, 1e-6, 1e-6)
    _close(post, rpost, atol=1e-5)
    _close(comb, rcomb, atol=1e-5)
    _close(y, ry, atol=3e-2, rtol=1e-2)  # bf16 output
    # after 20 Sinkhorn iterations comb is (nearly) doubly stochastic
    _close(comb.sum(-2), torch.ones(5, 4, dtype=F64), atol=1e-4)
    _close(comb.sum(-1), torch.ones(5, 4, dtype=F64), atol=1e-3)


def test_hc_pre_fused_one_iteration_and_vllm_reference():
    x, fn, scale, base = _hc_inputs(10, t=3)
    y, post, comb = mo.hc_pre_fused_cpu(x, fn, scale, base, 4, 1, 1e-6, 1e-3)
    ry, rpost, rcomb = _ref_hc_pre(x, fn, scale, base, 1, 1e-6, 1e-3)
    _close(comb, rcomb, atol=1e-5)
    _close(post, rpost, atol=1e-5)
    mhc_torch = pytest.importorskip("vllm.model_executor.kernels.mhc.torch")
    vpost, vcomb, vy = mhc_torch.mhc_pre_torch(x, fn, scale, base, 1e-6, 1e-3, 1e-3, 2.0, 1)
    _close(post, vpost.reshape(3, 4), atol=1e-5)
    _close(comb, vcomb, atol=1e-5)
    _close(y, vy, atol=2e-2)


def test_hc_post_fused_matches_float64():
    g = _gen(11)
    t, hc, d = 4, 4, 256
    x = torch.randn(t, d, generator=g).to(torch.bfloat16)
    res = torch.randn(t, hc, d, generator=g).to(torch.bfloat16)
    post = torch.rand(t, hc, generator=g) * 2
    comb = torch.rand(t, hc, hc, generator=g)
    out = mo.hc_post_fused_cpu(x, res, post, comb)
    assert out.dtype == torch.bfloat16 and out.shape == (t, hc, d)
    ref = post.to(F64).unsqueeze(-1) * x.to(F64).unsqueeze(1) + torch.einsum(
        "tij,tid->tjd", comb.to(F64), res.to(F64)
    )
    _close(out, ref, atol=3e-2, rtol=1e-2)


def test_hc_head_fused_matches_float64():
    g = _gen(12)
    t, hc, d = 6, 4, 256
    x = torch.randn(t, hc, d, generator=g).to(torch.bfloat16)
    fn = torch.randn(hc, hc * d, generator=g) * 0.02
    scale = torch.tensor([0.7])
    base = torch.randn(hc, generator=g) * 0.3
    hc_eps, norm_eps = 1e-6, 1e-6
    y = mo.hc_head_fused_cpu(x, fn, scale, base, hc_eps, norm_eps)
    assert y.dtype == torch.bfloat16 and y.shape == (t, d)
    xf = x.to(F64).reshape(t, -1)
    mix = (xf @ fn.to(F64).T) / torch.sqrt((xf * xf).mean(-1, keepdim=True) + norm_eps)
    gate = torch.sigmoid(mix * 0.7 + base.to(F64)) + hc_eps
    ref = (gate.unsqueeze(-1) * x.to(F64)).sum(1)
    _close(y, ref, atol=3e-2, rtol=1e-2)


def test_mhc_cpu_wrappers_round_trip():
    """vLLM's kernels/mhc/cpu.py wrappers reshape around our ops correctly."""
    cpu = pytest.importorskip("vllm.model_executor.kernels.mhc.cpu")
    mhc_torch = pytest.importorskip("vllm.model_executor.kernels.mhc.torch")
    _register_or_skip()
    x, fn, scale, base = _hc_inputs(13, t=4)
    post, comb, y = cpu.mhc_pre_cpu(x, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    tpost, tcomb, ty = mhc_torch.mhc_pre_torch(x, fn, scale, base, 1e-6, 1e-6, 1e-6, 2.0, 20)
    _close(post, tpost, atol=1e-5)
    _close(comb, tcomb, atol=1e-5)
    _close(y, ty, atol=2e-2)
    xo = torch.randn(4, 256, generator=_gen(14)).to(torch.bfloat16)
    out = cpu.mhc_post_cpu(xo, x, post, comb)
    _close(out, mhc_torch.mhc_post_torch(xo, x, post, comb), atol=3e-2)


# ------------------------------------------------------------------- registry


def _register_or_skip():
    from vllm_dhisparse import eager_v4

    try:
        import vllm_dhisparse.eager_v4.attention_ops  # noqa: F401
    except ImportError:
        pytest.skip("eager_v4.attention_ops not written yet")
    # Load the platform library first, as vLLM does, so only missing ops get ours.
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    return eager_v4.register_missing_ops()


def test_registered_under_torch_ops_C():
    ours = set(_register_or_skip())
    names = {schema.split("(", 1)[0] for schema, _ in mo.OPS}
    for name in names:
        assert callable(getattr(torch.ops._C, name)), name
    from_vllm = not (names & ours)
    assert from_vllm or names <= ours, sorted(names - ours)
    if platform.machine() in ("x86_64", "AMD64"):
        # platforms/cpu.py:639-642: only this build (_C) has the DeepSeek-V4 ops.
        assert from_vllm == (torch.cpu._is_avx512_supported()
                             and torch.cpu._is_avx512_bf16_supported())

    def same(actual, eager, atol):
        # through the dispatcher: vLLM's kernel is close to ours (bf16 results within one
        # bf16 step: its kernel sums in another order, with AMX where the CPU has it),
        # ours is ours
        rtol = 2**-7 if from_vllm and actual.dtype == torch.bfloat16 else 0.0
        _close(actual, eager, atol=atol if from_vllm else 0, rtol=rtol)

    g = _gen(15)
    w = torch.randn(2, 32, 64, generator=g).to(torch.bfloat16)
    packed = torch.ops._C.convert_weight_packed(w)
    mat1 = torch.randn(2, 3, 64, generator=g).to(torch.bfloat16)
    out = torch.empty(2, 3, 32, dtype=torch.bfloat16)
    torch.ops._C.bmm_cpu(out, mat1, packed, True, None)
    ref = torch.einsum("bmk,bnk->bmn", mat1.to(F64), w.to(F64))
    _close(out, ref, atol=0.1, rtol=1e-2)
    eager = torch.empty_like(out)
    mo.bmm_cpu(eager, mat1, mo.convert_weight_packed(w), True, None)
    same(out, eager, atol=0.05)
    logits = torch.randn(3, 64, generator=g)
    args = (logits, logits, torch.zeros(64), 6, True, "sqrtsoftplus", 0, 1.5, True)
    w8, ids = torch.ops._C.biased_topk_cpu(*args)
    assert ids.dtype == torch.int32 and math.isclose(float(w8[0].sum()), 1.5, rel_tol=1e-5)
    ew8, eids = mo.biased_topk_cpu(*args)
    assert torch.equal(ids, eids)
    same(w8, ew8, atol=1e-6)
    x, fn, scale, base = _hc_inputs(16, t=2)
    got = torch.ops._C.hc_pre_fused_cpu(x, fn, scale, base, 4, 3, 1e-6, 1e-6)
    y, post, comb = got
    assert y.shape == (2, 256) and post.shape == (2, 4) and comb.shape == (2, 4, 4)
    for a, b in zip(got, mo.hc_pre_fused_cpu(x, fn, scale, base, 4, 3, 1e-6, 1e-6)):
        same(a, b, atol=1e-5)


def test_schema_and_fake_kernels_opcheck():
    """Declared mutations match what the ops do, and FAKES give the real shapes
    (what torch.compile needs to trace the model through these ops)."""
    from vllm_dhisparse import eager_v4

    _register_or_skip()
    g = _gen(17)
    x, fn, scale, base = _hc_inputs(18, t=3)
    logits = torch.randn(3, 64, generator=g)
    bf = torch.bfloat16
    cases = {
        "convert_weight_packed": (torch.randn(2, 32, 64, generator=g).to(bf),),
        "bmm_cpu": (
            torch.empty(2, 3, 32, dtype=bf), torch.randn(2, 3, 64, generator=g).to(bf),
            torch.randn(2, 32, 64, generator=g).to(bf), True, None,
        ),
        "weight_packed_linear": (
            torch.empty(3, 32, dtype=bf), torch.randn(3, 64, generator=g).to(bf),
            torch.randn(32, 64, generator=g).to(bf), None, True,
        ),
        "hash_topk_cpu": (
            logits, torch.randint(0, 64, (3, 6), generator=g, dtype=torch.int32),
            6, "sqrtsoftplus", 0, 64, 1.5,
        ),
        "biased_topk_cpu": (logits, logits, torch.zeros(64), 6, True, "sqrtsoftplus", 0, 1.5, True),
        "hc_pre_fused_cpu": (x, fn, scale, base, 4, 20, 1e-6, 1e-6),
        "hc_post_fused_cpu": (x[:, 0].contiguous(), x, torch.rand(3, 4), torch.rand(3, 4, 4)),
        "hc_head_fused_cpu": (x, torch.randn(4, 1024, generator=g) * 0.02, torch.ones(1),
                              torch.zeros(4), 1e-6, 1e-6),
    }
    assert set(cases) == {s.split("(", 1)[0] for s, _ in mo.OPS} == set(mo.FAKES)
    for name, args in cases.items():
        if name not in eager_v4._registered:
            continue  # provided by vLLM's own library on this CPU
        op = getattr(torch.ops._C, name).default
        res = torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
        assert set(res.values()) == {"SUCCESS"}, (name, res)
