import pytest
import torch

from vllm_dhisparse.hierarchy.device_pool import DevicePagePool


def pool(n=6, ps=3, width=5):
    return DevicePagePool(name="p", num_pages=n, page_size=ps, row_bytes=width)


def test_allocates_lowest_first_and_none_when_full():
    p = pool()
    assert p.allocate(2) == [0, 1]
    assert p.allocate(5) is None and p.num_free == 4  # "not now" changes nothing
    assert p.allocate(4) == [2, 3, 4, 5] and p.num_free == 0
    assert p.allocate(0) == []


def test_free_returns_pages_deterministically():
    p = pool()
    pages = p.allocate(6)
    p.free([4, 1])
    assert p.allocate(2) == [1, 4]
    p.free(pages[:1])
    with pytest.raises(ValueError, match="page 0 is not allocated"):
        p.free([0])


def test_page_rows_and_bad_sizes():
    p = pool()
    assert p.page_rows([2, 0]).tolist() == [6, 7, 8, 0, 1, 2]
    assert p.page_rows([]).numel() == 0 and p.first_row(4) == 12
    assert p.rows.shape == (18, 5) and p.rows.dtype == torch.uint8
    with pytest.raises(ValueError, match="num_pages=0"):
        pool(n=0)
    with pytest.raises(ValueError, match="-1"):
        p.allocate(-1)
