"""Per-session *required* device bytes for a model shape (paper 3.1, 3.4, Table 1).

Three regimes for one admitted request (session):

* **resident**: the whole history of every payload source and the index state
  on the device.
* **adaptive** (HiSparse / Adaptive HiSparse, required part only): index state
  over the whole history (selection runs on the GPU), and per offloaded payload
  source a hot cache of ``B`` rows, a tail of ``tail_rows`` rows, plus the
  resolver metadata of our ``SourceState`` tables.  Optional residency uses
  only spare HBM and is excluded, as in Table 1 (dagger).
* **+ speculative**: a draft-KV ring of ``R_d = ceil((W + p - 1 + K_max) / p) * p``
  rows (eq. 9) and, for the hierarchy only, verification staging
  ``M_stage = chi * N * K_max * k * d_KV`` (eq. 11) amortised over the ``N``
  request slots of a GPU (``chi * K_max * k * d_KV`` per session).

History rows of a source that packs ``m`` tokens per row are
``ceil(ceil(tokens / m) / p) * p``: rows are allocated in pages of ``p``.

Everything here is plain integer arithmetic on frozen dataclasses; the model
shapes the paper evaluates live in ``benchmarks/memory_accounting.py``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

GIB = 1 << 30
INT32 = 4
INT64 = 8


def ceil_div(a: int, b: int) -> int:
    if b <= 0:
        raise ValueError(f"divisor must be > 0, got {b}")
    return -(-a // b)


def page_rows(rows: int, page_size: int) -> int:
    """Rows rounded up to whole pages."""
    return ceil_div(rows, page_size) * page_size


def hot_cache_pages(hot_cache_rows: int, page_size: int) -> int:
    return ceil_div(hot_cache_rows, page_size)


def required_pages(hot_cache_rows: int, page_size: int, tail_pages: int) -> int:
    """M_req of one request (eq. 3): its hot cache's pages and its tail pages, held from
    admission to release; the pool sizing and the residency manager both count this."""
    return hot_cache_pages(hot_cache_rows, page_size) + tail_pages


def draft_ring_rows(window: int, page_size: int, k_max: int) -> int:
    """R_d (eq. 9): draft-KV rows a request holds at most, in whole pages."""
    return page_rows(window + page_size - 1 + k_max, page_size)


def staging_bytes(chi: int, sessions: int, k_max: int, top_k: int, row_bytes: int) -> int:
    """M_stage (eq. 11): chi reused arenas of N * K_max * k staged rows."""
    return chi * sessions * k_max * top_k * row_bytes


@dataclass(frozen=True)
class PayloadSource:
    """``count`` identical KV payload sources (e.g. 78 GLM layers, one each)."""
    name: str
    row_bytes: int
    count: int = 1
    tokens_per_row: int = 1  # m: compression (DeepSeek-V4 c4 rows hold 4 tokens)
    hot_cache_rows: int = 0  # B of each source; used when offloaded
    offloaded: bool = True  # False: always resident (sliding window, dense compressed)
    window_rows: int | None = None  # bounded history (sliding window), None = full

    def __post_init__(self):
        if self.row_bytes <= 0 or self.count <= 0 or self.tokens_per_row <= 0:
            raise ValueError(f"payload {self.name!r}: row_bytes, count, tokens_per_row must be > 0")
        if self.offloaded and self.hot_cache_rows <= 0:
            raise ValueError(f"payload {self.name!r}: an offloaded source needs hot_cache_rows > 0")


@dataclass(frozen=True)
class IndexState:
    """Indexer keys over the whole history, always on the device."""
    name: str
    row_bytes: int
    count: int = 1
    tokens_per_row: int = 1


@dataclass(frozen=True)
class DraftShape:
    """Draft-model KV read through a window of ``window`` positions (eq. 9)."""
    window: int  # W
    row_bytes: int  # all draft layers' K/V bytes of one position
    k_max: int  # K_max, the widest verification block


@dataclass(frozen=True)
class ModelShape:
    name: str
    payload: tuple
    index: tuple = ()
    page_size: int = 64
    tail_rows: int = 64  # rows per offloaded source not yet immutable (one page)
    top_k: int = 2048
    resolver_states: int = 1  # SourceState instances per session (shared LRU per index group)
    metadata_hot_cache_rows: int = 0  # mean B of those states (hot_pos / hot_loc / hot_stamp)
    metadata_tokens_per_row: int = 1  # m of the rows hot_slot_of / page_table cover
    draft: DraftShape | None = None
    live_sources: int = 1  # chi: payload sources whose staging is live at once
    staging_row_bytes: int = 0  # d_KV of a staged row (0: first offloaded source's)
    notes: tuple = field(default_factory=tuple)

    # ------------------------------------------------------------ pieces
    def history_rows(self, tokens: int, tokens_per_row: int = 1) -> int:
        return page_rows(ceil_div(tokens, tokens_per_row), self.page_size)

    def index_bytes(self, tokens: int) -> int:
        return sum(i.count * self.history_rows(tokens, i.tokens_per_row) * i.row_bytes
                   for i in self.index)

    def _src_rows(self, s: PayloadSource, tokens: int) -> int:
        rows = self.history_rows(tokens, s.tokens_per_row)
        if s.window_rows is not None:
            rows = min(rows, page_rows(s.window_rows, self.page_size))
        return rows

    def payload_resident_bytes(self, tokens: int) -> int:
        return sum(s.count * self._src_rows(s, tokens) * s.row_bytes for s in self.payload)

    def host_backup_bytes(self, tokens: int) -> int:
        """Full history of the offloaded sources (the host copy)."""
        return sum(s.count * self._src_rows(s, tokens) * s.row_bytes
                   for s in self.payload if s.offloaded)

    def hot_bytes(self) -> int:
        return sum(s.count * s.hot_cache_rows * s.row_bytes for s in self.payload if s.offloaded)

    def tail_bytes(self) -> int:
        return sum(s.count * self.tail_rows * s.row_bytes for s in self.payload if s.offloaded)

    def always_resident_bytes(self, tokens: int) -> int:
        return sum(s.count * self._src_rows(s, tokens) * s.row_bytes
                   for s in self.payload if not s.offloaded)

    def metadata_bytes(self, tokens: int) -> int:
        """Our SourceState tables for one session: page_table [max_pages] i32,
        hot_pos / hot_loc / hot_stamp [B] i32, hot_slot_of [max_rows] i32,
        seq_len and hot_clock i32, host_base i64 — per resolver state."""
        rows = self.history_rows(tokens, self.metadata_tokens_per_row)
        pages = rows // self.page_size
        per_state = (pages + 3 * self.metadata_hot_cache_rows + rows + 2) * INT32 + INT64
        return self.resolver_states * per_state

    def draft_ring_rows(self) -> int:
        if self.draft is None:
            return 0
        return draft_ring_rows(self.draft.window, self.page_size, self.draft.k_max)

    def draft_ring_bytes(self) -> int:
        return self.draft_ring_rows() * self.draft.row_bytes if self.draft else 0

    def staged_row_bytes(self) -> int:
        if self.staging_row_bytes:
            return self.staging_row_bytes
        return next((s.row_bytes for s in self.payload if s.offloaded), 0)

    def staging_total_bytes(self, sessions: int, dedicated: bool = False) -> int:
        """eq. 11 for ``sessions`` request slots; ``dedicated`` = one arena per
        offloaded source instead of ``chi`` reused arenas."""
        if self.draft is None:
            return 0
        chi = (sum(s.count for s in self.payload if s.offloaded) if dedicated
               else self.live_sources)
        return staging_bytes(chi, sessions, self.draft.k_max, self.top_k, self.staged_row_bytes())

    def staging_per_session_bytes(self) -> int:
        """eq. 11 divided by N (exact: the arena is linear in N)."""
        return self.staging_total_bytes(1)

    # ----------------------------------------------------------- regimes
    def resident(self, tokens: int, speculative: bool = False) -> int:
        b = self.payload_resident_bytes(tokens) + self.index_bytes(tokens)
        return b + (self.draft_ring_bytes() if speculative else 0)

    def adaptive(self, tokens: int, speculative: bool = False, metadata: bool = True) -> int:
        b = (self.index_bytes(tokens) + self.hot_bytes() + self.tail_bytes()
             + self.always_resident_bytes(tokens))
        if metadata:
            b += self.metadata_bytes(tokens)
        if speculative:
            b += self.draft_ring_bytes() + self.staging_per_session_bytes()
        return b

    def breakdown(self, tokens: int) -> dict:
        return {
            "tokens": tokens,
            "history_rows": self.history_rows(tokens),
            "index_state": self.index_bytes(tokens),
            "payload_full_history": self.payload_resident_bytes(tokens),
            "hot_cache": self.hot_bytes(),
            "tail": self.tail_bytes(),
            "always_resident_payload": self.always_resident_bytes(tokens),
            "resolver_metadata": self.metadata_bytes(tokens),
            "draft_ring_rows": self.draft_ring_rows(),
            "draft_ring": self.draft_ring_bytes(),
            "staging_per_session": self.staging_per_session_bytes(),
            "host_backup": self.host_backup_bytes(tokens),
        }

    def table(self, tokens: int) -> dict:
        """Bytes per session, Table 1's rows."""
        return {
            "resident": self.resident(tokens),
            "hisparse": self.adaptive(tokens),
            "adaptive": self.adaptive(tokens),
            "adaptive_no_metadata": self.adaptive(tokens, metadata=False),
            "resident_spec": self.resident(tokens, speculative=True),
            "adaptive_spec": self.adaptive(tokens, speculative=True),
            "adaptive_spec_no_metadata": self.adaptive(tokens, speculative=True, metadata=False),
            "host_backup": self.host_backup_bytes(tokens),
        }
