"""Triton ``gather_rows`` against ``gather_reference``: the whole destination tensor
must match (copied rows equal, every other row untouched), for any row width,
alignment, dtype and program count."""
import os

import pytest
import torch

from vllm_dhisparse.triton_kernels import gather_reference, gather_rows
from vllm_dhisparse.triton_kernels.gather import default_blocks_per_row

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def assert_rows_equal(got, want, context=""):
    diff = (got != want).reshape(got.shape[0], -1).any(-1)
    if diff.any():
        rows = diff.nonzero().flatten()[:8].tolist()
        lines = [f"  row {r}: got {got[r].tolist()[:12]} want {want[r].tolist()[:12]}" for r in rows]
        raise AssertionError(f"device_rows{context}: {int(diff.sum())} of {got.shape[0]} rows "
                             f"differ\n" + "\n".join(lines))


def random_misses(g, n_batch, width, host_rows, dev_rows, fill=0.7):
    """Distinct destinations across the batch (as the resolver guarantees), any sources."""
    count = (torch.rand(n_batch, generator=g) * (width + 1) * fill).long().clamp(max=width)
    dst = torch.randperm(dev_rows, generator=g)[:n_batch * width]
    dst = torch.cat([dst, torch.full((n_batch * width - dst.numel(),), -1)]).view(n_batch, width)
    src = torch.randint(0, host_rows, (n_batch, width), generator=g)
    invalid = torch.arange(width)[None, :] >= count[:, None]
    src = torch.where(invalid, 0, src)  # the resolver leaves 0 / -1 beyond the count
    dst = torch.where(invalid, -1, dst)
    return src.to(DEVICE), dst.int().to(DEVICE), count.int().to(DEVICE)


def run_both(host, dev, src, dst, count, blocks_per_row=None, context=""):
    want = dev.clone()
    gather_reference(host, want, src, dst, count)
    gather_rows(host, dev, src, dst, count, blocks_per_row=blocks_per_row)
    assert_rows_equal(dev, want, context)


@pytest.mark.parametrize("row_bytes", [1, 2, 6, 37, 64, 584, 656, 2432])
def test_row_widths(row_bytes):
    g = torch.Generator().manual_seed(row_bytes)
    host = torch.randint(0, 256, (50, row_bytes), generator=g, dtype=torch.uint8).to(DEVICE)
    dev = torch.randint(0, 256, (40, row_bytes), generator=g, dtype=torch.uint8).to(DEVICE)
    src, dst, count = random_misses(g, 3, 12, 50, 40)
    run_both(host, dev, src, dst, count, context=f" ({row_bytes} B rows)")


@pytest.mark.parametrize("blocks_per_row", [1, 3, 32])
def test_program_counts(blocks_per_row):
    g = torch.Generator().manual_seed(blocks_per_row)
    host = torch.randint(0, 256, (300, 24), generator=g, dtype=torch.uint8).to(DEVICE)
    dev = torch.zeros(260, 24, dtype=torch.uint8, device=DEVICE)
    src, dst, count = random_misses(g, 2, 130, 300, 260, fill=1.0)
    run_both(host, dev, src, dst, count, blocks_per_row, f" (G={blocks_per_row})")


def test_typed_rows_are_copied_as_bytes():
    g = torch.Generator().manual_seed(7)
    host = torch.randn(30, 5, generator=g).half().to(DEVICE)  # 10 B rows -> int16 words
    dev = torch.zeros(20, 5, dtype=torch.float16, device=DEVICE)
    src, dst, count = random_misses(g, 2, 6, 30, 20)
    run_both(host, dev, src, dst, count)


def test_unaligned_and_strided_views():
    """A 3-byte offset forces byte words; a row stride wider than the row is honoured."""
    g = torch.Generator().manual_seed(3)
    flat = torch.randint(0, 256, (20 * 16 + 3,), generator=g, dtype=torch.uint8).to(DEVICE)
    host = flat[3:].view(20, 16)
    wide = torch.zeros(25, 24, dtype=torch.uint8, device=DEVICE)
    dev = wide[:, :16]
    src, dst, count = random_misses(g, 2, 8, 20, 25)
    want = wide.clone()
    gather_reference(host, want[:, :16], src, dst, count)
    gather_rows(host, dev, src, dst, count)
    assert_rows_equal(wide, want, " (unaligned host, strided device)")


def test_duplicate_sources_and_empty_rows():
    host = torch.arange(10 * 8, dtype=torch.uint8, device=DEVICE).view(10, 8)
    dev = torch.zeros(6, 8, dtype=torch.uint8, device=DEVICE)
    src = torch.tensor([[4, 4, 9, 0], [0, 0, 0, 0], [1, 2, 3, 0]], device=DEVICE)
    dst = torch.tensor([[5, 0, 2, -1], [-1, -1, -1, -1], [1, 3, 4, -1]], dtype=torch.int32,
                       device=DEVICE)
    count = torch.tensor([3, 0, 3], dtype=torch.int32, device=DEVICE)
    run_both(host, dev, src, dst, count)


def test_nothing_to_copy():
    host = torch.ones(4, 8, dtype=torch.uint8, device=DEVICE)
    dev = torch.zeros(4, 8, dtype=torch.uint8, device=DEVICE)
    empty = torch.zeros(0, 5, dtype=torch.int64, device=DEVICE)
    gather_rows(host, dev, empty, empty.int(), torch.zeros(0, dtype=torch.int32, device=DEVICE))
    gather_rows(host, dev, torch.zeros(2, 0, dtype=torch.int64, device=DEVICE),
                torch.zeros(2, 0, dtype=torch.int32, device=DEVICE),
                torch.zeros(2, dtype=torch.int32, device=DEVICE))
    assert (dev == 0).all()


def test_blocks_per_row_shrinks_with_batch():
    sizes = [default_blocks_per_row(n) for n in (1, 4, 8, 16, 32, 64, 160)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 32 and sizes[-1] == 4


def _good():
    host = torch.zeros(10, 8, dtype=torch.uint8, device=DEVICE)
    dev = torch.zeros(10, 8, dtype=torch.uint8, device=DEVICE)
    return dict(host_rows=host, device_rows=dev,
                miss_src=torch.zeros(2, 3, dtype=torch.int64, device=DEVICE),
                miss_dst=torch.zeros(2, 3, dtype=torch.int32, device=DEVICE),
                miss_count=torch.zeros(2, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize("name,bad,needle", [
    ("miss_src", lambda a: a["miss_src"].int(), "int64"),
    ("miss_dst", lambda a: a["miss_dst"].long(), "int32"),
    ("miss_dst", lambda a: a["miss_dst"][:1], r"\[2, 3\]"),
    ("miss_count", lambda a: a["miss_count"].long(), "int32"),
    ("miss_count", lambda a: a["miss_count"][:1], r"\[2\]"),
    ("host_rows", lambda a: a["host_rows"].view(torch.int16), "same dtype"),
    ("host_rows", lambda a: a["host_rows"][:, :4], "same dtype and width"),
    ("host_rows", lambda a: a["host_rows"].flatten(), "2-D"),
    ("device_rows", lambda a: a["device_rows"].t(), "contiguous|width"),
    ("host_rows", lambda a: a["host_rows"].to("meta"), "pinned"),
    ("miss_count", lambda a: a["miss_count"].to("meta"), "meta"),
    ("blocks_per_row", lambda a: 0, r"\[1, 65535\]"),
])
def test_bad_input_names_the_argument(name, bad, needle):
    args = _good()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=needle) as e:
        gather_rows(**args)
    assert name in str(e.value)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_pinned_host_zero_copy_cuda():
    g = torch.Generator().manual_seed(0)
    host = torch.randint(0, 256, (500, 656), generator=g, dtype=torch.uint8).pin_memory()
    dev = torch.zeros(300, 656, dtype=torch.uint8, device="cuda")
    src, dst, count = (t.cuda() for t in random_misses(g, 4, 64, 500, 300))
    want = dev.clone()
    gather_reference(host, want, src, dst, count)
    gather_rows(host, dev, src, dst, count)
    torch.cuda.synchronize()
    assert_rows_equal(dev, want, " (pinned host)")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_unpinned_host_is_rejected_cuda():
    args = _good()
    args = {k: v.cuda() for k, v in args.items()}
    args["host_rows"] = torch.zeros(10, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="host_rows.*pinned"):
        gather_rows(**args)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_launch_from_pinned_host_captures_in_the_default_mode_cuda():
    """vLLM captures its graphs in the default ("global") mode, which forbids the driver
    query behind ``is_pinned``: the launcher must not make it while capturing."""
    g = torch.Generator().manual_seed(5)
    host = torch.randint(0, 256, (64, 40), dtype=torch.uint8, generator=g).pin_memory()
    dev = torch.zeros(32, 40, dtype=torch.uint8, device="cuda")
    src, dst, count = random_misses(g, 4, 6, 64, 32)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # the eager launch every capture follows
        gather_rows(host, dev, src, dst, count)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gather_rows(host, dev, src, dst, count)
    new_src, new_dst, new_count = random_misses(g, 4, 6, 64, 32)
    src.copy_(new_src), dst.copy_(new_dst), count.copy_(new_count)
    dev.zero_()
    want = dev.clone()
    gather_reference(host, want, src, dst, count)
    graph.replay()
    torch.cuda.synchronize()
    assert_rows_equal(dev, want, " (replayed)")
