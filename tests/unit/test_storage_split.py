"""Device storages of at most 2**31 B: a layout whose pools would pass it is split into the
fewest storages of equal size, each with its own staging arenas (hierarchy/specs.py)."""
import pytest
import torch

from vllm_dhisparse.flashmla import layout as L
from vllm_dhisparse.hierarchy import specs as S
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.placement import place

from tests.unit.test_staging_arena import COLUMNS, SEL, W, hierarchy, spec, verify_rows

SOURCES = ("a", "b", "c", "d", "e")
POOL_ROWS = 12 * 3  # device_pages x page_size of spec()
ARENA_ROWS = 2 * COLUMNS  # one arena: max_req_slots x columns


def split_hierarchy(monkeypatch, limit_rows, chi=1):
    monkeypatch.setattr(S, "STORAGE_MAX_BYTES", limit_rows * W)
    return hierarchy(arenas=chi, sources=SOURCES)


def test_a_layout_over_the_limit_splits_into_the_fewest_equal_storages(monkeypatch):
    # two pools and one arena fit a storage, three pools do not: 5 sources -> 3 storages
    h, truth = split_hierarchy(monkeypatch, 2 * POOL_ROWS + ARENA_ROWS)
    assert len(h.device_rows) == 3 and len(h.staging) == 3
    assert {r.num_rows for r in h.device_rows} == {2 * POOL_ROWS + ARENA_ROWS}  # padded
    assert h.device_bytes == 3 * (2 * POOL_ROWS + ARENA_ROWS) * W == S.device_bytes(
        [S.SourceSpec.from_dict(spec(s)) for s in SOURCES], S.StagingSpec(1, COLUMNS))
    for name, parts in h.sources.items():
        first, end = parts.pool.row_range
        assert end <= parts.arenas.base_row  # the pool, then its storage's arenas
        assert parts.arenas.rows is parts.pool.device_rows
    assert h.sources["e"].pool.device_rows is not h.sources["a"].pool.device_rows
    # every source resolves its own rows through its storage and stages in its own arenas
    for name in SOURCES:
        with h.staging_arena(name) as lease:
            loc, _ = h.resolve(name, ["r0", "r1"], SEL, lease.overflow_rows([0, 1], 8))
            verify_rows(h, name, truth, ["r0", "r1"], SEL, loc)


def test_chi_arenas_per_storage_at_most_one_per_source(monkeypatch):
    """chi = 3 in storages of one or two sources: each storage takes one arena per source
    (the layers that take turns in it), and what device_bytes counts is what is allocated."""
    h, truth = split_hierarchy(monkeypatch, 2 * POOL_ROWS + 2 * ARENA_ROWS, chi=3)
    assert len(h.device_rows) > 1
    for arenas in h.staging:
        members = {n for n, p in h.sources.items() if p.arenas is arenas}
        assert arenas.arenas == min(3, len(members))
    assert h.device_bytes == S.device_bytes([S.SourceSpec.from_dict(spec(s)) for s in SOURCES],
                                            S.StagingSpec(3, COLUMNS))
    for name in SOURCES:
        with h.staging_arena(name) as lease:
            loc, _ = h.resolve(name, ["r0", "r1"], SEL, lease.overflow_rows([0, 1], 8))
            verify_rows(h, name, truth, ["r0", "r1"], SEL, loc)


def test_the_split_that_allocates_the_fewest_rows_wins():
    """Room for three pools and one arena: 3 + 2 sources (2 x 128 rows, the second storage
    padded by a pool) beat 2 + 2 + 1 (3 x 92) and five storages (5 x 56)."""
    specs = [S.SourceSpec.from_dict(spec(s)) for s in SOURCES]
    groups = S.storage_groups(specs, S.StagingSpec(1, COLUMNS),
                              max_bytes=(3 * POOL_ROWS + ARENA_ROWS) * W)
    assert [len(g.members) for g in groups] == [3, 2]
    assert [g.num_rows - g.pool_rows - g.arena_rows for g in groups] == [0, POOL_ROWS]


def test_without_the_limit_one_storage_serves_every_source(monkeypatch):
    h, _ = split_hierarchy(monkeypatch, 10**6)
    assert len(h.device_rows) == 1 and h.device_bytes == (5 * POOL_ROWS + ARENA_ROWS) * W


def test_a_source_that_cannot_fit_alone_is_refused_naming_it(monkeypatch):
    monkeypatch.setattr(S, "STORAGE_MAX_BYTES", POOL_ROWS * W)  # a pool, no room for arenas
    with pytest.raises(ValueError, match=r"source 'a': 12 device pages x 3 rows and 20 rows of "
                                         r"staging arenas of 5 B exceed 180 B.*lower "
                                         r"device_pool_pages"):
        KVHierarchy([spec(s) for s in SOURCES], staging=dict(arenas=1, columns=COLUMNS))
    wide = [spec(s) for s in SOURCES[:2]] + [spec("big", device_pages=13)]
    with pytest.raises(ValueError, match=r"source 'big': 13 device pages x 3 rows of 5 B"):
        KVHierarchy(wide)  # no staging: the pool alone is over


def test_deepseek_v4_flash_pools_at_128k_fit_flashmla_views():
    """21 c4a layers (DeepSeek-V4-Flash: layers 2, 4, ..., 42), top-k 512, 128K context,
    256 running requests with the default hot cache and optional history: 6.8 GB of pools,
    over 2**31 B in one storage; split, every storage is one FlashMLA block under the
    limit, and all of them of one block size."""
    from vllm_dhisparse.config import DHiSparseConfig
    from vllm_dhisparse.integration.worker.pool_sizing import LayerShape, plan_sources
    layers = [LayerShape(f"model.layers.{i}.attn", 4, 512, L.ROW_BYTES, L.ROWS_PER_BLOCK,
                         (L.DATA_BYTES, L.SCALE_BYTES)) for i in range(2, 43, 2)]
    plans = plan_sources(DHiSparseConfig(host_pool_gib=110.0), layers, 131072, 256, 1)
    specs = [p.spec for p in plans]
    pools = sum(s.device_pages * s.page_size for s in specs) * L.ROW_BYTES
    assert len(specs) == 21 and pools > 2**31
    storages, arenas, placed = place(specs, S.StagingSpec(arenas=1, columns=4), "meta")
    assert len(storages) > 1 and len({r.num_rows for r in storages}) == 1
    pad = sum(r.num_rows for r in storages) * L.ROW_BYTES - S.device_bytes(
        specs, S.StagingSpec(1, 4)) + sum(r.nbytes for r in storages) - sum(
        r.num_rows for r in storages) * L.ROW_BYTES
    assert pad == 0  # device_bytes is what placement allocates
    padding = sum(g.num_rows - g.pool_rows - g.arena_rows
                  for g in S.storage_groups(specs, S.StagingSpec(1, 4)))
    assert padding * L.ROW_BYTES < 0.01 * pools  # the split wastes little
    for rows in storages:
        view = L.one_block_view(rows.storage, rows.num_rows)  # raises past 2**31 B
        assert view.stride(0) == rows.num_rows * L.ROW_BYTES < 2**31
        assert rows.nbytes <= S.STORAGE_MAX_BYTES
    assert {p.rows.name for p in placed.values()} == {r.name for r in storages}
