"""The worker half of host prefix hits (host_prefix/store.py): the window snapshot taken as
a request passes a boundary, the capture at its end and the load into another request's
blocks, on fake vLLM caches of the demo model's group shapes."""
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm_dhisparse.integration.host_prefix.store import PrefixStore  # noqa: E402
from vllm_dhisparse.integration.metadata import PrefixCapture, PrefixLoad  # noqa: E402

NUM_BLOCKS = 4000
# group -> (block tokens, sliding window or None, layers); group 3 is the c4a group
GROUPS = {0: (256, None, ["idx0", "c128"]), 1: (4, 8, ["state0"]), 2: (64, 128, ["swa0"]),
          3: (256, None, ["c4a0"]), 4: (8, 128, ["state128"])}


def setup():
    g = torch.Generator().manual_seed(0)
    kv_caches = {name: torch.randint(0, 255, (NUM_BLOCKS, 6), generator=g, dtype=torch.uint8)
                 for _, _, names in GROUPS.values() for name in names}
    config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=bs, sliding_window=w,
                                                      extra_retained_tokens=0, page_size_bytes=6),
                        layer_names=names) for bs, w, names in GROUPS.values()])
    c4a = {"c4a0": SimpleNamespace(name="c4a0", group=3, compress_ratio=4)}
    return kv_caches, config, c4a, PrefixStore(kv_caches, config, c4a, 256)


def table(first_block: int, tokens: int) -> list[list[int]]:
    """Distinct block ids per group for a request of ``tokens`` tokens."""
    out, nxt = [], first_block
    for bs, _, _ in GROUPS.values():
        n = -(-tokens // bs)
        out.append(list(range(nxt, nxt + n)))
        nxt += n
    return out


def windowed(ids: list[list[int]], n: int) -> list[list[int]]:
    """As vLLM allocates a request resuming at ``n`` tokens: the null block (0) below each
    sliding-window group's window."""
    out = []
    for (bs, window, _), group in zip(GROUPS.values(), ids):
        first = max(0, n - window + 1) // bs if window else 0
        out.append([0] * first + group[first:])
    return out


def test_capture_then_load_writes_every_group_from_the_local_hit_on():
    kv, _, c4a, store = setup()
    a = SimpleNamespace(req_id="a", block_ids=table(1, 2840), admitted=True)
    store.after_forward(a, 0, 2820)  # its 2820-token prefill passed 2816
    assert store.snapshots["a"].num_tokens == 2816
    window = {name: kv[name][[a.block_ids[g][p] for p in pos]].clone()
              for name, g, pos in (("swa0", 2, range(42, 44)), ("state0", 1, range(702, 704)),
                                   ("state128", 4, range(336, 352)))}
    for name, g, _ in (("swa0", 2, 0), ("state0", 1, 0), ("state128", 4, 0)):
        kv[name][a.block_ids[g]] = 0  # freed by vLLM and reused: the snapshot holds them
    store.after_forward(a, 2820, 2821)  # a decode step: same boundary, no new snapshot
    c4a_rows = torch.randint(0, 255, (710, 9), dtype=torch.uint8)
    store.capture(PrefixCapture(7, "a", 2816), a, lambda layer, n: c4a_rows[:n])
    entry = store.entries[7]
    assert entry.rows["c4a0"].shape == (704, 9) and store.counters.captured == 1
    for name, data in window.items():
        assert torch.equal(entry.blocks[name][1], data), name

    b = SimpleNamespace(block_ids=windowed(table(1500, 3140), 2816))
    before = {k: v.clone() for k, v in kv.items()}
    written = []
    store.load(PrefixLoad("b", 7, 512, 2816, tuple(b.block_ids)),
               lambda layer, ids, rows, data: written.append((layer.name, rows, data)))
    for name, g, pos in (("idx0", 0, range(2, 11)), ("c128", 0, range(2, 11)),
                         ("swa0", 2, range(42, 44)), ("state0", 1, range(702, 704))):
        src = entry.blocks[name]
        for p in pos:
            assert torch.equal(kv[name][b.block_ids[g][p]], src[1][src[0].index(p)]), (name, p)
        for p in range(0, 512 // GROUPS[g][0]):  # the local hit's blocks are not written
            assert torch.equal(kv[name][b.block_ids[g][p]], before[name][b.block_ids[g][p]])
    (name, rows, data), = written
    assert name == "c4a0" and rows.tolist() == list(range(128, 704))
    assert torch.equal(data, c4a_rows[128:704])
    assert store.counters.loads == 1 and store.counters.tokens_loaded == 2816 - 512


def test_a_load_that_needs_a_block_the_entry_lacks_writes_nothing():
    kv, _, c4a, store = setup()
    a = SimpleNamespace(req_id="a", block_ids=table(1, 1100), admitted=True)
    store.after_forward(a, 0, 1030)
    store.capture(PrefixCapture(1, "a", 1024), a, lambda layer, n: torch.zeros(n, 9, dtype=torch.uint8))
    b = windowed(table(1500, 1300), 1024)
    b[2][13] = 5  # vLLM kept an SWA block outside the window the entry holds (14, 15)
    before = {k: v.clone() for k, v in kv.items()}
    with pytest.raises(RuntimeError, match="lacks block positions"):
        store.load(PrefixLoad("b", 1, 0, 1024, tuple(b)), lambda *args: None)
    assert all(torch.equal(kv[k], before[k]) for k in kv)
    with pytest.raises(RuntimeError, match="not held"):
        store.load(PrefixLoad("b", 2, 0, 1024, tuple(b)), lambda *args: None)


def test_capture_needs_the_snapshot_of_its_boundary():
    _, _, _, store = setup()
    a = SimpleNamespace(req_id="a", block_ids=table(1, 1100), admitted=True)
    store.after_forward(a, 0, 700)  # boundary 512
    with pytest.raises(RuntimeError, match="no window snapshot at 1024"):
        store.capture(PrefixCapture(1, "a", 1024), a, lambda layer, n: torch.zeros(n, 9))
    store.after_forward(a, 1023, 1024)
    store.capture(PrefixCapture(1, "a", 1024), a, lambda layer, n: torch.zeros(n, 9))
    # a resumed request starts again: no snapshot until it passes a boundary
    store.forget_request("a")
    store.after_forward(a, 0, 100)
    assert "a" not in store.snapshots
    # accepted drafts took it past 1280 in an earlier step: that window may be gone
    store.after_forward(a, 0, 1030)
    store.after_forward(a, 1283, 1284)
    assert "a" not in store.snapshots
    store.evict(1)
    assert store.counters.evicted == 1 and store.counters.entries == 0 == store.counters.bytes_held
