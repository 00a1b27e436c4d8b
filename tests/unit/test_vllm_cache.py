"""Rows read out of vLLM's c4a blocks (integration/layers/vllm_cache.py) against the block layout
written out by hand: ``[rows x 576 B data][rows x 8 B scales][padding]`` per block."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

from vllm_dhisparse.integration.layers.model_probe import SparseLayer  # noqa: E402
from vllm_dhisparse.integration.layers.vllm_cache import VllmC4aCaches  # noqa: E402

ROWS_PER_BLOCK, PLANES, PAD = 4, (576, 8), 32


def test_rows_follow_the_block_layout():
    g = torch.Generator().manual_seed(0)
    blocks = 6
    truth = torch.randint(0, 256, (blocks, ROWS_PER_BLOCK, sum(PLANES)), generator=g,
                          dtype=torch.uint8)  # [block, row, data | scales]
    data = truth[:, :, :PLANES[0]].reshape(blocks, -1)
    scales = truth[:, :, PLANES[0]:].reshape(blocks, -1)
    pad = torch.zeros(blocks, PAD, dtype=torch.uint8)
    cache = torch.cat([data, scales, pad], dim=1)  # [blocks, block_bytes]
    layer = SparseLayer("attn", 4, 8, sum(PLANES), ROWS_PER_BLOCK, 0, PLANES)
    c = VllmC4aCaches()
    c.register({"attn": cache.view(torch.float32)}, ["attn"])  # vLLM hands other dtypes
    block_ids = [5, 2, 0]  # the request's blocks: rows 0-3 in block 5, 4-7 in 2, 8-11 in 0
    rows = torch.tensor([0, 3, 4, 9, 11, 6])
    want = truth[torch.tensor(block_ids)[rows // ROWS_PER_BLOCK], rows % ROWS_PER_BLOCK]
    assert torch.equal(c.rows(layer, block_ids, rows), want)
    assert torch.equal(c.first_rows(layer, block_ids, 5),
                       truth[torch.tensor([5, 5, 5, 5, 2]), torch.tensor([0, 1, 2, 3, 0])])
    cache[5, 0] ^= 0xFF  # the rows are read from the registered cache, not a copy
    assert not torch.equal(c.rows(layer, block_ids, rows), want)


def test_a_block_strided_cache_is_read_in_place_and_a_scrambled_one_refused():
    """vLLM's CUDA c4a cache is ``[blocks, rows, 584]`` with the padding in the block stride
    (no dimension of its own): read in place; a layout that is not one row of bytes per block
    would need a copy, which would go stale, so it is refused."""
    blocks, row = 3, sum(PLANES)
    stride = ROWS_PER_BLOCK * row + PAD
    buf = torch.randint(0, 256, (blocks * stride,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(1))
    cache = buf.as_strided((blocks, ROWS_PER_BLOCK, row), (stride, row, 1))
    layer = SparseLayer("attn", 4, 8, row, ROWS_PER_BLOCK, 0, PLANES)
    c = VllmC4aCaches()
    c.register({"attn": cache}, ["attn"])
    block = buf[stride:2 * stride]  # block 1, by hand
    want = torch.cat([block[576 * 2:576 * 3], block[576 * ROWS_PER_BLOCK + 8 * 2:][:8]])
    assert torch.equal(c.rows(layer, [1], torch.tensor([2]))[0], want)
    buf[stride + 576 * 2] ^= 0xFF
    assert not torch.equal(c.rows(layer, [1], torch.tensor([2]))[0], want)
    with pytest.raises(ValueError, match="'attn'.*not one row of bytes per block"):
        c.register({"attn": cache.transpose(1, 2)}, ["attn"])
