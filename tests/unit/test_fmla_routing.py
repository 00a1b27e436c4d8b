"""Device-side routing of vLLM's decode tokens to request slots (flashmla/routing.py),
the resolver's request-slot entry point, and the routed decode driven by vLLM-shaped
metadata against resident FlashMLA semantics (the torch reference on CPU)."""
import json
import sys
from pathlib import Path

import pytest
import torch

from vllm_dhisparse.flashmla import routing as R
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def test_token_slots_follow_the_newest_block_and_skip_padding():
    # 3 requests of vLLM's batch, 256-token blocks; request 1 is not in the hierarchy
    block_table = torch.tensor([[7, 3, 0], [5, 0, 0], [2, 9, 4]], dtype=torch.int32)
    seq_lens = torch.tensor([256, 10, 513], dtype=torch.int32)  # newest: blocks 7, 5, 4
    slot_by_block = torch.full((12,), -1, dtype=torch.int32)
    R.write_slot_by_block(slot_by_block, torch.tensor([7, 4]), torch.tensor([11, 22]))
    token_to_req = torch.tensor([0, 0, 1, 2, 2, 0], dtype=torch.int32)
    is_valid = torch.tensor([True, True, True, True, True, False])
    got = R.token_req_slots(slot_by_block, block_table, seq_lens, token_to_req, is_valid, 256)
    assert got.tolist() == [11, 11, -1, 22, 22, -1]
    # one more token: request 0's newest token moves to block 3, whose entry is -1 until
    # the table is rewritten for the step
    seq_lens[0] = 257
    got = R.token_req_slots(slot_by_block, block_table, seq_lens, token_to_req, is_valid, 256)
    assert got[0] == -1
    R.write_slot_by_block(slot_by_block, torch.tensor([3, 4]), torch.tensor([11, 22]))
    assert int(slot_by_block[7]) == -1  # rewritten whole: the old entry is gone
    got = R.token_req_slots(slot_by_block, block_table, seq_lens, token_to_req, is_valid, 256)
    assert got.tolist() == [11, 11, -1, 22, 22, -1]


def test_lengths_and_groups():
    local = torch.tensor([[4, 2, -1], [1, -1, -1], [0, 1, 2], [3, -1, -1]], dtype=torch.int32)
    valid = torch.tensor([True, True, True, False])
    assert R.topk_lengths(local, valid).tolist() == [2, 1, 3, 0]
    sel, slots = R.group_queries(local, torch.tensor([5, 5, 8, 8], dtype=torch.int32), 2)
    assert sel.shape == (2, 2, 3) and slots.tolist() == [5, 8]
    with pytest.raises(ValueError, match="groups of 3"):
        R.group_queries(local, torch.zeros(4, dtype=torch.int32), 3)


def test_resolve_by_request_slots_equals_resolve_by_ids_and_padding_changes_nothing():
    spec = dict(name="s", row_bytes=8, page_size=4, device_pages=16, host_rows=256,
                hot_cache_rows=8, tail_pages=1, max_req_slots=3, max_rows=64)
    hs = [KVHierarchy([spec], optional_residency=False) for _ in range(2)]
    rows = torch.randint(0, 256, (40, 8), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    for h in hs:
        for rid in ("a", "b"):
            assert h.admit(rid, 64, {"s": rows})
    sel = torch.tensor([[[1, 5, 9, 30]], [[2, 3, 33, 7]]], dtype=torch.int32)
    want, _ = hs[0].resolve("s", ["a", "b"], sel)
    slots = torch.tensor([hs[1].req_slot_of("s", "a"), hs[1].req_slot_of("s", "b")],
                         dtype=torch.int32)
    got, _ = hs[1].resolve_req_slots("s", slots, sel)
    assert torch.equal(got, want)
    st = hs[1].source("s").state
    tables = ("hot_pos", "hot_loc", "hot_stamp", "hot_clock", "hot_slot_of", "page_table")
    before = [getattr(st, name).clone() for name in tables]
    loc, counters = hs[1].resolve_req_slots("s", torch.tensor([-1, -1], dtype=torch.int32),
                                            torch.tensor([[[11, 12, 13, 14]]] * 2, dtype=torch.int32))
    assert (loc == -1).all() and int(counters.abs().sum()) == 0
    for name, b in zip(tables, before):
        assert torch.equal(getattr(st, name), b), name
    with pytest.raises(ValueError, match="req_slots must be int32"):
        hs[1].resolve_req_slots("s", slots.long(), sel)


def test_routed_decode_from_vllm_metadata_equals_resident(tmp_path):
    """The benchmark's routing case on CPU: padding rows, a replaced and a finished
    request, appends; tokens routed on the device, resolved by request slot, attended
    through the reference, equal to the resident arm every step."""
    sys.path.insert(0, str(BENCH))
    import gpu_fmla_routed as G
    out = tmp_path / "r.json"
    assert G.main(["--small", "--parts", "routing", "--out", str(out)]) == 0
    r = json.loads(out.read_text())["routing"]
    assert len(r["steps"]) == G.SMALL["steps"] and all(s["equal"] for s in r["steps"])
    assert [s["live"] for s in r["steps"]][-1] == r["batch"] - 1
    assert sum(s["fetched"] for s in r["steps"]) > 0  # host rows were read


def test_routing_the_wrong_block_fails_the_run(tmp_path, monkeypatch):
    """Negative control: tokens looked up by their request's first block instead of
    the newest one read another request's rows (or none)."""
    sys.path.insert(0, str(BENCH))
    import gpu_fmla_routed as G

    def first_block(slot_by_block, block_table, seq_lens, token_to_req, is_valid, bt):
        slots = slot_by_block[block_table[:, 0].long()][token_to_req.long()]
        return torch.where(is_valid, slots, torch.full_like(slots, -1)).to(torch.int32)
    monkeypatch.setattr(G.R, "token_req_slots", first_block)
    assert G.main(["--small", "--parts", "routing", "--out", str(tmp_path / "r.json")]) == 1
    r = json.loads((tmp_path / "r.json").read_text())["routing"]
    assert "error" not in r and not all(s["equal"] for s in r["steps"]), r
