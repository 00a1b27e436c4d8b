"""Everything an engine needs to run with DHiSparseConnector, for ``LLM(...)`` and ``vllm serve``.

The connector runs with its own scheduler and worker classes (vLLM's ``scheduler_cls``
and ``worker_cls``: integration/engine_core/scheduler.py, integration/worker/worker.py); an engine
configured with the connector but not with them stops at start-up, naming them.

    from vllm import LLM
    from vllm_dhisparse import engine_args
    llm = LLM(model=MODEL, **engine_args({"hot_cache_rows": 1024}))

    vllm serve MODEL $(python -c 'import vllm_dhisparse as d; print(" ".join(d.server_args()))')

Imports nothing of vLLM (the command line builds server arguments before it starts vLLM).
"""
from __future__ import annotations

import json
import shlex
from typing import Any

CONNECTOR = "DHiSparseConnector"
SCHEDULER_CLS = "vllm_dhisparse.integration.engine_core.scheduler.DHiSparseScheduler"
WORKER_CLS = "vllm_dhisparse.integration.worker.worker.DHiSparseWorker"


def transfer_config(extra: dict[str, Any] | None = None, kv_role: str = "kv_both",
                    **fields: Any) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for the connector (``fields``: other keys of it, e.g.
    ``kv_load_failure_policy`` or ``kv_connector_module_path``)."""
    return {"kv_connector": CONNECTOR, "kv_role": kv_role,
            "kv_connector_extra_config": dict(extra or {}), **fields}


def engine_args(extra: dict[str, Any] | None = None, kv_role: str = "kv_both",
                **fields: Any) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` / ``EngineArgs`` (and Ray Serve LLM's
    ``engine_kwargs``): the transfer config, the scheduler and the worker class."""
    return {"kv_transfer_config": transfer_config(extra, kv_role, **fields),
            "scheduler_cls": SCHEDULER_CLS, "worker_cls": WORKER_CLS}


def class_args() -> list[str]:
    """The server arguments that select the connector's scheduler and worker."""
    return ["--scheduler-cls", SCHEDULER_CLS, "--worker-cls", WORKER_CLS]


def server_args(extra: dict[str, Any] | None = None, kv_role: str = "kv_both",
                **fields: Any) -> list[str]:
    """Arguments of ``vllm serve`` / vLLM's OpenAI server for the connector."""
    return ["--kv-transfer-config", json.dumps(transfer_config(extra, kv_role, **fields)),
            *class_args()]


def main() -> None:
    """``python -m vllm_dhisparse.engine_args [EXTRA_JSON]``: the server arguments, quoted
    for a shell."""
    import sys
    extra = json.loads(sys.argv[1]) if len(sys.argv) > 1 else None
    print(" ".join(shlex.quote(a) for a in server_args(extra)))


if __name__ == "__main__":
    main()
