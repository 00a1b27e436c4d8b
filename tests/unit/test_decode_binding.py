"""The worker's tables for the routed FlashMLA decode (integration/worker/decode_binding.py):
which vLLM blocks name which request slot, and the counters it reads after a step."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")  # the binding is glue: a GPU machine with the core only skips it

from vllm_dhisparse.flashmla import layout as L  # noqa: E402
from vllm_dhisparse.flashmla import routing as R  # noqa: E402
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy  # noqa: E402
from vllm_dhisparse.integration.worker.decode_binding import DecodeBinding  # noqa: E402
from vllm_dhisparse.integration.layers.model_probe import SparseLayer  # noqa: E402
from vllm_dhisparse.integration.worker.requests import TrackedRequest  # noqa: E402


def binding():
    spec = dict(name="l0", row_bytes=584, page_size=64, device_pages=16, host_rows=1024,
                hot_cache_rows=64, tail_pages=1, max_req_slots=4, max_rows=256,
                plane_bytes=(576, 8))
    h = KVHierarchy([spec], staging=dict(arenas=1, columns=2))
    rows = torch.randint(0, 100, (80, 584), dtype=torch.uint8)
    for rid in ("a", "b"):
        assert h.admit(rid, 256, {"l0": rows})
    layer = SparseLayer(name="l0", compress_ratio=4, top_k=16, row_bytes=584,
                        rows_per_block=64, group=0)
    caches = {"l0": torch.zeros(12, 64, 584, dtype=torch.uint8)}
    modules = {"l0": SimpleNamespace(routed=None)}
    return h, DecodeBinding(h, {"l0": layer}, caches, max_queries=1, fresh_rows={"l0": 2},
                            modules=modules)


def test_newest_and_next_block_name_the_slot_and_the_layer_is_bound():
    h, b = binding()
    try:
        routed = b.routed["l0"]
        assert b.modules["l0"].routed is routed
        a = TrackedRequest("a", 300, 10, [[5, 9, 2]])
        c = TrackedRequest("b", 90, 10, [[7, 3]])
        b.write_tables([(a, 300), (c, 100)])  # newest tokens in blocks 9 and 7
        sa, sb = h.req_slot_of("l0", "a"), h.req_slot_of("l0", "b")
        want = torch.full((12,), -1, dtype=torch.int32)
        want[[9, 2]], want[[7, 3]] = sa, sb
        assert torch.equal(routed.slot_by_block, want)
        # the device one token ahead of the host (async scheduling): still the slot
        table = torch.tensor([[5, 9, 2], [7, 3, 0]], dtype=torch.int32)
        got = R.token_req_slots(routed.slot_by_block, table, torch.tensor([513, 257]),
                                torch.tensor([0, 1]), torch.tensor([True, True]), 256)
        assert got.tolist() == [sa, sb]
        b.write_tables([(c, 100)])  # a finished: its blocks name nothing any more
        assert int(routed.slot_by_block[9]) == -1 and int(routed.slot_by_block[7]) == sb
    finally:
        b.close()
    assert b.modules["l0"].routed is None


def test_unverified_drafts_map_the_blocks_back_to_the_verified_newest_token():
    """The host counts the previous step's three drafts (an asynchronous scheduler): if
    vLLM rejected them, the device's newest token lies up to three tokens back, in the
    block before."""
    h, b = binding()
    try:
        a = TrackedRequest("a", 250, 10, [[5, 9, 2]], num_unverified_tokens=3)
        b.write_tables([(a, 258)])  # newest token 257 in block 9; verified newest 254 in 5
        sa = h.req_slot_of("l0", "a")
        want = torch.full((12,), -1, dtype=torch.int32)
        want[[5, 9, 2]] = sa
        assert torch.equal(b.routed["l0"].slot_by_block, want)
    finally:
        b.close()


def test_counters_are_read_and_reset():
    h, b = binding()
    try:
        routed = b.routed["l0"]
        a = TrackedRequest("a", 300, 10, [[5, 9, 2]])
        b.write_tables([(a, 320)])  # 80 c4a rows written, all committed
        local = torch.tensor([[0, 3, -1, -1], [1, -1, -1, -1]], dtype=torch.int32)
        table = torch.tensor([[5, 9, 2], [7, 3, 0]], dtype=torch.int32)
        cache = L.block_view(torch.zeros(12 * L.BLOCK_STRIDE, dtype=torch.uint8), 12)
        routed.locations(local, torch.tensor([0, 1]), torch.tensor([0, 1, 2]), table,
                         torch.tensor([320, 100]), torch.tensor([True, True]), cache)
        # request "b" is in the batch but not in the tables: its token is not routed;
        # "a"'s two valid selections are counted, none of a row of this step
        assert b.take_counters() == dict(selected=2, fresh_selections=0, fresh_rows_lost=0,
                                         unrouted_tokens=1, lost_requests=set())
        assert b.take_counters()["unrouted_tokens"] == 0
        # 85 rows written, 80 committed: 5 fresh rows, 2 fit -> "a" is named, "b" is not
        c = TrackedRequest("b", 90, 10, [[7, 3]])
        b.write_tables([(a, 340), (c, 100)])
        routed.locations(local, torch.tensor([0, 1]), torch.tensor([0, 1, 2]), table,
                         torch.tensor([340, 100]), torch.tensor([True, True]), cache)
        got = b.take_counters()
        assert got["fresh_rows_lost"] == 3 and got["lost_requests"] == {"a"}, got
        assert (got["selected"], got["fresh_selections"]) == (3, 0), got  # "b" routed now
        assert b.take_counters()["lost_requests"] == set()
        # "a" selects rows 80 and 84 of this step: 80 is staged, 84 did not fit (served
        # as nothing, its request failed): counted as the CPU layers count, served rows
        b.write_tables([(a, 340), (c, 100)])
        loc, _ = routed.locations(
            torch.tensor([[80, 84, 3, -1], [1, -1, -1, -1]], dtype=torch.int32),
            torch.tensor([0, 1]), torch.tensor([0, 1, 2]), table, torch.tensor([340, 100]),
            torch.tensor([True, True]), cache)
        assert loc[0, 0] >= 0 and loc[0, 1] == -1, loc  # never another staged row
        got = b.take_counters()
        assert (got["selected"], got["fresh_selections"]) == (3, 1), got
    finally:
        b.close()


def test_what_runs_between_steps_is_not_counted():
    """vLLM's warm-up and CUDA graph capture run the routed decode outside any step: what
    they add to the counters is dropped when the next step's tables are written."""
    h, b = binding()
    try:
        routed = b.routed["l0"]
        local = torch.tensor([[0, 3, -1, -1]], dtype=torch.int32)
        cache = L.block_view(torch.zeros(12 * L.BLOCK_STRIDE, dtype=torch.uint8), 12)
        routed.locations(local, torch.tensor([0]), torch.tensor([0, 1]),
                         torch.tensor([[5, 9, 2]], dtype=torch.int32), torch.tensor([320]),
                         torch.tensor([True]), cache)  # a dummy run: no table written yet
        routed.lost_by_slot[0] += 4
        b.write_tables([])  # the first step
        assert b.take_counters() == dict(selected=0, fresh_selections=0, fresh_rows_lost=0,
                                         unrouted_tokens=0, lost_requests=set())
    finally:
        b.close()
