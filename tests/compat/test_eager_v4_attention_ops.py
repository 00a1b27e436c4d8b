"""Eager DeepSeek-V4 attention/indexer/compressor ops vs float64 references.

The ops live in ``vllm_dhisparse/eager_v4/{attention_ops,indexer_ops}.py``;
references here are written straight from each op's documented math.  Where the
loaded vLLM library has the ops (x86: the AVX-512 + BF16 build), the registry test
compares vLLM's kernels with ours; elsewhere it checks that ours serve them.
"""
import math
import platform

import pytest

torch = pytest.importorskip("torch")

from vllm_dhisparse.eager_v4 import _common as C  # noqa: E402
from vllm_dhisparse.eager_v4 import attention_ops as A  # noqa: E402
from vllm_dhisparse.eager_v4 import indexer_ops as I  # noqa: E402

MY_OPS = [
    "flash_mla_with_kvcache_cpu", "fused_qnorm_rope_kv_insert_cpu",
    "inverse_gptj_rope_o_proj_cpu", "save_partial_states_cpu",
    "compress_norm_rope_store_cpu", "fused_indexer_q_rope_quant_cpu",
    "fp8_paged_mqa_logits_cpu", "topk_transform_512_cpu",
    "compress_norm_rope_store_indexer_cpu",
]


def gen(seed):
    return torch.Generator().manual_seed(seed)


def cos_sin_cache(max_pos, rope_dim, seed=0):
    g = gen(seed)
    ang = torch.rand(max_pos, rope_dim // 2, generator=g, dtype=torch.float64) * 6.28
    return torch.cat([ang.cos(), ang.sin()], dim=1).float()


def ref_rope(x, pos, cs, inverse=False):
    """float64 GPT-J rotation of x [..., R] (pairs 2i, 2i+1) at positions pos."""
    x = x.double()
    half = x.shape[-1] // 2
    c = cs[pos].double()[..., :half]
    s = cs[pos].double()[..., half:2 * half]
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    e, o = x[..., 0::2], x[..., 1::2]
    if inverse:
        s = -s
    out = torch.empty_like(x)
    out[..., 0::2] = e * c - o * s
    out[..., 1::2] = e * s + o * c
    return out


def pooled_cache(num_blocks, block_size, row_bytes, pad=96):
    """A uint8 [num_blocks, row_bytes] view whose row stride exceeds row_bytes."""
    base = torch.zeros(num_blocks, row_bytes + pad, dtype=torch.uint8)
    return base, base[:, :row_bytes]


def fp8_tile_tol(ref_tiles):
    # fp8 e4m3: 3 mantissa bits -> rel. error <= 2^-4 of the (pow2-scaled) value,
    # plus subnormal floor; bound per tile by its amax.
    return ref_tiles.abs().amax(-1, keepdim=True) / 448 * 2 + ref_tiles.abs() / 15


# ----------------------------------------------------------------- registry
def vllm_provides_v4_ops():
    """Loads vLLM's platform library first, as ``apply_cpu_compat`` does (ours must
    not define an op it defines), then ours; whether that library has the ops."""
    pytest.importorskip("vllm._custom_ops")
    from vllm_dhisparse.eager_v4 import register_missing_ops

    ours = set(register_missing_ops())
    from_vllm = set(MY_OPS) - ours
    assert from_vllm in (set(), set(MY_OPS)), sorted(from_vllm)
    if platform.machine() in ("x86_64", "AMD64"):
        # platforms/cpu.py:639-642: only this build (_C) has the DeepSeek-V4 ops.
        assert bool(from_vllm) == (torch.cpu._is_avx512_supported()
                                   and torch.cpu._is_avx512_bf16_supported())
    return bool(from_vllm)


def test_registered_under_torch_ops_C():
    from_vllm = vllm_provides_v4_ops()
    for name in MY_OPS:
        assert hasattr(torch.ops._C, name), name
    names = {s.split("(", 1)[0] for s, _ in A.OPS}
    assert names == set(MY_OPS)
    # calls through the dispatcher: vLLM's kernel (close to ours) or ours (identical)
    g = gen(13)
    o = torch.randn(3, 2, 512, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 5, 9])
    cs = cos_sin_cache(16, 64)
    out = torch.ops._C.inverse_gptj_rope_o_proj_cpu(o, pos, cs, 64)
    eager = A.inverse_gptj_rope_o_proj_cpu(o, pos, cs, 64)
    assert out.dtype == torch.float32 and out.shape == o.shape
    t, h, wbs, cbs = 6, 4, 8, 2
    wc, cc = build_ds_mla_cache(4, wbs, 10), build_ds_mla_cache(6, cbs, 11)
    q = (torch.randn(t, h, 512, generator=g) * 0.2).to(torch.bfloat16)
    ws = torch.randint(0, 4 * wbs, (t, 5), generator=g)
    ws[0, 1:] = -1
    ws[3, 4] = ws[3, 0]
    csl = torch.randint(0, 6 * cbs, (t, 3), generator=g)
    csl[1] = -1
    sink = torch.randn(h, generator=g)
    attn = torch.empty(t, h, 512, dtype=torch.bfloat16)
    eager_attn = torch.empty_like(attn)
    torch.ops._C.flash_mla_with_kvcache_cpu(attn, q, wc, ws, wbs, cc, csl, cbs, sink, 0.04)
    A.flash_mla_with_kvcache_cpu(eager_attn, q, wc, ws, wbs, cc, csl, cbs, sink, 0.04)
    if from_vllm:
        torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(attn.float(), eager_attn.float(), atol=3e-2, rtol=1e-2)
    else:
        assert torch.equal(out, eager) and torch.equal(attn, eager_attn)


# ------------------------------------------------ SWA insert / ds_mla layout
def test_qnorm_rope_kv_insert_and_ds_mla_round_trip():
    g = gen(1)
    t, h, hp, bs, nb = 7, 3, 4, 4, 5
    q = torch.randn(t, h, 512, generator=g).to(torch.bfloat16)
    kv = (torch.randn(t + 2, 512, generator=g) * 3).to(torch.bfloat16)
    pos = torch.tensor([0, 3, 4, 7, 11, 12, 15])
    slots = torch.tensor([2, -1, 5, 19, 0, 8, -1])
    cs = cos_sin_cache(32, 64)
    base, cache = pooled_cache(nb, bs, bs * 584)
    base[:, bs * 584:] = 77  # bytes past the block must stay untouched
    out = A.fused_qnorm_rope_kv_insert_cpu(q, kv, pos, cache, slots, cs, hp, 1e-6, bs)

    # Q: weight-free RMSNorm then rope on the last 64 dims; padded heads zero.
    qd = q.double()
    qn = qd / torch.sqrt(qd.pow(2).mean(-1, keepdim=True) + 1e-6)
    qn[..., 448:] = ref_rope(qn[..., 448:], pos, cs)
    assert out.shape == (t, hp, 512) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out[:, :h].double(), qn, atol=2e-2, rtol=1e-2)
    assert (out[:, h:] == 0).all()

    # KV rows: read back through the layout and compare to rope'd kv.
    assert (base[:, bs * 584:] == 77).all()
    live = (slots >= 0).nonzero().squeeze(1)
    rows = C.load_ds_mla_rows(cache, slots[live], bs).double()
    ref = kv[live].double().clone()
    ref[:, 448:] = ref_rope(ref[:, 448:], pos[live], cs)
    # rope part: exactly the bf16 of the rotated value
    torch.testing.assert_close(rows[:, 448:], ref[:, 448:].to(torch.bfloat16).double(),
                               atol=1e-2, rtol=0)
    nope, rnope = rows[:, :448].view(-1, 7, 64), ref[:, :448].view(-1, 7, 64)
    assert ((nope - rnope).abs() <= fp8_tile_tol(rnope) + 1e-2).all()
    # scale bytes: 7 UE8M0 + zero pad; pow2 scale covers the tile amax
    blk, p = C.split_slots(slots[live], bs)
    sc = C.read_bytes(cache, blk, bs * 576 + p * 8, 8)
    assert (sc[:, 7] == 0).all()
    scale = torch.exp2(sc[:, :7].double() - 127)
    assert (rnope.abs().amax(-1) <= scale * 448 * (1 + 1 / 64)).all()
    # untouched slots stay zero
    written = set(slots[live].tolist())
    for s in range(nb * bs):
        if s not in written:
            b, pp = divmod(s, bs)
            assert (cache[b, pp * 576:(pp + 1) * 576] == 0).all()


def test_inverse_rope_undoes_forward():
    g = gen(2)
    o = torch.randn(5, 4, 512, generator=g).to(torch.bfloat16)
    pos = torch.tensor([0, 1, 2, 30, 31])
    cs = cos_sin_cache(32, 64)
    out = A.inverse_gptj_rope_o_proj_cpu(o, pos, cs, 64)
    ref = o.double().clone()
    ref[..., 448:] = ref_rope(ref[..., 448:], pos, cs, inverse=True)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    back = ref_rope(out[..., 448:], pos, cs)
    torch.testing.assert_close(back, o[..., 448:].double(), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------- attention
def build_ds_mla_cache(num_blocks, bs, seed):
    g = gen(seed)
    base, cache = pooled_cache(num_blocks, bs, bs * 584)
    n = num_blocks * bs
    vals = torch.randn(n, 512, generator=g) * torch.rand(n, 1, generator=g) * 4
    vals = C.bf16_round(vals)
    C.store_ds_mla_rows(cache, torch.arange(n), bs, vals[:, :448], vals[:, 448:])
    return cache


def ref_attention(q, wc, ws, wbs, cc, csl, cbs, sink, scale):
    t, h, _ = q.shape
    out = torch.zeros(t, h, 512, dtype=torch.float64)
    for i in range(t):
        rows = []
        for cache, slots, bs in ((wc, ws, wbs), (cc, csl, cbs)):
            total = cache.shape[0] * bs
            for s in slots[i].tolist():
                if 0 <= s < total:
                    rows.append(C.load_ds_mla_rows(cache, torch.tensor([s]), bs)[0].double())
        if not rows:
            continue
        k = torch.stack(rows)
        for hh in range(h):
            logits = (k @ q[i, hh].double()) * scale
            allz = torch.cat([logits, torch.tensor([float(sink[hh])], dtype=torch.float64)])
            p = torch.softmax(allz, 0)[:-1]
            out[i, hh] = p @ k
    return out


def test_flash_mla_matches_explicit_softmax_with_sink():
    g = gen(3)
    t, h = 6, 4
    wbs, cbs = 8, 2
    wc = build_ds_mla_cache(4, wbs, 10)
    cc = build_ds_mla_cache(6, cbs, 11)
    q = (torch.randn(t, h, 512, generator=g) * 0.2).to(torch.bfloat16)
    ws = torch.randint(0, 32, (t, 5), generator=g)
    ws[0, 1:] = -1
    ws[2, 3] = 999  # beyond the cache: ignored like -1
    ws[3, 4] = ws[3, 0]  # duplicates count twice
    csl = torch.randint(0, 12, (t, 3), generator=g)
    csl[1] = -1
    ws[5] = -1
    csl[5] = -1  # token 5 sees nothing -> zeros
    sink = torch.randn(h, generator=g)
    scale = 1 / math.sqrt(512)
    out = torch.full((t, h, 512), 7.0, dtype=torch.bfloat16)
    A.flash_mla_with_kvcache_cpu(out, q, wc, ws, wbs, cc, csl, cbs, sink, scale)
    ref = ref_attention(q, wc, ws, wbs, cc, csl, cbs, sink, scale)
    torch.testing.assert_close(out.double(), ref, atol=2e-2, rtol=2e-2)
    assert (out[5] == 0).all()

    # swa-only form: zero compressed columns (window cache reused as dummy)
    out2 = torch.empty_like(out)
    A.flash_mla_with_kvcache_cpu(out2, q, wc, ws, wbs, wc, ws[:, :0], 1, sink, scale)
    ref2 = ref_attention(q, wc, ws, wbs, wc, ws[:, :0], 1, sink, scale)
    torch.testing.assert_close(out2.double(), ref2, atol=2e-2, rtol=2e-2)


def swa_only(q, cache, slots, bs):
    """The attention over window rows only (no compressed columns), zero sinks."""
    o = torch.empty(q.shape, dtype=torch.bfloat16)
    A.flash_mla_with_kvcache_cpu(o, q, cache, slots, bs, cache, slots[:, :0], 1,
                                 torch.zeros(q.shape[1]), 0.05)
    return o


def test_flash_mla_depends_only_on_referenced_rows():
    g = gen(4)
    t, h, bs = 3, 2, 4
    wc = build_ds_mla_cache(4, bs, 20)
    q = torch.randn(t, h, 512, generator=g).to(torch.bfloat16)
    ws = torch.tensor([[0, 1, -1], [4, 5, 6], [1, 6, -1]])

    def run(cache):
        return swa_only(q, cache, ws, bs)

    o0 = run(wc)
    other = wc.clone()
    other[3] = 0  # block 3 (slots 12..15) is never referenced
    assert torch.equal(run(other), o0)
    touched = wc.clone()
    touched[1, 2 * 576:2 * 576 + 448] = 0x38  # slot 6's nope bytes
    o1 = run(touched)
    assert torch.equal(o1[0], o0[0]) and not torch.equal(o1[1], o0[1])
    assert not torch.equal(o1[2], o0[2])


def test_flash_mla_invalid_entries_read_no_row():
    """An entry out of range (-1, or past the cache) contributes nothing, whatever the
    chunk's other rows hold: with NaN bytes in the chunk's first listed row (another
    token's), a token that does not list it stays finite and equals a call without it."""
    g = gen(5)
    t, h, bs = 3, 2, 4
    wc = build_ds_mla_cache(4, bs, 21)
    wc[0, :448] = 0x7F  # slot 0's nope bytes: fp8 e4m3 NaN
    q = torch.randn(t, h, 512, generator=g).to(torch.bfloat16)
    ws = torch.tensor([[0, 2, -1], [5, -1, 99], [-1, -1, -1]])
    got = swa_only(q, wc, ws, bs)
    assert torch.isnan(got[0].float()).any() and torch.isfinite(got[1].float()).all()
    assert (got[2] == 0).all()  # no valid entry: zeros
    alone = swa_only(q, wc, torch.tensor([[3, 2, -1], [5, -1, 99], [-1, -1, -1]]), bs)
    assert torch.equal(got[1], alone[1])


# ---------------------------------------------------------------- compressor
def ref_pool(state, slots, ratio, hd):
    """float64 per-channel softmax pool (loops)."""
    bs, width = state.shape[1], state.shape[2] // 2
    out = torch.zeros(slots.shape[0], hd, dtype=torch.float64)
    for i in range(slots.shape[0]):
        kvs, scs = [], []
        for w, s in enumerate(slots[i].tolist()):
            if s < 0:
                continue
            row = state[s // bs, s % bs].double()
            off = hd if w >= ratio else 0
            kvs.append(row[off:off + hd])
            scs.append(row[width + off:width + off + hd])
        kv, sc = torch.stack(kvs), torch.stack(scs)
        out[i] = (torch.softmax(sc, 0) * kv).sum(0)
    return out


def run_compressor(hd, ratio, coff, seed):
    """save_partial_states for 2 requests' tokens, then gather windows like
    cpu_compressor.py and return everything needed for a reference."""
    g = gen(seed)
    bs, nb = 8, 6
    width = coff * hd
    pos = torch.cat([torch.arange(0, 13), torch.arange(0, 9)])
    req = torch.cat([torch.zeros(13, dtype=torch.long), torch.ones(9, dtype=torch.long)])
    table = torch.tensor([[3, 0, 5], [1, 4, 2]])
    slot = table[req, pos // bs] * bs + pos % bs
    slot[4] = -1  # a padded token: writes nothing
    t = pos.shape[0]
    fused = torch.randn(t, 2 * width + 8, generator=g)
    kv, score = fused[:, :width], fused[:, width:2 * width]  # strided views
    ape = torch.randn(ratio, width, generator=g)
    base = torch.zeros(nb, bs, 2 * width + 16)
    state = base[:, :, :2 * width]
    assert not state.is_contiguous()
    A.save_partial_states_cpu(kv, score, ape, pos, state, slot)
    for i in range(t):
        if slot[i] < 0:
            continue
        row = state[slot[i] // bs, slot[i] % bs]
        torch.testing.assert_close(row[:width], kv[i])
        torch.testing.assert_close(row[width:], score[i] + ape[pos[i] % ratio])
    window = (1 + (coff - 1)) * ratio
    wl = pos.unsqueeze(-1) - window + 1 + torch.arange(window)
    safe = wl.clamp(min=0)
    gather = torch.where(wl >= 0, table[req.unsqueeze(-1).expand_as(wl), safe // bs] * bs
                         + safe % bs, torch.full_like(wl, -1))
    return state, gather, pos, g


def test_save_partial_states_and_compress_store_512():
    ratio = 4
    state, gather, pos, g = run_compressor(512, ratio, 2, 5)
    kv_slots = torch.full_like(pos, -1)
    done = ((pos + 1) % ratio == 0).nonzero().squeeze(1)
    kv_slots[done] = torch.arange(done.numel()) * 3 + 1
    kv_slots[done[-1]] = -1  # completes a window but no slot: skipped
    weight = 1 + 0.1 * torch.randn(512, generator=g)
    cs = cos_sin_cache(64, 64)
    bs = 4
    base, cache = pooled_cache(5, bs, bs * 584)
    A.compress_norm_rope_store_cpu(state, gather, pos, kv_slots, weight, 1e-6, cs, cache, bs,
                                   ratio)
    live = done[kv_slots[done] >= 0]
    pooled = ref_pool(state, gather[live], ratio, 512)
    ref = pooled / torch.sqrt(pooled.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    ref[:, 448:] = ref_rope(ref[:, 448:], (pos[live] // ratio) * ratio, cs)
    rows = C.load_ds_mla_rows(cache, kv_slots[live], bs).double()
    torch.testing.assert_close(rows[:, 448:], ref[:, 448:], atol=2e-2, rtol=1e-2)
    n, rn = rows[:, :448].view(-1, 7, 64), ref[:, :448].view(-1, 7, 64)
    assert ((n - rn).abs() <= fp8_tile_tol(rn) + 2e-2).all()
    # exactly the live rows were written
    written = (base[:, :bs * 576].view(5, bs, 576) != 0).any(-1).flatten()
    expect = torch.zeros(5 * bs, dtype=torch.bool)
    expect[kv_slots[live]] = True
    assert torch.equal(written, expect)


def test_compress_store_indexer_128_no_overlap():
    ratio = 4
    state, gather, pos, g = run_compressor(128, ratio, 1, 6)
    kv_slots = torch.where((pos + 1) % ratio == 0, torch.arange(pos.numel()), -1)
    weight = 1 + 0.1 * torch.randn(128, generator=g)
    cs = cos_sin_cache(64, 64, seed=3)
    bs = 16
    _, cache = pooled_cache(3, bs, bs * 132)
    I.compress_norm_rope_store_indexer_cpu(state, gather, pos, kv_slots, weight, 1e-6, cs,
                                           cache, bs, ratio)
    live = (kv_slots >= 0).nonzero().squeeze(1)
    pooled = ref_pool(state, gather[live], ratio, 128)
    ref = pooled / torch.sqrt(pooled.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()
    ref[:, 64:] = ref_rope(ref[:, 64:], (pos[live] // ratio) * ratio, cs)
    blk, p = C.split_slots(kv_slots[live], bs)
    q = C.read_bytes(cache, blk, p * 128, 128).view(torch.float8_e4m3fn).double()
    s = C.read_bytes(cache, blk, bs * 128 + p * 4, 4).view(torch.float32).double()
    assert (torch.log2(s) == torch.round(torch.log2(s))).all()  # power of two
    deq = q * s
    tol = ref.abs().amax(-1, keepdim=True) / 448 * 2 + ref.abs() / 15 + 1e-2
    assert ((deq - ref).abs() <= tol).all()


# ------------------------------------------------------------------- indexer
def test_fused_indexer_q_rope_quant():
    g = gen(7)
    t, h = 5, 4
    q = torch.randn(t, h, 128, generator=g) * torch.rand(t, h, 1, generator=g) * 10
    w = torch.randn(t, h, generator=g)
    pos = torch.tensor([0, 1, 7, 8, 20])
    cs = cos_sin_cache(32, 64, seed=4)
    q8 = torch.empty(t, h, 128, dtype=torch.float8_e4m3fn)
    wout = torch.empty(t, h)
    I.fused_indexer_q_rope_quant_cpu(pos, q, cs, q8, w, 0.125, 0.5, wout)
    ref = q.double().clone()
    ref[..., 64:] = ref_rope(ref[..., 64:], pos, cs)
    s = wout.double() / (w.double() * 0.125 * 0.5)
    assert (torch.log2(s) - torch.round(torch.log2(s))).abs().max() < 1e-6
    amax = ref.abs().amax(-1)
    assert (s * 448 >= amax * (1 - 1e-2)).all() and (s * 448 < amax * 2.01).all()
    deq = q8.double() * s.unsqueeze(-1)
    tol = amax.unsqueeze(-1) / 448 * 2 + ref.abs() / 15 + 1e-2
    assert ((deq - ref).abs() <= tol).all()


def build_indexer_cache(num_pages, bs, seed):
    g = gen(seed)
    _, cache = pooled_cache(num_pages, bs, bs * 132)
    k = torch.randn(num_pages * bs, 128, generator=g)
    qb, s = C.quant_row_pow2(k)
    rows = torch.arange(num_pages * bs)
    blk, p = C.split_slots(rows, bs)
    C.write_bytes(cache, blk, p * 128, qb)
    C.write_bytes(cache, blk, bs * 128 + p * 4, s.contiguous().view(torch.uint8).view(-1, 4))
    return cache


def test_fp8_paged_mqa_logits():
    g = gen(8)
    bs, pages = 4, 6
    cache = build_indexer_cache(pages, bs, 30)
    b, h = 3, 4
    q8 = (torch.randn(b, h, 128, generator=g) * 20).to(torch.float8_e4m3fn)
    w = torch.randn(b, h, generator=g)
    seq = torch.tensor([5, 0, 11], dtype=torch.int32)
    table = torch.tensor([[2, 5, 0], [1, 1, 1], [4, 0, 3]], dtype=torch.int32)
    out = I.fp8_paged_mqa_logits_cpu(q8, cache, w, seq, table, bs, 12)
    assert out.shape == (3, 12)
    for i in range(b):
        for j in range(12):
            if j >= seq[i]:
                assert out[i, j] == float("-inf")
                continue
            page, off = int(table[i, j // bs]), j % bs
            k = cache[page, off * 128:(off + 1) * 128].view(torch.float8_e4m3fn).double()
            ks = cache[page, bs * 128 + off * 4:bs * 128 + off * 4 + 4].view(torch.float32)
            dots = (q8[i].double() @ k).clamp(min=0)
            ref = float((dots * w[i].double()).sum() * ks.double())
            assert abs(float(out[i, j]) - ref) <= 1e-4 * (1 + abs(ref)), (i, j)


def test_topk_transform_512():
    g = gen(9)
    width, ps = 1300, 64
    seq = torch.tensor([0, 7, 512, 513, 1300, 2000])
    b = seq.numel()
    scores = torch.randn(b, width, generator=g)
    scores[4, 100:140] = 5.0
    scores[3] = 1.0  # all tied: the 512 lowest indices must win
    table = torch.randperm(200, generator=g)[: b * 21].view(b, 21).int()
    page = torch.full((b, 520), 42, dtype=torch.int32)
    raw = torch.full((b, 520), 42, dtype=torch.int32)
    I.topk_transform_512_cpu(scores, seq, table, page, ps, raw)
    assert (page[:, 512:] == 42).all() and (raw[:, 512:] == 42).all()
    for i in range(b):
        n = min(int(seq[i]), width)
        r = raw[i, :512]
        if n <= 512:
            assert r[:n].tolist() == list(range(n)) and (r[n:] == -1).all()
        else:
            ref = torch.topk(scores[i, :n].double(), 512).values
            got = scores[i, r.long()].double()
            assert (r >= 0).all() and (r < n).all() and r.unique().numel() == 512
            torch.testing.assert_close(got.sort().values, ref.sort().values)
        live = r >= 0
        rl = r[live].long()
        exp = table[i, rl // ps].long() * ps + rl % ps
        assert torch.equal(page[i, :512][live].long(), exp)
        assert (page[i, :512][~live] == -1).all()
    assert set(range(100, 140)) <= set(raw[4, :512].tolist())
    assert sorted(raw[3, :512].tolist()) == list(range(512))
    # without out_raw_indices
    page2 = torch.empty(b, 512, dtype=torch.int32)
    I.topk_transform_512_cpu(scores, seq, table, page2, ps, None)
    assert torch.equal(page2, page[:, :512])


def test_flash_mla_bit_identical_after_moving_rows():
    """Rows copied to other physical slots (lists remapped) give identical output."""
    g = gen(12)
    t, h, bs, nb = 5, 4, 8, 4
    src = build_ds_mla_cache(nb, bs, 40)
    q = torch.randn(t, h, 512, generator=g).to(torch.bfloat16)
    ws = torch.randint(0, nb * bs, (t, 6), generator=g)
    ws[1, 2:] = -1
    cs = torch.randint(0, nb * bs, (t, 3), generator=g)
    perm = torch.randperm(nb * bs, generator=g)  # slot s -> perm[s]
    _, dst = pooled_cache(nb, bs, bs * 584)
    for s in range(nb * bs):
        sb, sp = divmod(s, bs)
        db, dp = divmod(int(perm[s]), bs)
        dst[db, dp * 576:(dp + 1) * 576] = src[sb, sp * 576:(sp + 1) * 576]
        dst[db, bs * 576 + dp * 8:bs * 576 + dp * 8 + 8] = src[sb, bs * 576 + sp * 8:
                                                                bs * 576 + sp * 8 + 8]
    remap = lambda x: torch.where(x >= 0, perm[x.clamp(min=0)], x)  # noqa: E731
    sink = torch.randn(h, generator=g)
    o1 = torch.empty(t, h, 512, dtype=torch.bfloat16)
    o2 = torch.empty_like(o1)
    A.flash_mla_with_kvcache_cpu(o1, q, src, ws, bs, src, cs, bs, sink, 0.04)
    A.flash_mla_with_kvcache_cpu(o2, q, dst, remap(ws), bs, dst, remap(cs), bs, sink, 0.04)
    assert torch.equal(o1, o2)


def test_flash_mla_token_result_independent_of_its_batch():
    """A token's output is the same alone or in a call with other tokens (across the op's
    chunks of tokens), as with the per-query kernel: arms that batch requests differently
    (speculation, preemption, P/D) compare bit for bit."""
    g = gen(13)
    t, h, bs, nb = 2 * A._ATTN_CHUNK_TOKENS + 3, 8, 16, 20
    cache = build_ds_mla_cache(nb, bs, nb * bs)
    q = torch.randn(t, h, 512, generator=g).to(torch.bfloat16)
    ws = torch.randint(0, nb * bs, (t, 40), generator=g)
    cs = torch.randint(0, nb * bs, (t, 64), generator=g)
    sink = torch.randn(h, generator=g)
    together = torch.empty(t, h, 512, dtype=torch.bfloat16)
    A.flash_mla_with_kvcache_cpu(together, q, cache, ws, bs, cache, cs, bs, sink, 0.04)
    for i in range(t):
        alone = torch.empty(1, h, 512, dtype=torch.bfloat16)
        A.flash_mla_with_kvcache_cpu(alone, q[i:i + 1], cache, ws[i:i + 1], bs, cache,
                                     cs[i:i + 1], bs, sink, 0.04)
        assert torch.equal(alone[0], together[i]), i


def test_fp8_paged_mqa_logits_row_independent_of_its_chunk(monkeypatch):
    """A query row's logits are the same alone or among others split over several of the
    op's chunks (its chunk size is a memory bound, not part of the result)."""
    g = gen(14)
    bs, pages, b, h = 8, 12, 11, 32
    cache = build_indexer_cache(pages, bs, pages * bs)
    q8 = (torch.randn(b, h, 128, generator=g) * 20).to(torch.float8_e4m3fn)
    w = torch.randn(b, h, generator=g)
    seq = torch.randint(1, pages * bs, (b,), generator=g, dtype=torch.int32)
    table = torch.stack([torch.randperm(pages, generator=g) for _ in range(2)])[
        torch.arange(b) % 2].to(torch.int32)
    monkeypatch.setattr(I, "_LOGITS_CHUNK_ELEMS", 3 * pages * bs * h)  # 3 rows a chunk
    together = I.fp8_paged_mqa_logits_cpu(q8, cache, w, seq, table, bs, pages * bs)
    for i in range(b):
        alone = I.fp8_paged_mqa_logits_cpu(q8[i:i + 1], cache, w[i:i + 1], seq[i:i + 1],
                                           table[i:i + 1], bs, pages * bs)
        assert torch.equal(alone[0], together[i]), i
