"""Sizing formulas on small hand-computed shapes (eq. 9, eq. 11, Table 1's terms)."""
import pytest

from vllm_dhisparse.hierarchy.sizing import (DraftShape, IndexState, ModelShape, PayloadSource,
                                             ceil_div, page_rows)


def tiny(**kw) -> ModelShape:
    # 3 offloaded sources of 10-byte rows, B = 8; 2 index producers of 4-byte rows;
    # pages of 4 rows; tail of 4 rows; k = 2; draft W = 5, 7 bytes/row, K_max = 3.
    base = dict(
        name="tiny",
        payload=(PayloadSource("kv", row_bytes=10, count=3, hot_cache_rows=8),),
        index=(IndexState("idx", row_bytes=4, count=2),),
        page_size=4, tail_rows=4, top_k=2, resolver_states=2, metadata_hot_cache_rows=8,
        draft=DraftShape(window=5, row_bytes=7, k_max=3), live_sources=2)
    base.update(kw)
    return ModelShape(**base)


def test_page_rounding():
    assert ceil_div(9, 4) == 3
    assert page_rows(9, 4) == 12
    assert page_rows(8, 4) == 8
    assert tiny().history_rows(9) == 12
    assert tiny().history_rows(9, tokens_per_row=4) == 4  # ceil(9/4) = 3 rows -> one page


def test_resident_is_full_history_plus_index():
    s = tiny()
    # 9 tokens -> 12 rows; payload 3 * 12 * 10 = 360; index 2 * 12 * 4 = 96
    assert s.payload_resident_bytes(9) == 360
    assert s.index_bytes(9) == 96
    assert s.resident(9) == 456
    assert s.host_backup_bytes(9) == 360


def test_adaptive_is_index_hot_tail_metadata():
    s = tiny()
    # hot 3 * 8 * 10 = 240; tail 3 * 4 * 10 = 120; index 96
    assert s.hot_bytes() == 240
    assert s.tail_bytes() == 120
    assert s.adaptive(9, metadata=False) == 96 + 240 + 120
    # metadata per state: (pages 3 + 3 * B 24 + rows 12 + seq_len 1 + hot_clock 1) * 4
    # + host_base 8 = 172
    assert s.metadata_bytes(9) == 2 * 172
    assert s.adaptive(9) == 456 + 344


def test_adaptive_does_not_grow_with_history_except_index_and_metadata():
    s = tiny()
    grow = s.adaptive(400, metadata=False) - s.adaptive(4, metadata=False)
    assert grow == s.index_bytes(400) - s.index_bytes(4)


def test_draft_ring_eq9():
    s = tiny()
    # ceil((5 + 4 - 1 + 3) / 4) * 4 = ceil(11 / 4) * 4 = 12
    assert s.draft_ring_rows() == 12
    assert s.draft_ring_bytes() == 12 * 7
    assert tiny(draft=None).draft_ring_rows() == 0


def test_ring_never_shorter_than_window_plus_block():
    for w in range(1, 40):
        for k_max in range(1, 9):
            s = tiny(draft=DraftShape(window=w, row_bytes=1, k_max=k_max))
            r = s.draft_ring_rows()
            assert r % s.page_size == 0
            assert w + k_max <= r < w + k_max + 2 * s.page_size


def test_staging_eq11():
    s = tiny()
    # chi * N * K_max * k * d_KV = 2 * 5 * 3 * 2 * 10 = 600
    assert s.staging_total_bytes(5) == 600
    assert s.staging_per_session_bytes() == 2 * 3 * 2 * 10
    # one arena per offloaded source instead: 3 * 5 * 3 * 2 * 10
    assert s.staging_total_bytes(5, dedicated=True) == 900
    assert s.staging_total_bytes(5) == 5 * s.staging_per_session_bytes()


def test_speculative_adds_ring_and_staging_only_where_it_applies():
    s = tiny()
    assert s.resident(9, speculative=True) - s.resident(9) == s.draft_ring_bytes()
    assert (s.adaptive(9, speculative=True) - s.adaptive(9)
            == s.draft_ring_bytes() + s.staging_per_session_bytes())


def test_compressed_and_windowed_sources():
    s = tiny(payload=(
        PayloadSource("c4", row_bytes=3, count=1, tokens_per_row=4, hot_cache_rows=2),
        PayloadSource("swa", row_bytes=5, count=2, offloaded=False, window_rows=4),
    ), index=())
    # 33 tokens: c4 rows ceil(33/4) = 9 -> 12 with pages of 4; swa capped at one page of 4
    assert s.payload_resident_bytes(33) == 12 * 3 + 2 * 4 * 5
    assert s.host_backup_bytes(33) == 12 * 3
    assert s.always_resident_bytes(33) == 40
    assert s.adaptive(33, metadata=False) == 2 * 3 + 4 * 3 + 40


def test_rejects_offloaded_source_without_hot_cache():
    with pytest.raises(ValueError, match="hot_cache_rows"):
        PayloadSource("kv", row_bytes=10, hot_cache_rows=0)
