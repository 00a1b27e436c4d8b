"""A small resolver world with ground truth, shared by the resolve kernel tests.

``World.call`` runs the Triton ``resolve`` and ``resolve_reference`` (on a shadow
copy of the state) and compares every output and every state tensor bit for bit,
then the bytes at every returned location against the ground-truth rows.
"""
import os

import torch

from vllm_dhisparse.triton_kernels import gather_rows, resolve, resolve_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
OUTPUT_NAMES = ("locations", "miss_src", "miss_dst", "miss_count", "counters")
STATE_NAMES = ("hot_pos", "hot_stamp", "hot_clock", "hot_slot_of")


def assert_same(name, got, want, context=""):
    """Exact equality with the first mismatches spelled out (byte rows compared per row)."""
    assert got.shape == want.shape, f"{name}{context}: shape {list(got.shape)} != {list(want.shape)}"
    assert got.dtype == want.dtype, f"{name}{context}: dtype {got.dtype} != {want.dtype}"
    rows = got.dtype == torch.uint8 and got.dim() == 2
    diff = (got != want).any(-1) if rows else (got != want)
    if not diff.any():
        return
    lines = []
    for i in diff.nonzero()[:8].tolist():
        g, w = got[tuple(i)].tolist(), want[tuple(i)].tolist()
        if rows:
            g, w = g[:16], w[:16]
        lines.append(f"  [{', '.join(map(str, i))}]: got {g} want {w}")
    raise AssertionError(f"{name}{context}: {int(diff.sum())} of {diff.numel()} "
                         f"{'rows' if rows else 'entries'} differ\n" + "\n".join(lines))


class World:
    """A small hierarchy with ground truth: host pool, direct pages, hot cache, staging.

    Device rows are laid out as [hot rows of all request slots | direct pages | staging],
    each region shuffled so that row numbers carry no accidental structure.
    """

    def __init__(self, *, req_slots=4, hot_cache_rows=8, positions=64, page_size=4, row_bytes=16,
                 batch=2, width=8, staging_extra=0, seed=0, lengths=None):
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.S, self.B, self.P, self.page_size = req_slots, hot_cache_rows, positions, page_size
        self.lengths = lengths or [positions] * req_slots
        n_pages = -(-positions // page_size)
        n_hot, n_direct = req_slots * hot_cache_rows, req_slots * n_pages * page_size
        per_row = max(0, width - hot_cache_rows) + staging_extra
        n_stage = batch * per_row
        self.n_dev_rows = n_hot + n_direct + n_stage
        self.host_rows = torch.randint(0, 256, (req_slots * positions, row_bytes), generator=g,
                                       dtype=torch.uint8).to(DEVICE)
        self.host_base = (torch.randperm(req_slots, generator=g) * positions).to(DEVICE)
        self.device_rows = torch.zeros(self.n_dev_rows, row_bytes, dtype=torch.uint8, device=DEVICE)
        self.hot_loc = torch.randperm(n_hot, generator=g).int().view(req_slots, hot_cache_rows) \
            .to(DEVICE)
        page_starts = n_hot + torch.randperm(req_slots * n_pages, generator=g).int() * page_size
        self.page_starts = page_starts.view(req_slots, n_pages).to(DEVICE)
        self.page_table = torch.full((req_slots, n_pages), -1, dtype=torch.int32, device=DEVICE)
        self.staging_rows = (n_hot + n_direct + torch.randperm(n_stage, generator=g).int()) \
            .view(batch, per_row).to(DEVICE)
        self.hot_pos = torch.full((req_slots, hot_cache_rows), -1, dtype=torch.int32, device=DEVICE)
        self.hot_slot_of = torch.full((req_slots, positions), -1, dtype=torch.int32, device=DEVICE)
        # stamps of earlier calls, with ties, and the clock just past them
        self.hot_clock = torch.randint(20, 30, (req_slots,), generator=g, dtype=torch.int32).to(DEVICE)
        self.hot_stamp = (self.hot_clock.cpu()[:, None] - torch.randint(
            0, 6, (req_slots, hot_cache_rows), generator=g, dtype=torch.int32)).to(DEVICE)
        self.seq_lens = torch.tensor(self.lengths, dtype=torch.int32, device=DEVICE)
        self.ref = None

    def truth(self, s, pos):
        return self.host_rows[int(self.host_base[s]) + pos]

    def make_direct(self, s, pages):
        """Pages become ready on the device (tail / optional history)."""
        for p in pages:
            start = int(self.page_starts[s, p])
            self.page_table[s, p] = start
            rows = torch.arange(p * self.page_size, min((p + 1) * self.page_size, self.P))
            self.device_rows[start:start + len(rows)] = self.truth(s, rows.to(DEVICE))

    def warm(self, s, positions):
        """Places rows in the hot cache directly (consistent state, truth bytes copied)."""
        free = (self.hot_pos[s] < 0).nonzero().flatten().tolist()
        for pos, b in zip(positions, free):
            self.hot_pos[s, b] = pos
            self.hot_slot_of[s, pos] = b
            self.device_rows[int(self.hot_loc[s, b])] = self.truth(s, pos)

    def state(self):
        return [self.hot_pos, self.hot_stamp, self.hot_clock, self.hot_slot_of]

    def selections(self, req_slots, queries, top_k, *, pad=0.1, dup=0.2, pad_query=False,
                   lo=0, hi=None):
        """Random request-local rows in [lo, min(hi, length)) with -1 padding and duplicates."""
        g = self.g
        sel = torch.empty(len(req_slots), queries, top_k, dtype=torch.int32)
        for n, s in enumerate(req_slots):
            top = min(self.lengths[s], hi if hi is not None else self.P)
            span = max(1, top - lo)
            rows = lo + torch.randint(0, span, (queries, top_k), generator=g)
            # duplicates: copy entries from other queries / positions of the same request
            copy = torch.rand(queries, top_k, generator=g) < dup
            src = rows.flatten()[torch.randint(0, queries * top_k, (queries, top_k), generator=g)]
            rows = torch.where(copy, src, rows)
            rows = torch.where(torch.rand(queries, top_k, generator=g) < pad, -1, rows)
            if pad_query:
                rows[torch.randint(0, queries, (1,), generator=g)] = -1
            sel[n] = rows.int()
        return sel.to(DEVICE)

    def call(self, sel, req_slots, *, check_bytes=True, context="", copy=None, lens=False):
        """resolve vs resolve_reference on a shadow copy of the state; gather; byte check.
        ``copy`` True / False: resolve copies the misses itself (fused / by gather_rows).
        ``lens``: both get the requests' lengths (selections at or past them are invalid)."""
        if self.ref is None:
            self.ref = [t.clone() for t in self.state()]
        slot_t = torch.tensor(req_slots, dtype=torch.int32, device=DEVICE)
        args = (self.page_table, self.page_size)
        tail = (self.staging_rows, self.host_base)
        rows = {} if copy is None else dict(host_rows=self.host_rows, device_rows=self.device_rows,
                                            fused_copy=copy)
        bound = dict(seq_lens=self.seq_lens) if lens else {}
        got = resolve(sel, slot_t, *args, self.hot_pos, self.hot_loc, self.hot_stamp,
                      self.hot_clock, self.hot_slot_of, *tail, **rows,
                      num_device_rows=self.n_dev_rows, **bound)
        hp, stamp, clock, hs = self.ref
        want = resolve_reference(sel, slot_t, *args, hp, self.hot_loc, stamp, clock, hs, *tail,
                                 num_device_rows=self.n_dev_rows, **bound)
        ctx = f" ({context}; request slots {req_slots}, selections {sel.tolist()})" if sel.numel() <= 64 \
            else f" ({context}; request slots {req_slots})"
        for name, a, b in zip(OUTPUT_NAMES, got, want):
            assert_same(name, a, b, ctx)
        for name, a, b in zip(STATE_NAMES, self.state(), self.ref):
            assert_same(name, a, b, ctx)
        if check_bytes:
            locations, miss_src, miss_dst, miss_count, _ = got
            if copy is None:
                gather_rows(self.host_rows, self.device_rows, miss_src, miss_dst, miss_count)
            self.check_bytes(sel, req_slots, locations, ctx, lens=lens)
            self.check_cache(ctx)
        return got

    def check_bytes(self, sel, req_slots, locations, ctx="", lens=False):
        for n, s in enumerate(req_slots):
            limit = min(max(int(self.seq_lens[s]), 0), self.P) if lens else self.P
            valid = (sel[n] >= 0) & (sel[n] < limit)
            assert_same("locations of padding", locations[n][~valid],
                        torch.full_like(locations[n][~valid], -1), ctx)
            got = self.device_rows[locations[n][valid].long()]
            want = self.truth(s, sel[n][valid].long())
            assert_same(f"device bytes of batch row {n} (request slot {s})", got, want, ctx)

    def check_cache(self, ctx=""):
        """Every hot slot holds the bytes of its row; hot_slot_of is its inverse."""
        for s in range(self.S):
            held = (self.hot_pos[s] >= 0).nonzero().flatten()
            pos = self.hot_pos[s, held].long()
            assert_same(f"hot_slot_of inverse (request slot {s})", self.hot_slot_of[s, pos], held.int(), ctx)
            assert int((self.hot_slot_of[s] >= 0).sum()) == held.numel(), f"stale hot_slot_of{ctx}"
            assert_same(f"hot bytes (request slot {s})", self.device_rows[self.hot_loc[s, held].long()],
                        self.truth(s, pos), ctx)


GUARD = -123456789  # sentinel filling the rows around every table (never a valid entry)
GUARDED = ("page_table", "hot_pos", "hot_loc", "hot_stamp", "hot_clock", "hot_slot_of",
           "staging_rows")


class GuardedWorld(World):
    """A World whose tables and device rows sit inside larger buffers with guard rows
    before and after them: ``guards_intact`` proves nothing outside was written."""

    def __init__(self, guard_rows=2, **kw):
        super().__init__(**kw)
        g = guard_rows
        self._outer = {}
        for name in GUARDED:
            t = getattr(self, name)
            outer = torch.full((t.shape[0] + 2 * g, *t.shape[1:]), GUARD, dtype=t.dtype,
                               device=t.device)
            outer[g:g + t.shape[0]] = t
            self._outer[name] = (outer, g)
            setattr(self, name, outer[g:g + t.shape[0]])
        rows = self.device_rows
        outer = torch.full((rows.shape[0] + 2 * g, rows.shape[1]), 0xA5, dtype=rows.dtype,
                           device=rows.device)
        outer[g:g + rows.shape[0]] = rows
        self._outer["device_rows"] = (outer, g)
        self.device_rows = outer[g:g + rows.shape[0]]

    def guards_intact(self):
        for name, (outer, g) in self._outer.items():
            inner = outer.shape[0] - 2 * g
            for part in (outer[:g], outer[g + inner:]):
                fill = 0xA5 if name == "device_rows" else GUARD
                assert bool((part == fill).all()), f"guard rows around {name} were written"


def draw_world(data, cls=None, *, req_slots: int):
    """A small universe drawn by hypothesis, where hits, misses and padding collide
    often: ``(world, queries, top_k)``."""
    from hypothesis import strategies as st
    hot_cache_rows = data.draw(st.integers(0, 6), label="hot_cache_rows")
    positions = data.draw(st.integers(1, 12), label="positions")
    queries = data.draw(st.integers(1, 3), label="queries")
    top_k = data.draw(st.integers(1, 5), label="top_k")
    w = (cls or World)(req_slots=req_slots, hot_cache_rows=hot_cache_rows, positions=positions,
                       page_size=data.draw(st.integers(1, 4)), batch=req_slots,
                       width=queries * top_k, row_bytes=3)
    return w, queries, top_k
