"""``resolve_torch`` (the CPU resolver) against ``resolve_reference``: every output and
every state tensor, bit for bit, over call sequences mixing rows that only hit (finished
in the batched pass) with rows that miss or need repairs (left to the reference)."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vllm_dhisparse.triton_kernels.reference import (COUNTER_DIRECT, COUNTER_HOT,
                                                     resolve_reference)
from vllm_dhisparse.triton_kernels.resolve_torch import resolve_torch

from resolve_world import (DEVICE, OUTPUT_NAMES, STATE_NAMES, World, assert_same,  # noqa: E402
                          draw_world)


class TorchWorld(World):
    def call(self, sel, req_slots, *, context="", lens=False, **_):
        """resolve_torch vs resolve_reference on a shadow copy of the state: every output
        and every state tensor."""
        if self.ref is None:
            self.ref = [t.clone() for t in self.state()]
        slot_t = torch.tensor(req_slots, dtype=torch.int32, device=DEVICE)
        head = (self.page_table, self.page_size)
        tail = (self.staging_rows, self.host_base)
        kw = dict(num_device_rows=self.n_dev_rows,
                  **(dict(seq_lens=self.seq_lens) if lens else {}))
        got = resolve_torch(sel, slot_t, *head, self.hot_pos, self.hot_loc, self.hot_stamp,
                            self.hot_clock, self.hot_slot_of, *tail, **kw)
        hp, stamp, clock, hs = self.ref
        want = resolve_reference(sel, slot_t, *head, hp, self.hot_loc, stamp, clock, hs, *tail,
                                 **kw)
        ctx = f" ({context}; request slots {req_slots})"
        for name, a, b in zip(OUTPUT_NAMES, got, want):
            assert_same(name, a, b, ctx)
        for name, a, b in zip(STATE_NAMES, self.state(), self.ref):
            assert_same(name, a, b, ctx)
        return got


def warm_world(seed=0, **kw):
    w = TorchWorld(hot_cache_rows=12, width=8, positions=48, req_slots=4, batch=4, seed=seed,
                   **kw)
    w.make_direct(1, [0, 1, 2])
    w.make_direct(3, [5])
    for s in range(4):
        w.warm(s, list(range(24, 34)))
    return w


def test_hits_are_batched_and_equal_the_reference(monkeypatch):
    """Rows that only hit (direct pages, warm hot rows) finish in the batched pass: the
    stamps, clocks and counters equal the reference's."""
    from vllm_dhisparse.triton_kernels import resolve_torch as module
    rows = []
    monkeypatch.setattr(module, "resolve_reference",
                        lambda sel, *a, **k: rows.append(sel.shape[0]) or
                        resolve_reference(sel, *a, **k))
    w = warm_world()
    sel = torch.tensor([[[24, 25, 26, 27, 28, 29, 30, -1]], [[0, 1, 2, 3, 4, 5, 24, 33]],
                        [[33, 32, 31, 30, 30, 30, -1, -1]], [[20, 21, 22, 23, 24, 25, 26, 27]]],
                       dtype=torch.int32, device=DEVICE)
    got = w.call(sel, [0, 1, 2, 3], context="hits")
    counters = got[4]
    assert rows == [], "an all-hit call went to the reference"
    assert counters[:, COUNTER_DIRECT].tolist() == [0, 6, 0, 4]
    assert counters[:, COUNTER_HOT].tolist() == [7, 2, 6, 4]


@pytest.mark.parametrize("seed", range(6))
def test_sequences_of_hits_misses_and_padding_rows(seed):
    w = warm_world(seed)
    g = torch.Generator().manual_seed(seed)
    for step in range(6):
        order = torch.randperm(4, generator=g).tolist()
        slots = [s if torch.rand(1, generator=g) > 0.2 else -1 for s in order]
        # mostly rows the hot cache holds, some beyond it
        hi = 34 if step % 2 else 48
        sel = w.selections([max(s, 0) for s in slots], 2, 4, lo=20, hi=hi)
        w.call(sel, slots, context=f"step {step}", lens=bool(step % 3 == 0))


def test_repairs_and_bad_slots_go_to_the_reference():
    w = warm_world(3)
    w.hot_slot_of[0, 40] = 5  # points at a hot slot holding another row: a repair
    w.page_table[2, 0] = 10**6  # a page start past the pool: a repair
    sel = w.selections([0, 1, 2, 3], 1, 8, lo=0, hi=48)
    w.page_table[3, 6] = -5  # a bad entry over rows the hot cache holds: hits, one repair
    sel[0, 0, 0] = 40
    sel[2, 0, 0] = 1
    sel[3, 0] = torch.arange(24, 32)
    w.call(sel, [0, 1, 2, 3], context="repairs")
    w.call(sel, [0, 1, 2, 9], context="slot 9 is no slot")


def test_lengths_and_a_wrapping_clock():
    """Requests shorter than the table (selections past their length are invalid) and
    clocks at the int32 edge: the stamps wrap as the reference's do."""
    w = TorchWorld(hot_cache_rows=12, width=8, positions=48, req_slots=4, batch=4, seed=5,
                   lengths=[40, 30, 48, 27])  # slot 3: hot rows 27-29 past its length
    for s in range(4):
        w.warm(s, list(range(24, 30)))
    w.hot_clock[:] = torch.tensor([2**31 - 1, 2**31 - 2, -2**31, 0], dtype=torch.int32)
    for step in range(3):
        sel = w.selections([0, 1, 2, 3], 1, 8, lo=24, hi=30 if step < 2 else 48)
        sel[1, 0, 0] = 35  # past request slot 1's length (30): invalid, not a miss
        w.call(sel, [0, 1, 2, 3], context=f"step {step}", lens=True)
    assert int(w.hot_clock[0]) < 0  # wrapped


def test_a_call_that_raises_leaves_hit_rows_alone():
    """Row 0 overflows a staging area that is too small; row 1 only hits: its stamps and
    clock stay as they were (the caller resolves the rows again one by one)."""
    w = warm_world(6)
    w.staging_rows = w.staging_rows[:, :0]
    clock, stamps = w.hot_clock.clone(), w.hot_stamp.clone()
    sel = torch.stack([torch.arange(8).view(1, 8) + 40,
                       torch.arange(8).view(1, 8) + 24]).to(torch.int32).to(DEVICE)
    w.hot_pos[0] = -1  # row 0: every selection a miss, more misses than free hot slots?
    w.hot_slot_of[0] = -1
    w.hot_stamp[0] = w.hot_clock[0] + 1  # ... every hot slot protected: all stage
    stamps = w.hot_stamp.clone()
    with pytest.raises(ValueError, match="overflow misses"):
        resolve_torch(sel, torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
                      w.page_table, w.page_size, w.hot_pos, w.hot_loc, w.hot_stamp,
                      w.hot_clock, w.hot_slot_of, w.staging_rows, w.host_base,
                      num_device_rows=w.n_dev_rows)
    assert int(w.hot_clock[1]) == int(clock[1])
    assert torch.equal(w.hot_stamp[1], stamps[1])


def test_repeated_slot_is_the_references():
    w = warm_world(4)
    sel = w.selections([0, 0], 1, 8, lo=24, hi=34)
    w.call(sel, [0, 0], context="one slot twice")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_hypothesis_adversarial(data):
    """Small universes, some with corrupted tables, lengths and bad padding slots."""
    w, queries, top_k = draw_world(data, TorchWorld, req_slots=3)
    positions, hot_cache_rows = w.P, w.B
    w.make_direct(1, data.draw(st.lists(st.integers(0, w.page_table.shape[1] - 1), max_size=2)))
    w.warm(2, data.draw(st.lists(st.integers(0, positions - 1), unique=True,
                                 max_size=hot_cache_rows)))
    if data.draw(st.booleans(), label="corrupt tables"):
        w.hot_slot_of[0, data.draw(st.integers(0, positions - 1))] = data.draw(st.integers(-3, 7))
        w.page_table[2, 0] = data.draw(st.sampled_from([-5, 10**6, w.n_dev_rows]))
        if hot_cache_rows:
            w.hot_pos[2, 0] = data.draw(st.integers(-3, positions + 2))
    w.seq_lens[:] = torch.tensor([data.draw(st.integers(0, positions)) for _ in range(3)],
                                 dtype=torch.int32)
    for step in range(data.draw(st.integers(1, 4), label="calls")):
        rows = data.draw(st.lists(st.integers(-2, positions), min_size=3 * queries * top_k,
                                  max_size=3 * queries * top_k), label=f"selections {step}")
        sel = torch.tensor(rows, dtype=torch.int32, device=DEVICE).view(3, queries, top_k)
        slots = data.draw(st.permutations([0, 1, 2]), label=f"request slots {step}")
        pad = data.draw(st.integers(-1, 2), label=f"padding row {step}")
        if pad >= 0:
            slots[pad] = data.draw(st.sampled_from([-1, -2, 3, 9]), label="padding slot")
        w.call(sel, slots, context=f"step {step}", lens=True)
