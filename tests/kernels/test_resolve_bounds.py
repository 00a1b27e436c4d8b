"""The resolver under corrupted state: every out-of-range or negative entry of one
request's tables (page_table, hot_slot_of, hot_pos) and bad request slots; any value of the
recency tables (hot_stamp, hot_clock), which are never used as indices.

For each corruption, one request among three is corrupted and the same selections
run on a clean copy of the world: the kernel and the reference agree bit for bit
(``World.call``), the other requests' outputs, bytes and table rows equal the clean
run's, the corrupted request is exact after its rows are re-fetched, its locations
stay inside its own rows, ``counters[:, COUNTER_REPAIRS]`` says how many entries
were repaired, and guard rows around every table and the device pool are untouched.
"""
import importlib

import pytest
import torch

from vllm_dhisparse.triton_kernels import gather_rows
from vllm_dhisparse.triton_kernels.reference import COUNTER_REPAIRS

from resolve_world import DEVICE, STATE_NAMES, GuardedWorld, assert_same  # noqa: E402

REQ_SLOTS = [2, 0, 3]  # of the batch rows; request slot 1 is idle, 0 (batch row 1) corrupted
BAD_ROW, BAD_REQ_SLOT = 1, 0
I32_MIN, I32_MAX = -2**31, 2**31 - 1
OUTPUTS = ("locations", "miss_src", "miss_dst", "miss_count", "counters")


def make_world():
    w = GuardedWorld(req_slots=4, hot_cache_rows=8, positions=48, page_size=4, width=12, batch=3,
                     row_bytes=12, seed=7)
    w.make_direct(2, [1, 6])
    w.make_direct(3, [0])
    w.warm(BAD_REQ_SLOT, [1, 5, 9, 13, 20, 33])
    w.warm(3, [2, 7])
    return w


def selections(w, seed, bad_positions=()):
    g = torch.Generator().manual_seed(seed)
    sel = torch.randint(0, w.P, (len(REQ_SLOTS), 3, 4), generator=g, dtype=torch.int32)
    sel[:, 0, 0] = -1
    for i, p in enumerate(bad_positions):  # the corrupted request selects what was corrupted
        sel[BAD_ROW].view(-1)[1 + i] = p
    return sel.to(DEVICE)


def corrupt(w, table, value):
    """Corrupts entries of BAD_REQ_SLOT (in the kernel's state and the reference's shadow);
    returns (positions to select, expected repairs as a function of the selections of
    the corrupted row)."""
    def put(index, v):
        if table == "page_table":  # shared by both sides, read-only for the resolver
            w.page_table[index] = v
            return
        i = STATE_NAMES.index(table)
        w.state()[i][index] = v
        if w.ref is not None:  # the shadow exists from the first call on
            w.ref[i][index] = v

    if table == "page_table":
        w.make_direct(BAD_REQ_SLOT, [3, 10])  # optional-history pages, ready on device
        put((BAD_REQ_SLOT, 3), value(w))
        return [12, 14, 13], lambda s: int(((s >= 0) & (s // w.page_size == 3)).sum())
    if table == "hot_slot_of":
        held = [5, 20, 33]
        for p in held + [40]:  # 40: a row that is not held at all
            put((BAD_REQ_SLOT, p), value(w))
        bad = torch.tensor(held + [40], device=DEVICE)
        return held + [40, 40], lambda s: int(torch.isin(s, bad).sum())
    if table == "hot_pos":
        # the rows those hot slots held now point at an emptied hot slot: a selection of one is
        # a repaired hot_slot_of entry too
        rows = [int(w.hot_pos[BAD_REQ_SLOT, b]) for b in (0, 3, 7) if int(w.hot_pos[BAD_REQ_SLOT, b]) >= 0]
        for b in (0, 3, 7):
            put((BAD_REQ_SLOT, b), value(w))
        held = torch.tensor(rows, dtype=torch.int32, device=DEVICE)
        return rows, lambda s: 3 + int(torch.isin(s, held).sum())
    if table == "hot_stamp":  # any int32 is a stamp: nothing to repair, only ages change
        for b in (0, 5):
            put((BAD_REQ_SLOT, b), value(w))
        return [1, 44, 45], lambda s: 0
    if table == "hot_clock":
        put(BAD_REQ_SLOT, value(w))
        return [1, 44, 45], lambda s: 0
    raise AssertionError(table)


VALUES = {
    "minus7": lambda w: -7,
    "int32_min": lambda w: I32_MIN,
    "int32_max": lambda w: I32_MAX,
    "claim_like": lambda w: -(2**30) + 1,  # looks like the kernel's own claim codes
    "just_above": lambda w: {"page_table": w.n_dev_rows - w.page_size + 1, "hot_slot_of": w.B,
                             "hot_pos": w.P, "hot_stamp": 2**31 - 2, "hot_clock": 2**31 - 1}[w._table],
}
TABLES = ("page_table", "hot_slot_of", "hot_pos", "hot_stamp", "hot_clock")


def own_rows(w, s, batch_row):
    """Device rows a request may be given: its hot rows, its pages, its staging row."""
    pages = w.page_starts[s].long()
    page_rows = (pages[:, None] + torch.arange(w.page_size, device=DEVICE)[None, :]).flatten()
    return set(w.hot_loc[s].tolist()) | set(page_rows.tolist()) \
        | set(w.staging_rows[batch_row].tolist())


def call_and_gather(w, sel, copy):
    out = w.call(sel, REQ_SLOTS, check_bytes=False, copy=copy)
    if copy is None:
        gather_rows(w.host_rows, w.device_rows, out[1], out[2], out[3])
    return out


@pytest.fixture(params=["one_block", "many_programs", "chunked"])
def path(request, monkeypatch):
    """The kernel's three layouts: whole-B block; more programs than SMs (phase 3 in
    chunks of B); K*k wider than one chunk (phase 1 through scratch)."""
    mod = importlib.import_module("vllm_dhisparse.triton_kernels.resolve")
    if request.param == "many_programs":
        monkeypatch.setattr(mod, "_sm_count", lambda dev: 1)
        monkeypatch.setattr(mod, "_MANY_BLOCK_B", 4)
    if request.param == "chunked":
        monkeypatch.setattr(mod, "_BLOCK_W", 4)
    return request.param


@pytest.mark.parametrize("value", sorted(VALUES))
@pytest.mark.parametrize("table", TABLES)
def test_one_corrupted_request_among_several(table, value, path):
    if table == "hot_slot_of" and value == "just_above" and path != "one_block":
        pytest.skip("one path is enough for the in-range variant of this table")
    copy = None if path == "chunked" else True
    clean, bad = make_world(), make_world()
    bad._table = table
    warm = selections(clean, seed=1)
    for w in (clean, bad):
        call_and_gather(w, warm, copy)
    picks, expect = corrupt(bad, table, VALUES[value])
    if table == "page_table":  # the same pages are ready on the clean side
        clean.make_direct(BAD_REQ_SLOT, [3, 10])
    idle_before = [t[1].clone() for t in bad.state()]
    sel = selections(bad, seed=2, bad_positions=picks)
    want = call_and_gather(clean, sel, copy)
    got = call_and_gather(bad, sel, copy)  # kernel == reference on the corrupted state

    others = [r for r in range(len(REQ_SLOTS)) if r != BAD_ROW]
    for name, a, b in zip(OUTPUTS, got, want):
        assert_same(f"{name} of the other requests", a[others], b[others])
    for name, a, b in zip(STATE_NAMES, bad.state(), clean.state()):
        for s in [REQ_SLOTS[r] for r in others]:
            assert_same(f"{name} of request slot {s}", a[s], b[s])
    for name, a, b in zip(STATE_NAMES, bad.state(), idle_before):
        assert_same(f"{name} of the idle request slot", a[1], b)
    bad.check_bytes(sel, REQ_SLOTS, got[0])  # every request exact, the corrupted one re-fetched
    assert int(got[4][BAD_ROW, COUNTER_REPAIRS]) == expect(sel[BAD_ROW]), got[4]
    assert int(got[4][others, COUNTER_REPAIRS].sum()) == 0
    locs = got[0][BAD_ROW][sel[BAD_ROW] >= 0].tolist()
    assert set(locs) <= own_rows(bad, BAD_REQ_SLOT, BAD_ROW), "a location outside the request's rows"
    bad.guards_intact()

    # repaired: the next call finds nothing to repair in the hot-cache tables
    sel2 = selections(bad, seed=3, bad_positions=picks)
    again = call_and_gather(bad, sel2, copy)
    bad.check_bytes(sel2, REQ_SLOTS, again[0])
    left = expect(sel2[BAD_ROW]) if table == "page_table" else 0  # the page table is only read
    assert int(again[4][BAD_ROW, COUNTER_REPAIRS]) == left
    bad.guards_intact()


@pytest.mark.parametrize("req_slot,repairs", [(-1, 0), (-2, 1), (4, 1), (I32_MAX, 1), (I32_MIN, 1)])
def test_padding_and_out_of_range_req_slots(req_slot, repairs, path):
    """Slot -1 is a padding row (CUDA-graph padding); any other id outside [0, S) is
    treated the same and counted.  Neither touches state; the real rows are unaffected."""
    copy = None if path == "chunked" else True
    clean, w = make_world(), make_world()
    sel = selections(w, seed=4)
    req_slots = list(REQ_SLOTS)
    req_slots[BAD_ROW] = req_slot
    want = clean.call(sel, REQ_SLOTS, check_bytes=False, copy=copy)
    before = [t.clone() for t in w.state()]
    got = w.call(sel, req_slots, check_bytes=False, copy=copy)
    assert bool((got[0][BAD_ROW] == -1).all())
    assert int(got[3][BAD_ROW]) == 0 and bool((got[2][BAD_ROW] == -1).all())
    assert got[4][BAD_ROW].tolist() == [0, 0, 0, 0, repairs, 0]
    others = [r for r in range(len(REQ_SLOTS)) if r != BAD_ROW]
    for name, a, b in zip(OUTPUTS, got, want):
        assert_same(f"{name} of the real rows", a[others], b[others])
    for name, a, b in zip(STATE_NAMES, w.state(), before):
        assert_same(f"{name} of the padding row's request slot", a[BAD_REQ_SLOT], b[BAD_REQ_SLOT])
    w.guards_intact()



def test_all_direct_call_leaves_the_hot_cache_state_alone(path):
    """A call whose selections are all direct (or padding) reads no hot-cache row and
    takes no stamp: the corrupted hot_pos entries of its request stay as they are and
    are not counted (kernel == reference), until the first call with a miss repairs
    them."""
    copy = None if path == "chunked" else True
    w = make_world()
    w.make_direct(BAD_REQ_SLOT, [3, 10])
    call_and_gather(w, selections(w, seed=1), copy)  # warm; creates the reference shadow
    w._table = "hot_pos"
    corrupt(w, "hot_pos", lambda w: w.P + 3)
    direct = {2: [4, 5, 27, 24], 0: [12, 15, 40, 43], 3: [0, 1, 2, 3]}  # ready pages only
    sel = torch.full((len(REQ_SLOTS), 3, 4), -1, dtype=torch.int32)
    for r, s in enumerate(REQ_SLOTS):
        sel[r, 1] = torch.tensor(direct[s])
    before = [t.clone() for t in w.state()]
    out = call_and_gather(w, sel.to(DEVICE), copy)
    w.check_bytes(sel, REQ_SLOTS, out[0])
    assert out[4][:, COUNTER_REPAIRS].tolist() == [0, 0, 0]
    assert out[4][:, 0].tolist() == [4, 4, 4]
    for name, a, b in zip(STATE_NAMES, w.state(), before):
        assert_same(name, a, b)  # corrupt entries included: nothing read, nothing written
    later = call_and_gather(w, selections(w, seed=2, bad_positions=[44, 45]), copy)
    assert int(later[3][BAD_ROW]) > 0  # a miss: the call reads the whole row
    assert int(later[4][BAD_ROW, COUNTER_REPAIRS]) >= 3  # the 3 hot_pos entries
    w.guards_intact()


def test_reference_refuses_to_wrap_negative_slots():
    """Negative entries never index from the end (hot slot -1 used to become hot slot B-1)."""
    w = make_world()
    w._table = "hot_slot_of"
    corrupt(w, "hot_slot_of", lambda w: -1 - w.B + 2)  # -7: would wrap to hot slot 1
    sel = selections(w, seed=5, bad_positions=[5, 20, 33, 40, 40])
    out = w.call(sel, REQ_SLOTS, check_bytes=False, copy=True)
    w.check_bytes(sel, REQ_SLOTS, out[0])
    assert int(out[4][BAD_ROW, COUNTER_REPAIRS]) == 5


def _direct_call(args, **kw):
    from vllm_dhisparse.triton_kernels import resolve, resolve_reference
    ref = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    got = resolve(**args, **kw)
    want = resolve_reference(**ref, **kw)
    for name, a, b in zip(OUTPUTS, got, want):
        assert_same(name, a, b)
    for name in STATE_NAMES:
        assert_same(name, args[name], ref[name])
    return got


def _tables(n_req_slots, hot_cache_rows, positions, n_pages, page_size=4):
    i32 = dict(dtype=torch.int32, device=DEVICE)
    return dict(page_table=torch.full((n_req_slots, n_pages), -1, **i32), page_size=page_size,
                hot_pos=torch.full((n_req_slots, hot_cache_rows), -1, **i32),
                hot_loc=torch.arange(n_req_slots * hot_cache_rows, **i32).view(n_req_slots, hot_cache_rows),
                hot_stamp=torch.zeros(n_req_slots, hot_cache_rows, **i32),
                hot_clock=torch.zeros(n_req_slots, **i32),
                hot_slot_of=torch.full((n_req_slots, positions), -1, **i32),
                host_base=torch.zeros(n_req_slots, dtype=torch.int64, device=DEVICE))


def test_no_slots_at_all_every_row_is_padding():
    """S = 0: nothing may be read from the (empty) tables."""
    args = dict(selections=torch.tensor([[[0, 1]], [[2, -1]]], dtype=torch.int32, device=DEVICE),
                req_slots=torch.tensor([-1, 0], dtype=torch.int32, device=DEVICE),
                staging_rows=torch.zeros(2, 0, dtype=torch.int32, device=DEVICE),
                **_tables(0, 4, 8, 2))
    got = _direct_call(args, num_device_rows=16)
    assert got[4].tolist() == [[0, 0, 0, 0, 0, 0], [0, 0, 0, 0, 1, 0]]


def test_pool_smaller_than_a_page():
    """R < page_size: every ready-looking page entry is out of range, -1 stays -1."""
    args = dict(selections=torch.tensor([[[0, 5]]], dtype=torch.int32, device=DEVICE),
                req_slots=torch.tensor([0], dtype=torch.int32, device=DEVICE),
                staging_rows=torch.zeros(1, 0, dtype=torch.int32, device=DEVICE),
                **_tables(1, 4, 8, 2))
    args["page_table"][0, 1] = 0
    got = _direct_call(args, num_device_rows=1)
    assert int(got[4][0, COUNTER_REPAIRS]) == 1  # the entry 0 of page 1; page 0's -1 is fine


def test_page_entries_before_the_sources_first_row_are_repaired(path):
    """Pools sharing one storage: the source's rows are [F, R); an entry below F (another
    source's pool) is a page not ready, like one past R - page_size."""
    args = dict(selections=torch.tensor([[[0, 1, 4, 5, 9]]], dtype=torch.int32, device=DEVICE),
                req_slots=torch.tensor([0], dtype=torch.int32, device=DEVICE),
                staging_rows=torch.zeros(1, 8, dtype=torch.int32, device=DEVICE),
                **_tables(1, 4, 12, 3))
    args["hot_loc"] += 40
    args["page_table"][0] = torch.tensor([20, 19, 32], dtype=torch.int32)  # F = 20, R = 36
    got = _direct_call(args, first_device_row=20, num_device_rows=36)
    assert got[0][0, 0, :2].tolist() == [20, 21]  # page 0 at F: direct
    assert int(got[4][0, COUNTER_REPAIRS]) == 2  # page 1 at F - 1: rows 4 and 5
    assert int(got[4][0, 0]) == 3  # direct: 0, 1 and 9 (page 2 ends at R - 1)
