"""The routed decode's locations from vLLM-shaped metadata (flashmla/decode.py): ragged
query groups, rows written in the step itself, padding, a request the hierarchy does not
hold, against resident FlashMLA semantics (the torch reference; the H200 run holds the
same case to vLLM's kernel)."""
import json
import sys
from pathlib import Path

import pytest
import torch

from vllm_dhisparse.flashmla import decode as D
from vllm_dhisparse.flashmla import layout as L

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))
import gpu_fmla_decode as G  # noqa: E402


def test_routed_decode_equals_resident_and_counts(tmp_path):
    out = tmp_path / "d.json"
    assert G.main(["--small", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["decode"]
    assert len(r["steps"]) == G.SMALL["steps"]
    assert all(s["equal"] and s["counted"] for s in r["steps"])
    assert sum(s["fresh_selections"] for s in r["steps"]) > 0
    assert all(s["unrouted"] > 0 for s in r["steps"])


def test_overflow_staging_rows_serve_what_the_hot_cache_cannot():
    """K_max * k = 48 selections per request against a 32-row hot cache: 16 staging rows
    per request take the overflow misses, next to the rows of the step."""
    cfg = dict(G.SMALL, hot=32)
    from gpu_fmla_routed import Kernel
    r = G.decode_case(Kernel(None), cfg, torch.device("cpu"))
    assert r["passed"] and all(s["equal"] and s["counted"] for s in r["steps"]), r


def test_without_the_fresh_copy_the_run_fails(tmp_path, monkeypatch):
    """Negative control: rows the compressor wrote in the step, not copied to the
    hierarchy's storage, read stale bytes."""
    monkeypatch.setattr(D.RoutedDecode, "_copy_fresh", lambda self, *a: None)
    assert G.main(["--small", "--out", str(tmp_path / "d.json")]) == 1
    r = json.loads((tmp_path / "d.json").read_text())["decode"]
    assert "error" not in r and not all(s["equal"] for s in r["steps"])


@pytest.mark.parametrize("stride", [L.BLOCK_STRIDE, L.BLOCK_STRIDE + 3 * 576, 37448])
def test_plane_words_address_rows_of_any_block_stride(stride):
    blocks = 5
    g = torch.Generator().manual_seed(stride)
    storage = torch.randint(0, 256, (blocks * stride,), generator=g,
                            dtype=torch.uint8)
    view = L.block_view(storage, blocks, stride)  # [5, 64, 1, 584]
    data, scales, stride_w = D.plane_words(view)
    b = torch.tensor([0, 4, 2, 4])
    r = torch.tensor([0, 63, 17, 5])
    got_d = data[b * stride_w + r * (L.DATA_BYTES // D.WORD)]
    got_s = scales[b * stride_w + (L.SCALE_PLANE + r * L.SCALE_BYTES) // D.WORD]
    blocks_2d = L.as_blocks_2d(view)
    for i in range(4):
        off = int(r[i])
        assert torch.equal(got_d[i], blocks_2d[b[i], off * 576:(off + 1) * 576])
        assert torch.equal(got_s[i], blocks_2d[b[i], L.SCALE_PLANE + off * 8:
                                               L.SCALE_PLANE + (off + 1) * 8])
    with pytest.raises(ValueError, match="multiple of 8"):
        D.plane_words(L.block_view(torch.zeros(2 * 37444, dtype=torch.uint8), 2, 37444))
