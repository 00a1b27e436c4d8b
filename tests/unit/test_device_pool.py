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


def test_planes_round_trip_and_layout():
    """Rows split into planes: read/write move whole rows; planes are back to back."""
    p = DevicePagePool(name="s", num_pages=3, page_size=2, row_bytes=5, plane_bytes=(4, 1))
    data = torch.arange(30, dtype=torch.uint8).view(6, 5)
    locs = torch.tensor([5, 0, 3, 1, 4, 2])
    p.write(locs, data)
    assert torch.equal(p.read(locs), data)
    # storage = [6 rows x 4 bytes][6 rows x 1 byte]: the fp8_ds_mla block layout
    assert torch.equal(p.storage[:24].view(6, 4)[locs], data[:, :4])
    assert torch.equal(p.storage[24:][locs], data[:, 4])
    with pytest.raises(AttributeError, match="planes"):
        p.rows
    with pytest.raises(ValueError, match="plane_bytes"):
        DevicePagePool(name="bad", num_pages=1, page_size=1, row_bytes=5, plane_bytes=(4, 2))
