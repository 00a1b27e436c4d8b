"""The one configuration object: built from vLLM's ``kv_connector_extra_config``.

Every knob is declared once in ``_FIELDS`` (type, default, help); the frozen
dataclass, the validation and the ``--help``-style description all come from
that table.  Unknown keys are rejected with the list of valid ones, so a typo
never silently falls back to a default; NaN and infinity are rejected too.

Nothing else configures the package: no environment variable changes what it does.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Mapping

RECLAIM_POLICIES = ("largest_first", "oldest_first", "least_recently_active")
RESOLVER_BACKENDS = ("auto", "triton", "torch", "reference")
RESOLVE_TIMINGS = ("auto", "on", "off")
SPEC_PRESETS = ("", "dspark", "dflash2")
MAX_STAGING_ARENAS = 128  # more payload layers than any supported model has

# key: (type, default, allowed / lower bound, help)
_FIELDS: dict[str, tuple[type, Any, Any, str]] = {
    "hot_cache_rows": (int, None, 1, "rows of per-request hot cache B per source; default 2 x top-k"),
    "host_pool_gib": (float, 4.0, 0.0, "pinned host memory for full KV history, GiB"),
    "tail_pages": (int, 2, 1, "device pages per request/source for rows not yet host-backed"),
    "admission_reserve_pages": (int, 0, 0, "pages kept free for admissions (M_res of eq. 3)"),
    "repopulate_pages_per_step": (int, 16, 0, "bound on optional-history pages refilled per step"),
    "reclaim_policy": (str, "largest_first", RECLAIM_POLICIES, "order in which whole requests are reclaimed (eq. 4)"),
    "optional_residency": (bool, True, None, "keep imported history on device while memory is spare"),
    "eager_backup": (bool, False, None, "back up imported history at admission instead of deferring it"),
    "device_window_tokens": (int, 512, 0, "c4a tokens vLLM keeps on device behind the newest processed "
                             "one (older blocks are freed; the hierarchy serves them); 0 = keep all"),
    "history_block_tokens": (int, 0, 0, "tokens per vLLM block of the history vLLM keeps whole on "
                             "device (indexer keys, c128a rows), a multiple of 256; wider blocks "
                             "cost fewer block strides per token of history (docs/capacity.md); "
                             "prefix hits then come in these steps; 0 = vLLM's block size"),
    "device_pool_pages": (int, 0, 0, "device pages per source for the hierarchy (required + optional), "
                          "counted inside vLLM's KV budget; 0 = auto: what max_num_seqs running "
                          "requests require, plus one hot cache of optional history each"),
    "staging_arenas": (int, 1, 1, "chi: verification staging arenas, each N x (K_max x k - B + "
                       "this step's rows) rows, reused layer after layer; 1 where sparse layers "
                       "run one after another (CPU), the payload layers whose attention can run "
                       "at once on GPU (e.g. 4 for GLM-5.3's index-sharing groups); at most the "
                       "number of sparse layers"),
    "resolver_backend": (str, "auto", RESOLVER_BACKENDS, "triton on CUDA, torch elsewhere (the "
                         "reference with hit-only batch rows batched); reference: the "
                         "specification alone"),
    "resolve_timing": (str, "auto", RESOLVE_TIMINGS, "time every resolve call for the "
                       "vllm:dhisparse_resolve_seconds histogram; on CUDA this adds a "
                       "synchronisation per call; auto = on CPU only"),
    "stats_interval_s": (float, None, 0.0, "least seconds between two metric collections (a "
                         "collection reads device counters: one synchronisation); default 0 "
                         "on CPU, 1 on CUDA"),
    "stats_file": (str, "", None, "write connector counters as JSON to this path after each step; "
                   "'{pid}' in it becomes the worker's process id (replicas sharing a config)"),
    "host_prefix_gib": (float, 0.0, 0.0, "host memory for the KV of finished and preempted requests' "
                        "prefixes (kv_both, prefix caching on): a later request whose prompt "
                        "starts with one loads it from host instead of recomputing it, "
                        "least recently used freed first; 0 = off"),
    "spec": (str, "", SPEC_PRESETS, "speculative preset the engine must run ('' = whatever its "
             "speculative_config says): dspark or dflash2 (vllm_dhisparse.spec)"),
    # prefill/decode handoff (kv_role kv_producer / kv_consumer; ignored by kv_both)
    "handoff_host": (str, "127.0.0.1", None, "kv_producer: address its handoff side channel binds "
                     "and advertises to decode instances (remote_host); 'auto' = this node's "
                     "address as vLLM sees it (VLLM_HOST_IP, else the primary interface)"),
    "handoff_port": (int, 5790, 0, "kv_producer: TCP port of its handoff side channel (one per "
                     "prefill engine on a host); 0 = a free port the OS picks (the worker "
                     "reports it to its scheduler through vLLM's handshake metadata)"),
    "handoff_lease_s": (float, 30.0, 0.1, "kv_producer: seconds a captured handoff waits to be "
                        "pulled before it is freed"),
    "handoff_buffer_gib": (float, 4.0, 2**-10, "kv_producer: host memory for handoffs not pulled yet; "
                           "a capture beyond it is refused (the decode side then fails or "
                           "recomputes per kv_load_failure_policy)"),
    "handoff_timeout_s": (float, 30.0, 0.1, "kv_consumer: seconds to wait for a producer's answer "
                          "before the load fails"),
}

@dataclass(frozen=True)
class DHiSparseConfig:
    hot_cache_rows: int | None = None
    host_pool_gib: float = 4.0
    tail_pages: int = 2
    admission_reserve_pages: int = 0
    repopulate_pages_per_step: int = 16
    reclaim_policy: str = "largest_first"
    optional_residency: bool = True
    eager_backup: bool = False
    device_window_tokens: int = 512
    history_block_tokens: int = 0
    device_pool_pages: int = 0
    staging_arenas: int = 1
    resolver_backend: str = "auto"
    resolve_timing: str = "auto"
    stats_interval_s: float | None = None
    stats_file: str = ""
    host_prefix_gib: float = 0.0
    spec: str = ""
    handoff_host: str = "127.0.0.1"
    handoff_port: int = 5790
    handoff_lease_s: float = 30.0
    handoff_buffer_gib: float = 4.0
    handoff_timeout_s: float = 30.0

    def __post_init__(self):
        for key, (typ, _, allowed, _help) in _FIELDS.items():
            value = getattr(self, key)
            if value is None and _FIELDS[key][1] is None:
                continue
            if typ is float and isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, key, float(value))
                value = float(value)
            if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
                raise ValueError(f"kv_connector_extra_config[{key!r}] = {value!r}: expected "
                                 f"{typ.__name__} ({_help})")
            if typ is float and not math.isfinite(value):
                raise ValueError(f"kv_connector_extra_config[{key!r}] = {value!r}: must be a "
                                 f"finite number ({_help})")
            if isinstance(allowed, tuple) and value not in allowed:
                raise ValueError(f"kv_connector_extra_config[{key!r}] = {value!r}: allowed "
                                 f"values are {list(allowed)}")
            if key == "staging_arenas" and not 1 <= value <= MAX_STAGING_ARENAS:
                raise ValueError(f"kv_connector_extra_config['staging_arenas'] = {value}: allowed "
                                 f"1..{MAX_STAGING_ARENAS} (and at most the sparse layers)")
            if key == "handoff_port" and value > 65535:
                raise ValueError(f"kv_connector_extra_config['handoff_port'] = {value}: not a TCP "
                                 f"port (0..65535)")
            if isinstance(allowed, (int, float)) and not isinstance(allowed, bool) and value < allowed:
                raise ValueError(f"kv_connector_extra_config[{key!r}] = {value!r}: must be >= {allowed}")
        if 0 < self.device_window_tokens < 256:
            raise ValueError(f"kv_connector_extra_config['device_window_tokens'] = "
                             f"{self.device_window_tokens}: must be 0 (keep all) or >= 256 (one "
                             f"vLLM block), so the rows of the last step stay readable")
        if self.history_block_tokens % 256:
            raise ValueError(f"kv_connector_extra_config['history_block_tokens'] = "
                             f"{self.history_block_tokens}: must be 0 (vLLM's block size) or a "
                             f"multiple of 256 (DeepSeek-V4's kernel block)")

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> "DHiSparseConfig":
        """The config of ``kv_connector_extra_config``; parsed once per process for each
        distinct mapping (every component of a process asks for the same one)."""
        extra = dict(extra or {})
        try:
            key = json.dumps(extra, sort_keys=True)
        except (TypeError, ValueError):  # not JSON: not from vLLM's CLI; parse it each time
            return cls._parse(extra)
        return _parsed(cls, key)

    @classmethod
    def _parse(cls, extra: dict[str, Any]) -> "DHiSparseConfig":
        unknown = sorted(set(extra) - set(_FIELDS))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}; valid keys: "
                             f"{sorted(_FIELDS)}")
        return cls(**extra)

    def hot_cache_rows_for(self, top_k: int) -> int:
        """B for a source whose indexer selects ``top_k`` rows; B < k is a config error."""
        rows = self.hot_cache_rows if self.hot_cache_rows is not None else 2 * top_k
        if rows < top_k:
            raise ValueError(f"kv_connector_extra_config['hot_cache_rows'] = {rows} is smaller than "
                             f"the model's top-k {top_k}; it must be >= {top_k} (default 2 x top-k)")
        return rows

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=16)
def _parsed(cls: type[DHiSparseConfig], key: str) -> DHiSparseConfig:
    return cls._parse(json.loads(key))  # frozen: one instance can serve every caller


def describe() -> str:
    """Human-readable list of the keys, for ``--help`` and the README."""
    lines = []
    for key, (typ, default, allowed, help_) in _FIELDS.items():
        extra = f" one of {list(allowed)}" if isinstance(allowed, tuple) else ""
        lines.append(f"  {key} ({typ.__name__}, default {default!r}){extra}: {help_}")
    return "\n".join(lines)


def markdown_table() -> str:
    """The keys as the README's Markdown table (``vllm-dhisparse config --markdown``)."""
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for key, (typ, default, allowed, help_) in _FIELDS.items():
        shown = "auto" if default is None else json.dumps(default)
        extra = f" (one of {', '.join(f'`{a}`' for a in allowed if a)})" \
            if isinstance(allowed, tuple) else ""
        rows.append(f"| `{key}` | {typ.__name__} | `{shown}` | {help_}{extra} |")
    return "\n".join(rows)


assert set(_FIELDS) == {f.name for f in dataclasses.fields(DHiSparseConfig)}, \
    "config table and dataclass disagree"
