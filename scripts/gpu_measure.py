"""The connector as the GPU measurements run it (gpu_connector.py, gpu_capacity.py).

DHiSparseConnector serves CUDA on SM90 eagerly and with vLLM's decode graphs, and refuses
what the in-engine audit has not covered (FULL graphs of mixed batches, a compiled model,
speculative setups other than ngram / DSpark with K <= 3, SM100; the package's
``integration/support.py`` says why).
``unaudited=True`` runs this subclass, outside the package and its config, which lets those
through so that the scripts can measure and audit them; every other refusal (P/D roles,
several GPUs, other GPUs) still applies.  Engines name it with
``kv_connector_module_path="gpu_measure"`` (scripts/ on PYTHONPATH).
"""
from vllm_dhisparse.integration.connector import DHiSparseConnector

MODULE, NAME = "gpu_measure", "MeasuredConnector"


class MeasuredConnector(DHiSparseConnector):
    measures_unaudited = True


def engine_args(extra: dict, unaudited: bool = False) -> dict:
    """``vllm.LLM`` keyword arguments of an engine with the package's connector, or with
    this subclass (``unaudited``)."""
    from vllm_dhisparse.engine_args import engine_args as package_args
    if not unaudited:
        return package_args(extra)
    kw = package_args(extra, kv_connector_module_path=MODULE)
    kw["kv_transfer_config"]["kv_connector"] = NAME
    return kw


def server_args(extra: dict, unaudited: bool = False) -> list[str]:
    """``vllm serve`` arguments of an engine with this connector (``unaudited``: as above)."""
    import json

    from vllm_dhisparse.engine_args import class_args, transfer_config
    if not unaudited:
        from vllm_dhisparse.engine_args import server_args as package_args
        return package_args(extra)
    ktc = dict(transfer_config(extra, kv_connector_module_path=MODULE), kv_connector=NAME)
    return ["--kv-transfer-config", json.dumps(ktc), *class_args()]
