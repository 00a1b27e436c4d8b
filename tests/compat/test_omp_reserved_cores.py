"""compat/omp_reserved_cores.py on vLLM's own OMPProcessManager (this machine's CPUs): the
connector in kv_both reserves the cores a resident engine reserves, so both workers run
their matrix products on the same threads; its P/D roles keep vLLM's extra core, and a
machine that cannot spare it gets a warning naming the fix."""
from types import SimpleNamespace

import pytest
from vllm.utils.ompmultiprocessing import OMPProcessManager

from vllm_dhisparse.compat import omp_reserved_cores


def config(kv_role=None):
    ktc = None if kv_role is None else SimpleNamespace(kv_role=kv_role)
    return SimpleNamespace(kv_transfer_config=ktc, parallel_config=SimpleNamespace(
        local_world_size=1, data_parallel_rank_local=0, _api_process_count=1))


def cores(manager) -> tuple:
    ids = lambda cpus: [getattr(c, "id", c) for c in cpus]  # noqa: E731
    return manager.reserve_cpu_num, [ids(r) for r in manager.cpu_lists], \
        ids(manager.reserved_cpu_list)


@pytest.fixture
def shim(monkeypatch):
    """vLLM's manager with the shim applied afresh (the plugin may have applied it in this
    process already); restored afterwards."""
    monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
    init = OMPProcessManager.__init__
    monkeypatch.setattr(OMPProcessManager, "__init__", getattr(init, "__wrapped__", init))
    warnings = []
    monkeypatch.setattr(omp_reserved_cores.logger, "warning",
                        lambda msg, *a: warnings.append(msg % a))
    omp_reserved_cores.apply(lambda ktc: ktc.kv_role == "kv_both")
    return warnings


def test_kv_both_reserves_what_a_resident_engine_reserves(shim):
    resident = cores(OMPProcessManager(config()))
    assert cores(OMPProcessManager(config("kv_both"))) == resident
    assert not shim


def test_pd_roles_keep_the_transfer_core(shim):
    resident = OMPProcessManager(config())
    producer = OMPProcessManager(config("kv_producer"))
    assert producer.reserve_cpu_num == resident.reserve_cpu_num + 1


def test_a_machine_that_cannot_spare_the_cores_is_told_the_fix(shim, monkeypatch):
    # every CPU of this machine already reserved: what a 2-core machine sees with P/D
    monkeypatch.setattr(OMPProcessManager, "_get_autobind_cpu_ids",
                        lambda self, select: ([[]], []))
    OMPProcessManager(config("kv_consumer"))
    assert len(shim) == 1 and "VLLM_CPU_NUM_OF_RESERVED_CPU=1" in shim[0], shim
    assert "kv_consumer" in shim[0]
    OMPProcessManager(config("kv_both"))
    assert len(shim) == 1, shim  # kv_both reserves no transfer core: nothing to tell
