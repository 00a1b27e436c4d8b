"""vLLM 0.33's own kernels over DeepSeek-V4 history pages inside wider blocks (CUDA).

With ``history_block_tokens`` (e.g. 1,024 tokens) the indexer's K cache and the c128a
compressed cache lie in wide history blocks: vLLM views each layer tensor as 256-token kernel
pages PAGE bytes apart (1,168 B c128a, 8,448 B indexer) and numbers the j-th kernel page of
block b as b * (STRIDE // PAGE) + j (v1/worker/utils.py map_kv_cache_to_kernel_blocks).  The
engine audit covers only the routed c4a decode; here the same logical pages, in the same
logical order, are put once in vLLM's default layout (one kernel page per block, 93,888 B
apart) and once in the wide one (STRIDE 616,704 = lcm(1168, 8448)), and each of vLLM's
reads of these caches must give the same bits in both: the c128a FlashMLA decode, the
indexer's DeepGEMM decode logits and its prefill gather.  Writes are compared too, page for
page, and must leave every byte outside their target pages (other layers' parts of a wide
block, free blocks) as it was: the writers DeepSeek-V4 runs on CUDA, i.e. its compressor's
fused Triton compress+store of the indexer keys and the CuTe-DSL norm+RoPE+store of the c128a
rows (fed the pre-norm rows that its compress half, which writes no cache, would hand it),
and vLLM's generic indexer write.  Needs a CUDA GPU and vLLM 0.33; skipped elsewhere.
"""
import itertools
from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] not in (9, 10),
    reason="needs a CUDA GPU of compute capability 9.x or 10.x")]

KERNEL_TOKENS = 256             # DeepSeek-V4's kernel block
DEFAULT_STRIDE = 93_888         # a pool's block stride in vLLM's default layout
WIDE_STRIDE = 616_704           # lcm(1168, 8448): the wide layout's block stride
WIDE_PAGES = 1024 // KERNEL_TOKENS  # kernel pages of one 1,024-token history block
LENS = (8000, 3000, 1500, 5123)     # tokens of the four requests
MAX_MODEL_LEN = 16_384
WIDTH = MAX_MODEL_LEN // KERNEL_TOKENS  # block-table columns, as vLLM sizes them
NPAGES = [-(-n // KERNEL_TOKENS) for n in LENS]
C128A, INDEXER = (2, 584), (64, 132)  # rows x bytes of a kernel page


def _need_vllm_033():
    pytest.importorskip("vllm")
    import vllm
    if not vllm.__version__.startswith("0.33"):
        pytest.skip(f"needs vLLM 0.33, found {vllm.__version__}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def _fp8_bytes(shape, g):
    """Random e4m3 bytes of magnitude <= 1.875: never NaN, and no row dominates a softmax."""
    b = torch.randint(0, 0x40, shape, generator=g, dtype=torch.uint8)
    return b | (torch.randint(0, 2, shape, generator=g, dtype=torch.uint8) << 7)


def _fmla_pages(n: int, rows: int, g) -> torch.Tensor:
    """[n, rows * 584] uint8 fp8_ds_mla pages in FlashMLA's V4 layout: the page's rows of
    448 fp8 + 64 bf16 first, then their 8 UE8M0 scale bytes each."""
    rope = (torch.randn(n, rows, 64, generator=g) * 0.5).to(torch.bfloat16)
    data = torch.cat([_fp8_bytes((n, rows, 448), g), rope.view(torch.uint8)], dim=-1)
    scales = torch.randint(120, 125, (n, rows, 8), generator=g, dtype=torch.uint8)
    return torch.cat([data.reshape(n, -1), scales.reshape(n, -1)], dim=1)


def _indexer_pages(n: int, g, mx: bool) -> torch.Tensor:
    """[n, 64 * 132] uint8 indexer pages as vLLM's writers leave them: 64 rows of 128 fp8,
    then the 64 rows' 4-byte scales (a power-of-two fp32, or on SM100 the same exponent as
    four UE8M0 bytes: deep_gemm.py mqa_logits_use_mx_scales)."""
    exp = torch.randint(-5, 6, (n, 64), generator=g)
    if mx:
        scales = (exp + 127).to(torch.uint8).unsqueeze(-1).expand(n, 64, 4)
    else:
        scales = torch.exp2(exp.float()).view(torch.uint8)
    return torch.cat([_fp8_bytes((n, 64 * 128), g), scales.reshape(n, -1)], dim=1)


def _place(pages, rows, row_bytes, wide, g, device="cuda"):
    """Puts the logical kernel pages (request after request, NPAGES each) into one layer
    tensor of the default or the wide layout, at random blocks.  Returns the kernel view vLLM
    binds to the layer and the block table of kernel block ids.
    # view [num_kernel_blocks, rows, row_bytes] uint8, table [len(LENS), WIDTH] int32"""
    page = rows * row_bytes
    stride, per = (WIDE_STRIDE, WIDE_PAGES) if wide else (DEFAULT_STRIDE, 1)
    step = stride // page if wide else 1  # kernel ids per vLLM block
    counts = [-(-n // per) for n in NPAGES]
    num_blocks = sum(counts) + 5
    # block 0 stays the null block that pads block tables, as in vLLM
    free = (torch.randperm(num_blocks - 1, generator=g)[:sum(counts)] + 1).tolist()
    table = torch.zeros(len(LENS), WIDTH, dtype=torch.int32)
    for r, n in enumerate(NPAGES):
        mine, free = free[:counts[r]], free[counts[r]:]
        for j in range(n):
            table[r, j] = mine[j // per] * step + j % per
    # bytes of other layers and free blocks hold finite junk: a misplaced read shows
    buf = torch.randint(0, 64, (num_blocks * stride,), generator=g, dtype=torch.uint8)
    # the kernel view of v1/worker/utils.py:422-430 (map_kv_cache_to_kernel_blocks)
    num_ids, kstride = ((num_blocks - 1) * step + per, page) if wide else (num_blocks, stride)
    view = buf.to(device).as_strided((num_ids, rows, row_bytes), (kstride, row_bytes, 1))
    view[_ids(table).to(device)] = pages.to(device).view(-1, rows, row_bytes)
    return view, table.to(device)


def _ids(table: torch.Tensor) -> torch.Tensor:
    """Kernel block ids of the logical pages, request after request."""
    return torch.cat([table[r, :n] for r, n in enumerate(NPAGES)])


def _backing(view: torch.Tensor) -> torch.Tensor:
    """The whole buffer under a kernel view, other layers' bytes and free blocks included.
    # [num_blocks * stride] uint8"""
    return view.as_strided((view.untyped_storage().nbytes(),), (1,), 0)


def _assert_only_pages_written(before: torch.Tensor, view: torch.Tensor, ids: torch.Tensor):
    """Every byte outside the kernel pages ``ids`` is as in ``before``: a write that lands in
    another layer's part of a wide block, or in a free block, fails here."""
    after = _backing(view)
    page = view.shape[1] * view.shape[2]
    target = ids.long().view(-1, 1) * view.stride(0) + torch.arange(page, device=view.device)
    outside = torch.ones_like(after, dtype=torch.bool)
    outside[target.view(-1)] = False
    changed = int(((after != before) & outside).sum())
    assert changed == 0, f"{changed} bytes changed outside the target pages"


def _rows_written(pages: torch.Tensor, token_bytes: int) -> int:
    """Rows of zeroed pages that a store gave a scale: the scales follow the page's rows
    (token_bytes each), and no quantised row has an all-zero scale."""
    p, rows = pages.shape[0], pages.shape[1]
    scales = pages.reshape(p, -1)[:, rows * token_bytes:].reshape(p, rows, -1)
    return int(scales.any(-1).sum())


def _prefill():
    """Every token of the four requests as one prefill: (request index int32, position int64)
    per token, as vLLM's token_to_req_indices and positions give them.  # [T], [T]"""
    req = torch.repeat_interleave(torch.arange(len(LENS), dtype=torch.int32),
                                  torch.tensor(LENS))
    return req, torch.cat([torch.arange(n) for n in LENS])


def _compressed_slots(table: torch.Tensor, rows: int, ratio: int) -> torch.Tensor:
    """The compressed-row slots vLLM's metadata builders give that prefill (-1 on tokens
    that end no compressed row), checked to be kernel block id * rows + row.  # [T] int64"""
    from vllm.v1.attention.backends.mla.compressor_utils import get_compressed_slot_mapping

    tokens = sum(LENS)
    lens = torch.tensor(LENS, dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, *itertools.accumulate(LENS)], dtype=torch.int32, device="cuda")
    # v1/attention/backends/mla/indexer.py:1442-1453 (rows 64, ratio 4) and
    # models/deepseek_v4/sparse_mla.py:194-205 (rows 2, ratio 128); no token is a replay
    slots = get_compressed_slot_mapping(
        tokens, torch.arange(tokens, device="cuda"), qsl, lens, table, rows, ratio)
    ids = _ids(table).long()
    per_page = (ids.view(-1, 1) * rows + torch.arange(rows, device="cuda")).split(NPAGES)
    want = torch.cat([p.reshape(-1)[:n // ratio] for p, n in zip(per_page, LENS)])
    assert torch.equal(slots[slots >= 0], want)
    return slots


def _stored_in_both_layouts(page, ratio, g, store) -> list[torch.Tensor]:
    """``store(cache, slots)`` run on zeroed pages in the default and then the wide layout;
    each run may change only its target pages.  Returns each layout's logical pages.
    # 2 x [P, rows, row_bytes] uint8"""
    blank = torch.zeros(sum(NPAGES), page[0] * page[1], dtype=torch.uint8)
    got = []
    for wide in (False, True):
        cache, table = _place(blank, *page, wide, g)  # [N, rows, row_bytes] uint8
        slots = _compressed_slots(table, page[0], ratio)
        before = _backing(cache).clone()
        store(cache, slots)
        torch.cuda.synchronize()
        _assert_only_pages_written(before, cache, _ids(table))
        got.append(cache[_ids(table).long()])
    return got


def _cos_sin() -> torch.Tensor:
    """fp32 [MAX_MODEL_LEN, 64]: 32 cos then 32 sin per position, the layout of
    DeepseekV4ScalingRotaryEmbedding.cos_sin_cache (deepseek_scaling_rope.py:244-255); the
    angles need not be the checkpoint's for a layout comparison."""
    ang = torch.arange(MAX_MODEL_LEN).float()[:, None] * 1e4 ** (-torch.arange(32) / 32)
    return torch.cat([ang.cos(), ang.sin()], dim=1).cuda()


def test_c128a_decode_reads_wide_pages_as_default_ones():
    _need_vllm_033()
    from vllm.models.deepseek_v4.sparse_mla import build_c128a_topk_metadata
    from vllm.v1.attention.ops.flashmla import (
        flash_mla_with_kvcache, get_mla_metadata, is_flashmla_sparse_supported)

    ok, why = is_flashmla_sparse_supported()
    if not ok:
        pytest.skip(why)
    g = torch.Generator().manual_seed(1)
    B, H, width = len(LENS), 64, 128  # h_q padded to 64 (flashmla.py:78); width: see below
    pages = _fmla_pages(sum(NPAGES), C128A[0], g)
    swa = _fmla_pages(8, 64, g).view(8, 64, 584).cuda()  # [8, 64, 584] uint8: the window
    swa_idx = torch.stack([torch.randperm(8 * 64, generator=g)[:128] for _ in LENS])
    swa_idx = swa_idx.to(torch.int32).view(B, 1, 128).cuda()
    swa_len = torch.full((B,), 128, dtype=torch.int32, device="cuda")
    q = (torch.randn(B, 1, H, 512, generator=g) * 0.5).to(torch.bfloat16).cuda()
    sink = torch.randn(H, generator=g).cuda()
    positions = torch.tensor(LENS, dtype=torch.int64, device="cuda") - 1
    arange = torch.arange(B, dtype=torch.int32, device="cuda")
    slots = torch.zeros(B, dtype=torch.int64, device="cuda")  # >= 0: every token valid

    def decode(cache, idx, lens):
        meta, _ = get_mla_metadata()  # planned on first use, for these lengths
        # models/deepseek_v4/nvidia/flashmla.py:248-264 (_forward_decode, compress_ratio 128)
        return flash_mla_with_kvcache(
            q=q, k_cache=swa.unsqueeze(-2), block_table=None, head_dim_v=512,
            tile_scheduler_metadata=meta, cache_seqlens=None, is_fp8_kvcache=True,
            indices=swa_idx, topk_length=swa_len, softmax_scale=512 ** -0.5,
            attn_sink=sink, extra_k_cache=cache.unsqueeze(-2),
            extra_indices_in_kvcache=idx, extra_topk_length=lens)

    runs = []
    for wide in (False, True):
        cache, table = _place(pages, *C128A, wide, g)  # [N, 2, 584] uint8
        # models/deepseek_v4/sparse_mla.py:253-275 (_build_c128a_metadata): the width is
        # min(max(next_pow2(8000 // 128), 128), 128) there; 256 // 128 rows per kernel page
        glob = torch.empty(B, width, dtype=torch.int32, device="cuda")
        lens = torch.empty(B, dtype=torch.int32, device="cuda")
        pre = torch.empty(B, width, dtype=torch.int32, device="cuda")
        idx, lens, _ = build_c128a_topk_metadata(
            positions, 128, B, arange, table, KERNEL_TOKENS // 128, slots, glob, lens, pre,
            max_compressed_tokens=width)
        idx = idx.view(B, 1, -1)  # [B, 1, 128] int32 global rows, -1 past lens
        runs.append((cache, idx, lens, *decode(cache, idx, lens)))
    (_, idx0, lens0, out0, lse0), (cache1, idx1, lens1, out1, lse1) = runs
    assert lens0.tolist() == lens1.tolist() == [n // 128 for n in LENS]
    assert not torch.equal(idx0, idx1)  # the two arms read different physical rows
    # control: reading other requests' rows changes the output, so the equality below
    # rests on the c128a rows and not only on the window
    out_c, _ = decode(cache1, idx1.roll(1, 0), lens1.roll(1, 0))
    torch.cuda.synchronize()
    assert out0.abs().sum() > 0 and not torch.equal(_bits(out_c), _bits(out1))
    assert torch.equal(_bits(out0), _bits(out1))
    assert torch.equal(_bits(lse0), _bits(lse1))


def test_indexer_decode_logits_read_wide_pages_as_default_ones():
    _need_vllm_033()
    from vllm.model_executor.layers.sparse_attn_indexer import kv_cache_as_quant_view
    from vllm.utils.deep_gemm import (
        fp8_fp4_paged_mqa_logits, get_paged_mqa_logits_metadata, mqa_logits_mx_inputs,
        mqa_logits_use_mx_scales)
    from vllm.utils.import_utils import has_deep_gemm
    from vllm.utils.platform_utils import num_compute_units
    from vllm.v1.attention.backends.mla.indexer import _supports_varlen_paged_mqa_logits

    if not has_deep_gemm():
        pytest.skip("DeepGEMM is not installed: vLLM has no CUDA paged MQA logits")
    g = torch.Generator().manual_seed(2)
    B, H = len(LENS), 64
    pages = _indexer_pages(sum(NPAGES), g, mqa_logits_use_mx_scales())
    q = torch.randn(B, 1, H, 128, generator=g).to(torch.float8_e4m3fn).cuda()
    weights = torch.randn(B, H, generator=g).cuda()  # [B * next_n, H] float32
    # v1/attention/backends/mla/indexer.py:1727-1744: compressed lengths, 2-D [B, 1]
    ctx = torch.tensor([n // 4 for n in LENS], dtype=torch.int32, device="cuda").view(B, 1)
    # indexer.py:1656-1690: SM100 runs the varlen form, one request index per row
    indices = (torch.arange(B, dtype=torch.int32, device="cuda")
               if _supports_varlen_paged_mqa_logits() else None)
    # sparse_attn_indexer.py:877-879: SM100 wants unit MX q scales and bf16 weights
    q_scale, w = mqa_logits_mx_inputs(q, None, weights)
    logits = []
    for wide in (False, True):
        cache, table = _place(pages, *INDEXER, wide, g)  # [N, 64, 132] uint8
        kv = kv_cache_as_quant_view(cache, 128, False)  # sparse_attn_indexer.py:794
        # indexer.py:1747-1752 (block size in states: 64 rows per kernel page)
        sched = get_paged_mqa_logits_metadata(
            ctx, INDEXER[0], num_compute_units(torch.cuda.current_device()), indices=indices)
        # sparse_attn_indexer.py:880-889; max_model_len in compressed rows (attention.py:1010)
        logits.append(fp8_fp4_paged_mqa_logits(
            (q, q_scale), kv, w, ctx, table, sched, max_model_len=MAX_MODEL_LEN // 4,
            indices=indices))
    torch.cuda.synchronize()
    for r, n in enumerate(ctx.view(-1).tolist()):  # columns past n are left uncleaned
        a, b = logits[0][r, :n], logits[1][r, :n]
        assert a.float().abs().sum() > 0
        assert torch.equal(_bits(a), _bits(b)), f"request {r}"


def test_indexer_prefill_gather_reads_wide_pages_as_default_ones():
    _need_vllm_033()
    from vllm import _custom_ops as ops

    g = torch.Generator().manual_seed(3)
    pages = _indexer_pages(sum(NPAGES), g, mx=False)  # the gather copies bytes
    rows = [n // 4 for n in LENS]
    cu = torch.tensor([0, *itertools.accumulate(rows)], dtype=torch.int32, device="cuda")
    got = []
    for wide in (False, True):
        cache, table = _place(pages, *INDEXER, wide, g)  # [N, 64, 132] uint8
        k = torch.empty(sum(rows), 128, dtype=torch.float8_e4m3fn, device="cuda")
        s = torch.empty(sum(rows), 4, dtype=torch.uint8, device="cuda")
        # model_executor/layers/sparse_attn_indexer.py:652-658 (prefill chunk gather)
        ops.cp_gather_indexer_k_quant_cache(cache, k, s, table, cu)
        got.append((_bits(k), s))
    torch.cuda.synchronize()
    # the rows each request owns, read straight from the logical pages
    starts = [0, *itertools.accumulate(NPAGES)]
    ref_k = pages[:, :64 * 128].reshape(-1, 64, 128)
    ref_s = pages[:, 64 * 128:].reshape(-1, 64, 4)
    want = [torch.cat([ref[starts[r]:starts[r + 1]].reshape(-1, ref.shape[-1])[:n]
                       for r, n in enumerate(rows)]).cuda() for ref in (ref_k, ref_s)]
    assert want[0].any()
    for k, s in got:
        assert torch.equal(k, want[0]) and torch.equal(s, want[1])


def test_indexer_write_lands_in_wide_pages_as_in_default_ones():
    _need_vllm_033()
    from vllm import _custom_ops as ops
    from vllm.utils.deep_gemm import mqa_logits_use_mx_scales

    g = torch.Generator().manual_seed(4)
    blank = torch.zeros(sum(NPAGES), INDEXER[0] * INDEXER[1], dtype=torch.uint8)
    tokens = sum(LENS)  # every token of the four requests, as one prefill
    k = (torch.randn(tokens, 128, generator=g) * 2).to(torch.bfloat16).cuda()
    # sparse_attn_indexer.py:573-579 (V4 itself writes through its compressor: see below)
    fmt = "mxfp8" if mqa_logits_use_mx_scales() else "ue8m0"
    got = []
    for wide in (False, True):
        cache, table = _place(blank, *INDEXER, wide, g)  # [N, 64, 132] uint8
        slots = _compressed_slots(table, INDEXER[0], 4)
        before = _backing(cache).clone()
        ops.indexer_k_quant_and_cache(k, cache, slots, 128, fmt)
        torch.cuda.synchronize()
        _assert_only_pages_written(before, cache, _ids(table))
        got.append(cache[_ids(table).long()])  # [P, 64, 132] uint8: the logical pages
    assert _rows_written(got[0], 128) == sum(n // 4 for n in LENS)
    assert torch.equal(got[0], got[1])


def test_indexer_compressor_store_lands_in_wide_pages_as_in_default_ones():
    _need_vllm_033()
    from vllm.models.deepseek_v4.common.ops.fused_compress_quant_cache import (
        compress_norm_rope_store_triton)

    g = torch.Generator().manual_seed(5)
    req, pos = _prefill()
    # the state _SAVE_PARTIAL_STATES_KERNEL leaves for every token, bound as
    # CompressorStateCache binds it (ratio 4: 4-token blocks of [kv 2 x 128 | score 2 x 128]
    # fp32 rows, two overlapping windows), each request's blocks at random
    nblk = [-(-n // 4) for n in LENS]
    state = torch.randn(sum(nblk) + 1, 4, 512, generator=g).cuda()  # [S, 4, 512] float32
    stable = torch.zeros(len(LENS), MAX_MODEL_LEN // 4, dtype=torch.int32)
    for r, b in enumerate((torch.randperm(sum(nblk), generator=g) + 1).split(nblk)):
        stable[r, :len(b)] = b
    sslots = stable[req.long(), pos // 4].long() * 4 + pos % 4  # the state's own slots
    weight = (1 + 0.1 * torch.randn(128, generator=g)).to(torch.bfloat16).cuda()
    req, pos, sslots, stable = req.cuda(), pos.cuda(), sslots.cuda(), stable.cuda()
    cos_sin = _cos_sin()

    def store(cache, slots):
        # models/deepseek_v4/compressor.py:500-524 as it runs for the indexer on CUDA
        # (head_dim 128 takes :497), attributes from compressor.py:302-310 and
        # attention.py:1037-1046 (FP8 cache: indexer_kv_dtype "auto" is fp8); it hands all
        # of them unchanged to the fused kernel (fused_compress_quant_cache.py:82-105)
        compress_norm_rope_store_triton(
            state_cache=state, num_actual=len(pos), token_to_req_indices=req,
            positions=pos, slot_mapping=sslots, block_table=stable, block_size=4,
            state_width=state.shape[-1] // 2, cos_sin_cache=cos_sin, kv_cache=cache,
            k_cache_metadata=SimpleNamespace(slot_mapping=slots),  # indexer.py:1772
            pdl_kwargs={"launch_pdl": False}, head_dim=128, rope_head_dim=64,
            compress_ratio=4, overlap=True, use_fp4_cache=False, rms_norm_weight=weight,
            rms_norm_eps=1e-6, quant_block=128, token_stride=128, scale_dim=4)
    got = _stored_in_both_layouts(INDEXER, 4, g, store)  # [P, 64, 132] uint8 pages each
    assert _rows_written(got[0], 128) == sum(n // 4 for n in LENS)
    assert torch.equal(got[0], got[1])


def test_c128a_compressor_store_lands_in_wide_pages_as_in_default_ones():
    _need_vllm_033()
    try:
        from vllm.models.deepseek_v4.nvidia.ops.sparse_attn_compress_cutedsl import (
            _SPARSE_ATTN_NORM_ROPE_STORE_KERNEL as c128_store)
    except ImportError as e:  # cutlass / quack: V4's c128a layers cannot run without them
        pytest.skip(f"vLLM's CuTe-DSL compressor kernels do not import: {e}")

    g = torch.Generator().manual_seed(6)
    pos = _prefill()[1].cuda()
    # what SparseAttnCompressC128Block8Kernel hands the store: a pre-norm 512-wide row per
    # token, read only where a 128-token group ends; that half writes no cache
    ckv = torch.randn(len(pos), 512, generator=g).cuda()  # [T, 512] float32
    weight = (1 + 0.1 * torch.randn(512, generator=g)).to(torch.bfloat16).cuda()
    cos_sin = _cos_sin()

    def store(cache, slots):
        # nvidia/ops/sparse_attn_compress_cutedsl.py:2473-2485, reached from
        # compressor.py:473-485 (CUDA, head_dim 512; fp8_ds_mla's uint8 cache is not
        # store_full_kv); of the state's slot_mapping the kernel reads only the sign (:1521)
        c128_store(
            compressed_kv=ckv, positions=pos,
            slot_mapping=torch.arange(len(pos), device="cuda"), rms_norm_weight=weight,
            rms_norm_eps=1e-6, cos_sin_cache=cos_sin, kv_cache=cache, kv_slot_mapping=slots,
            compress_ratio=128, head_dim=512, rope_head_dim=64)
    got = _stored_in_both_layouts(C128A, 128, g, store)  # [P, 2, 584] uint8 pages each
    assert _rows_written(got[0], 576) == sum(n // 128 for n in LENS)
    assert torch.equal(got[0], got[1])
