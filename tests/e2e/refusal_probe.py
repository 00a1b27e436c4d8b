"""Builds vLLM's real engine config for the demo model and constructs the connector with
each start-up mistake; prints one JSON line ``{case: error}``.  Run by
test_startup_refusals.py in its own process (vLLM keeps global state)."""
import json
import math
import sys
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.engine.arg_utils import EngineArgs

from vllm_dhisparse import engine_args
from vllm_dhisparse.integration.connector import DHiSparseConnector


class OtherPlatform:
    """The real platform, except that it says it is an Ampere GPU (CUDA SM80: the
    connector must refuse)."""
    device_name = "cuda"

    def __init__(self, real):
        self._real = real

    def is_cpu(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True

    def get_device_capability(self, device_id: int = 0):
        from vllm.platforms.interface import DeviceCapability
        return DeviceCapability(8, 0)

    def __getattr__(self, name):
        return getattr(self._real, name)


def vllm_config(model: str, **engine):
    return EngineArgs(model=model, enforce_eager=True, block_size=256, max_model_len=4096,
                      **engine).create_engine_config()


def engine_config(model: str, extra: dict, classes: bool = True):
    kw = engine_args(extra)
    if not classes:
        del kw["scheduler_cls"], kw["worker_cls"]
    return vllm_config(model, **kw)


def resident_refusal(model: str, **engine) -> str:
    """What vLLM says to a resident engine (no connector) with our plugin loaded."""
    try:
        vllm_config(model, **engine)
    except ValueError as e:
        return str(e)
    return "accepted"


def refusal(model: str, extra: dict, classes: bool = True) -> str:
    try:
        DHiSparseConnector(engine_config(model, extra, classes), KVConnectorRole.SCHEDULER)
    except (ValueError, RuntimeError) as e:
        return str(e)
    return "accepted"


def main(model: str, model_without_indexer: str) -> None:
    out = {"nan": refusal(model, {"host_pool_gib": math.nan}),
           "inf": refusal(model, {"device_window_tokens": 512, "host_pool_gib": math.inf}),
           "no_indexer": refusal(model_without_indexer, {}),
           "accepted": refusal(model, {}),
           "no_classes": refusal(model, {}, classes=False),
           # a step budget that never holds a 4096-token prompt: refused, not left waiting
           "step_budget": resident_refusal(model, enable_chunked_prefill=False,
                                           max_num_scheduled_tokens=1024)}
    import vllm.platforms as platforms
    real = platforms.current_platform
    platforms._current_platform = OtherPlatform(real)
    try:
        out["platform"] = refusal(model, {})
    finally:
        platforms._current_platform = real
    print("REFUSALS " + json.dumps(out))


if __name__ == "__main__":
    main(*sys.argv[1:3])
