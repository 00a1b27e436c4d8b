"""Staging arenas (paper 3.4, eq. 11): a layer holds one while it runs, the next reuses it.

* take / release: a lease hands out its request rows until released, never after;
* reuse across layers: with chi = 1 every source of a step stages in the same arena,
  counted as reuses; the per-step peak is what layers held at once;
* refusal: a source cannot take an arena while chi others are held;
* isolation: each batch row owns its rows, so what one request stages (or a retry of
  it after a fault) never overwrites another request's staged rows;
* memory: the arenas are allocated once per row layout next to the pools, which
  reserve no staging pages.
"""
import pytest
import torch

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.invariants import check_invariants
from vllm_dhisparse.hierarchy.specs import SourceSpec

PS, W, B = 3, 5, 4
COLUMNS = 10  # K*k - B = 3*4 - 4 = 8 overflow rows + 2 rows of the step


def rows(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, W), dtype=torch.uint8, generator=g)


def spec(name, **kw):
    return dict(dict(name=name, row_bytes=W, page_size=PS, device_pages=12, host_rows=200,
                     hot_cache_rows=B, tail_pages=1, max_req_slots=2, max_rows=30, plane_bytes=(4, 1)), **kw)


def hierarchy(arenas=1, sources=("a", "b")):
    """Two same-layout sources (one storage) with two requests, history on host only."""
    h = KVHierarchy([spec(s) for s in sources], optional_residency=False,
                    staging=dict(arenas=arenas, columns=COLUMNS))
    truth = {r: {s: rows(20, i * 7 + j) for j, s in enumerate(sources)}
             for i, r in enumerate(("r0", "r1"))}
    for r in truth:
        assert h.admit(r, 30, truth[r])
    return h, truth


def verify_rows(h, source, truth, req_ids, sel, loc):
    """Rows at the locations are each request's own (eq. 12)."""
    pool = h.sources[source].pool
    for n, r in enumerate(req_ids):
        m = sel[n] >= 0
        assert torch.equal(pool.read(loc[n][m].long()), truth[r][source][sel[n][m].long()]), \
            f"request {r} source {source}: staged bytes are not its rows"


SEL = torch.tensor([[[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]],  # r0: 12 distinct misses
                    [[11, 10, 9, 8], [7, 6, 5, 4], [3, 2, 1, 0]]], dtype=torch.int32)


def test_take_and_release():
    h, truth = hierarchy()
    arenas = h.sources["a"].arenas
    with h.staging_arena("a") as lease:
        assert arenas.live_sources() == ["a"]
        got = lease.overflow_rows([0, 1], 8)  # [2, 8] int32 rows of the storage
        assert got.shape == (2, 8) and got.dtype == torch.int32
        first, end = arenas.base_row, arenas.base_row + arenas.num_rows
        assert bool(((got >= first) & (got < end)).all())
        loc, _ = h.resolve("a", ["r0", "r1"], SEL, arena=lease)
        verify_rows(h, "a", truth, ["r0", "r1"], SEL, loc)
    assert arenas.live_sources() == [] and lease.released
    with pytest.raises(RuntimeError, match="was released"):
        lease.overflow_rows([0], 8)
    with pytest.raises(RuntimeError, match="released twice"):
        arenas.release(lease)
    with pytest.raises(ValueError, match="exceed the 10 columns"):
        with h.staging_arena("a") as lease:
            lease.overflow_rows([0], COLUMNS + 1)
    with pytest.raises(ValueError, match="outside the 2 batch rows"):
        with h.staging_arena("a") as lease:
            lease.fresh_rows(2, 1)
    check_invariants(h, truth)  # nothing held, no table points into the arena


def test_layers_reuse_one_arena_and_the_peak_is_per_step():
    h, truth = hierarchy()
    arenas = h.sources["a"].arenas
    assert h.sources["b"].arenas is arenas  # one storage, one set of arenas
    for step in range(3):
        for source in ("a", "b"):  # layers one after another, as on CPU
            with h.staging_arena(source) as lease:
                assert lease.index == 0
                loc, _ = h.resolve(source, ["r0", "r1"], SEL, arena=lease)
                fresh = lease.fresh_rows(1, 2)  # this step's rows of r1: the last columns
                assert not set(fresh.tolist()) & set(loc[1].flatten().tolist())
                verify_rows(h, source, truth, ["r0", "r1"], SEL, loc)
        assert arenas.step_peak_bytes == (2 * 8 + 2) * W  # one layer's rows at a time
        h.step()
        assert arenas.reuses == step + 1  # b reused a's arena, once per step
        assert arenas.last_step_peak_bytes == (2 * 8 + 2) * W
    st = h.stats()["staging"]
    assert st["arena_takes"] == 6 and st["arena_reuses"] == 3
    assert st["staging_bytes_step_max"] == (2 * 8 + 2) * W
    check_invariants(h, truth)


def test_a_source_cannot_stage_while_chi_arenas_are_held():
    h, _ = hierarchy(arenas=1)
    with h.staging_arena("a"):
        with pytest.raises(RuntimeError, match=r"staging_arenas = 1: every arena is held \(sources "
                                               r"\['a'\]\), so source 'b' cannot stage"):
            with h.staging_arena("b"):
                pass
        with pytest.raises(RuntimeError, match="already holds"):
            with h.staging_arena("a"):
                pass
    h2, truth = hierarchy(arenas=2, sources=("a", "b", "c"))
    with h2.staging_arena("a") as la, h2.staging_arena("b") as lb:
        assert {la.index, lb.index} == {0, 1}
        # two live layers write the same batch rows of different arenas
        loc_a, _ = h2.resolve("a", ["r0", "r1"], SEL, arena=la)
        loc_b, _ = h2.resolve("b", ["r0", "r1"], SEL, arena=lb)
        verify_rows(h2, "a", truth, ["r0", "r1"], SEL, loc_a)
        verify_rows(h2, "b", truth, ["r0", "r1"], SEL, loc_b)
        with pytest.raises(RuntimeError, match="staging_arenas = 2"):
            with h2.staging_arena("c"):
                pass
    with h2.staging_arena("c"):  # free again once the layers returned
        pass


def test_an_error_in_a_layer_releases_its_arena():
    h, _ = hierarchy()
    with pytest.raises(ZeroDivisionError):
        with h.staging_arena("a"):
            1 / 0
    with h.staging_arena("b") as lease:  # the next layer is not refused
        assert lease.index == 0


def test_a_retried_request_does_not_overwrite_another_requests_rows():
    """The worker retries a failed batched resolve one request at a time, each at its
    own batch row: r1's retry (other selections, other misses) stages into r1's rows
    only, and r0's staged rows still hold r0's bytes when attention reads them."""
    h, truth = hierarchy()
    with h.staging_arena("a") as lease:
        loc, _ = h.resolve("a", ["r0", "r1"], SEL, arena=lease)
        again = torch.tensor([[[12, 13, 14, 15], [16, 17, 18, 19], [0, 1, 2, 3]]],
                             dtype=torch.int32)
        loc1, _ = h.resolve("a", ["r1"], again, arena=lease, arena_rows=[1])
        verify_rows(h, "a", truth, ["r0"], SEL[:1], loc[:1])
        verify_rows(h, "a", truth, ["r1"], again, loc1)
        overflow = (loc1 >= lease.overflow_rows([1], 8).min()) & \
            (loc1 <= lease.overflow_rows([1], 8).max())
        assert bool(overflow.any())  # r1's misses beyond B went to batch row 1's rows
        with pytest.raises(ValueError, match="names 2 batch rows for 1 requests"):
            h.resolve("a", ["r1"], again, arena=lease, arena_rows=[0, 1])
        with pytest.raises(ValueError, match="pass its lease"):
            h.resolve("a", ["r1"], again, arena_rows=[1])
        r0_rows = set(lease.overflow_rows([0], 8).flatten().tolist()) \
            | set(lease.fresh_rows(0, 2).tolist())
        r1_rows = set(lease.overflow_rows([1], 8).flatten().tolist()) \
            | set(lease.fresh_rows(1, 2).tolist())
        assert not r0_rows & r1_rows


def test_overflow_and_fresh_rows_of_one_request_never_overlap():
    h, _ = hierarchy()
    with h.staging_arena("a") as lease:
        lease.overflow_rows([0], 8)
        lease.fresh_rows(0, 2)
        with pytest.raises(RuntimeError, match="do not fit"):
            lease.fresh_rows(0, 3)
        with pytest.raises(RuntimeError, match="overlap"):
            lease.overflow_rows([0], 9)


def test_arenas_are_allocated_once_per_layout_and_no_pool_reserves_staging():
    h, _ = hierarchy(arenas=1, sources=("a", "b", "c"))
    specs = [SourceSpec.from_dict(spec(s)) for s in "abc"]
    pools = sum(s.device_pages * s.page_size * s.row_bytes for s in specs)
    assert h.device_bytes == pools + 1 * 2 * COLUMNS * W  # chi x N x columns rows
    assert len(h.device_rows) == 1  # one storage: the attention op reads one tensor
    for parts in h.sources.values():
        assert parts.residency.required_per_request == -(-B // PS) + 1  # hot + tail only
    mixed = KVHierarchy([spec("a"), spec("w", row_bytes=7, plane_bytes=None)],
                        staging=dict(arenas=1, columns=COLUMNS))
    assert len(mixed.device_rows) == 2 and len(mixed.staging) == 2  # one per row layout
    assert mixed.sources["a"].arenas is not mixed.sources["w"].arenas


def test_a_corrupt_page_entry_never_reads_another_sources_rows_or_an_arena():
    """Pools sharing one storage bound their own page tables: an entry naming a row of
    another source's pool or of an arena is repaired (re-fetched from host, counted),
    never read."""
    h, truth = hierarchy()
    a, b = h.sources["a"], h.sources["b"]
    assert a.pool.storage.data_ptr() == b.pool.storage.data_ptr()  # one storage
    s = b.state.req_slot("r0")
    b.state.page_table[s, 0] = a.pool.row_range[0]  # rows 0-2 of r0: a's first page
    b.state.page_table[s, 1] = b.arenas.base_row  # rows 3-5: the arena's first rows
    sel = torch.tensor([[[0, 2, 3, 5]], [[0, 2, 3, 5]]], dtype=torch.int32)
    loc, counters = h.resolve("b", ["r0", "r1"], sel)
    verify_rows(h, "b", truth, ["r0", "r1"], sel, loc)
    assert counters[:, 4].tolist() == [4, 0]  # every selection of the corrupt pages
