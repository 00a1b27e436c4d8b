"""The FlashMLA V4 sparse-decode reference: FlashMLA's arguments (views of 37,440-B
blocks, [B, s_q, k] indices, per-entry lengths, an extra cache) mapped onto the CPU
op's math.  What the routed decode relies on: moving rows and remapping indices
changes nothing; a wrong index changes the output."""
import pytest
import torch

from vllm_dhisparse.eager_v4._common import store_ds_mla_rows
from vllm_dhisparse.flashmla import layout as L
from vllm_dhisparse.flashmla.reference import sparse_decode

H, SCALE = 4, 512 ** -0.5


def blocks(num_blocks: int, seed: int) -> torch.Tensor:
    """Storage of vLLM c4a blocks, every row quantized from random values."""
    g = torch.Generator().manual_seed(seed)
    storage = torch.zeros(num_blocks * L.BLOCK_STRIDE, dtype=torch.uint8)
    n = num_blocks * L.ROWS_PER_BLOCK
    nope = (torch.randn(n, 448, generator=g) * 2).to(torch.bfloat16).float()
    rope = torch.randn(n, 64, generator=g)
    store_ds_mla_rows(L.as_blocks_2d(L.block_view(storage, num_blocks)), torch.arange(n),
                      L.ROWS_PER_BLOCK, nope, rope)
    return storage


def inputs(b=3, s_q=2, k=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    swa, c4a = blocks(2, seed + 1), blocks(6, seed + 2)
    q = torch.randn(b, s_q, H, 512, generator=g).to(torch.bfloat16)
    sink = torch.randn(H, generator=g)
    swa_idx = torch.randint(0, 2 * 64, (b, s_q, 8), generator=g, dtype=torch.int32)
    idx = torch.stack([torch.randperm(6 * 64, generator=g)[:k] for _ in range(b * s_q)])
    idx = idx.view(b, s_q, k).to(torch.int32)
    lens = torch.tensor([k, k - 5, 3][:b], dtype=torch.int32)
    return q, sink, swa, swa_idx, c4a, idx, lens


def run(q, sink, swa, swa_idx, c4a_view, idx, lens):
    return sparse_decode(q, L.block_view(swa, 2), swa_idx, None, sink, SCALE,
                         extra_k_cache=c4a_view, extra_indices=idx, extra_topk_length=lens)


def test_moved_rows_with_remapped_indices_give_the_same_output():
    q, sink, swa, swa_idx, c4a, idx, lens = inputs()
    want = run(q, sink, swa, swa_idx, L.block_view(c4a, 6), idx, lens)
    # every row of the c4a blocks to another place of a pool stored as one block
    # ([R x 576][R x 8], the hierarchy's device rows)
    rows = 6 * 64
    perm = torch.randperm(rows + 50, generator=torch.Generator().manual_seed(9))[:rows]
    pool = torch.randint(0, 256, ((rows + 50) * L.ROW_BYTES,), dtype=torch.uint8)
    src = L.as_blocks_2d(L.block_view(c4a, 6))
    data = src[:, :L.SCALE_PLANE].reshape(rows, L.DATA_BYTES)
    scales = src[:, L.SCALE_PLANE:L.SCALE_PLANE + 64 * 8].reshape(rows, L.SCALE_BYTES)
    pool[:(rows + 50) * L.DATA_BYTES].view(rows + 50, L.DATA_BYTES)[perm] = data
    pool[(rows + 50) * L.DATA_BYTES:].view(rows + 50, L.SCALE_BYTES)[perm] = scales
    moved = torch.where(idx >= 0, perm[idx.long().clamp(min=0)].to(torch.int32), idx)
    got = run(q, sink, swa, swa_idx, L.one_block_view(pool, rows + 50), moved, lens)
    assert torch.equal(got, want)
    # negative control: one index off by one row
    moved[1, 0, 2] = (moved[1, 0, 2] + 1) % rows
    assert not torch.equal(run(q, sink, swa, swa_idx, L.one_block_view(pool, rows + 50), moved,
                               lens), want)


def test_entries_at_or_beyond_the_length_are_ignored():
    q, sink, swa, swa_idx, c4a, idx, lens = inputs()
    view = L.block_view(c4a, 6)
    cut = idx.clone()
    cut[(torch.arange(idx.shape[-1]) >= lens.view(-1, 1, 1)).expand_as(idx)] = -1
    assert torch.equal(run(q, sink, swa, swa_idx, view, idx, lens),
                       run(q, sink, swa, swa_idx, view, cut, None))
    # and garbage there changes nothing either
    junk = idx.clone()
    junk[2, :, 3:] = 7
    assert torch.equal(run(q, sink, swa, swa_idx, view, idx, lens),
                       run(q, sink, swa, swa_idx, view, junk, lens))


def test_no_valid_row_gives_zero_and_the_sink_scales():
    q, sink, swa, swa_idx, c4a, idx, lens = inputs()
    none = torch.full_like(idx, -1)
    out = sparse_decode(q, L.block_view(swa, 2), torch.full_like(swa_idx, -1), None, sink,
                        SCALE, extra_k_cache=L.block_view(c4a, 6), extra_indices=none,
                        extra_topk_length=lens)
    assert torch.count_nonzero(out) == 0
    # a sink far below every logit leaves plain softmax attention: lower sink, larger output
    base = run(q, sink, swa, swa_idx, L.block_view(c4a, 6), idx, lens).float()
    low = run(q, sink - 30, swa, swa_idx, L.block_view(c4a, 6), idx, lens).float()
    assert low.norm() > base.norm()


def test_global_indices_follow_the_block_table():
    table = torch.tensor([[5, 2, 7], [1, 0, 3]], dtype=torch.int32)
    local = torch.tensor([[0, 63, 64, 130, -1], [1, 65, 129, -1, -1]], dtype=torch.int32)
    got = L.global_indices(table, torch.tensor([0, 1]), local)
    assert got.tolist() == [[320, 383, 128, 450, -1], [65, 1, 193, -1, -1]]


def test_views_refuse_what_flashmla_cannot_read():
    with pytest.raises(ValueError, match="needs"):
        L.block_view(torch.zeros(L.BLOCK_STRIDE, dtype=torch.uint8), 2)
    with pytest.raises(ValueError, match="2\\*\\*31"):
        L.one_block_view(torch.zeros(8, dtype=torch.uint8), 2**31 // L.ROW_BYTES + 1)
    with pytest.raises(ValueError, match="block_stride"):
        L.block_view(torch.zeros(L.BLOCK_STRIDE, dtype=torch.uint8), 1, block_stride=100)
