"""The connector as the GPU measurements run it (gpu_connector.py, gpu_capacity.py).

DHiSparseConnector serves CUDA eagerly and refuses CUDA graphs until the in-engine audit
of their replays has run (the package's ``integration/support.py`` says why).  This
subclass, outside the package and its config, lets CUDA graphs through so that the
scripts can measure and audit them; every other refusal (speculative decoding, P/D roles,
several GPUs, other GPUs) still applies.
Engines name it with ``kv_connector_module_path="gpu_measure"`` (scripts/ on PYTHONPATH).
"""
from vllm_dhisparse.integration.connector import DHiSparseConnector

MODULE, NAME = "gpu_measure", "MeasuredConnector"


class MeasuredConnector(DHiSparseConnector):
    measures_unaudited = True


def engine_args(extra: dict, eager: bool = False) -> dict:
    """``vllm.LLM`` keyword arguments of an engine with this connector; ``eager``: the
    package's own class (eager CUDA is what it serves)."""
    from vllm_dhisparse.engine_args import engine_args as package_args
    if eager:
        return package_args(extra)
    kw = package_args(extra, kv_connector_module_path=MODULE)
    kw["kv_transfer_config"]["kv_connector"] = NAME
    return kw


def server_args(extra: dict, eager: bool = False) -> list[str]:
    """``vllm serve`` arguments of an engine with this connector (``eager``: as above)."""
    import json

    from vllm_dhisparse.engine_args import class_args, transfer_config
    if eager:
        from vllm_dhisparse.engine_args import server_args as package_args
        return package_args(extra)
    ktc = dict(transfer_config(extra, kv_connector_module_path=MODULE), kv_connector=NAME)
    return ["--kv-transfer-config", json.dumps(ktc), *class_args()]
