"""Every place the package meets vLLM applies, or stops start-up naming vLLM's version and
the missing piece: for each extension point and each compat shim, its vLLM target is
removed or re-signed here, and the start-up check (``require``, which the connector's
constructor runs in every process, or the shim's own apply) must say so."""
from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")

from vllm_dhisparse.compat.targets import IntegrationError, expect, vllm_version  # noqa: E402
from vllm_dhisparse.engine_args import SCHEDULER_CLS, WORKER_CLS  # noqa: E402
from vllm_dhisparse.integration import extension_points as EP  # noqa: E402

VERSION = re.escape(vllm_version())


def config(scheduler=SCHEDULER_CLS, worker=WORKER_CLS):
    return SimpleNamespace(scheduler_config=SimpleNamespace(scheduler_cls=scheduler),
                           parallel_config=SimpleNamespace(worker_cls=worker))


@pytest.fixture
def fresh(monkeypatch):
    """A process in which the plugin has not run yet."""
    monkeypatch.setattr(EP, "_FAILURES", {})
    monkeypatch.setattr(EP, "_APPLIED", False)


def test_everything_applies_with_this_vllm(fresh):
    EP.require(config())
    assert EP._FAILURES == {}


def test_the_qualnames_name_the_classes():
    from vllm.model_executor.models import ModelRegistry

    from vllm_dhisparse.integration.engine_core import scheduler
    from vllm_dhisparse.integration.layers import model
    from vllm_dhisparse.integration.worker import worker
    assert scheduler.QUALNAME == SCHEDULER_CLS and worker.QUALNAME == WORKER_CLS
    assert expect(SCHEDULER_CLS.rpartition(".")[0] + ":DHiSparseScheduler") \
        is scheduler.DHiSparseScheduler
    assert expect(EP.MODEL[1]) is model.DHiSparseDeepseekV4ForCausalLM
    EP.apply_all()
    registered = ModelRegistry.models["DeepseekV4ForCausalLM"]
    assert (registered.module_name, registered.class_name) == tuple(EP.MODEL[1].split(":"))


def _wrong_signature(self, unexpected):
    return None


# (piece named in the error, object to change, attribute, what the error names)
REGISTRATIONS = [
    ("connector", "vllm.distributed.kv_transfer.kv_connector.factory:KVConnectorFactory",
     "register_connector", "register_connector"),
    ("KV cache specs", "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry",
     "_ensure_registered", "_ensure_registered"),
    ("model", "vllm.model_executor.models:ModelRegistry", "register_model", "register_model"),
]


@pytest.mark.parametrize("piece,target,attr,named", REGISTRATIONS)
def test_a_registration_that_cannot_apply_stops_start_up(fresh, monkeypatch, piece, target,
                                                        attr, named):
    obj = expect(target)
    monkeypatch.setattr(obj, attr, None, raising=False)  # gone (not callable any more)
    EP.apply_all()  # the plugin never raises: vLLM without the connector keeps working
    assert piece in EP._FAILURES
    with pytest.raises(RuntimeError, match=rf"(?s)cannot start.*{piece}: .*{named}"):
        EP.require(config())


# (piece, class whose method changes, method)
SIGNATURES = [
    ("KV cache specs", "vllm.v1.core.single_type_kv_cache_manager:FullAttentionManager",
     "remove_skipped_blocks"),
    ("KV cache specs", "vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager",
     "allocate_new_blocks"),
    ("KV cache specs", "vllm.v1.core.single_type_kv_cache_manager:SlidingWindowManager",
     "_has_partial_local_hit"),
    ("scheduler", "vllm.v1.core.sched.scheduler:Scheduler", "finish_requests"),
    ("scheduler", "vllm.v1.core.sched.scheduler:Scheduler", "update_from_output"),
    ("worker", "vllm_dhisparse.integration.worker.worker:_Base", "determine_available_memory"),
    ("worker", "vllm_dhisparse.integration.worker.worker:_Base", "get_kv_cache_spec"),
    ("model", "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention", "forward_mqa"),
    ("model", "vllm.models.deepseek_v4.cpu.cpu_sparse:DeepseekV4CPUAttention",
     "get_kv_cache_spec"),
]


@pytest.mark.parametrize("piece,cls,method", SIGNATURES)
def test_a_vllm_method_with_another_signature_stops_start_up(fresh, monkeypatch, piece, cls,
                                                            method):
    monkeypatch.setattr(expect(cls), method, _wrong_signature)
    with pytest.raises(RuntimeError, match=rf"(?s){piece}: {VERSION}: .*{method}: expected "
                                           r"parameters"):
        EP.require(config())


def test_a_missing_vllm_module_stops_start_up(fresh, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "vllm.v1.core.sched.async_scheduler", None)
    monkeypatch.delitem(sys.modules, "vllm_dhisparse.integration.engine_core.scheduler",
                        raising=False)
    with pytest.raises(RuntimeError, match=r"scheduler: .*cannot load.*async_scheduler"):
        EP.require(config())


@pytest.mark.parametrize("scheduler,worker,needle", [
    (None, WORKER_CLS, r"scheduler_cls is None, needs '.*DHiSparseScheduler' \(--scheduler-cls\)"),
    ("vllm.v1.core.sched.scheduler.Scheduler", WORKER_CLS, r"scheduler_cls is 'vllm\.v1"),
    (SCHEDULER_CLS, "auto", r"worker_cls is 'auto', needs '.*DHiSparseWorker' \(--worker-cls\)"),
    (SCHEDULER_CLS, "vllm.v1.worker.cpu_worker.CPUWorker", r"worker_cls is 'vllm\.v1"),
])
def test_an_engine_without_the_connectors_classes_stops_start_up(fresh, scheduler, worker,
                                                                 needle):
    with pytest.raises(RuntimeError, match=needle):
        EP.require(config(scheduler, worker))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_scheduler_name_builds_the_variant_vllm_schedules_with(monkeypatch, async_scheduling):
    """One name to configure: with async scheduling on, vLLM gets the AsyncScheduler one."""
    from vllm_dhisparse.integration.engine_core import scheduler as S
    built = []
    for cls in (S.DHiSparseScheduler, S.DHiSparseAsyncScheduler):  # no engine here
        monkeypatch.setattr(cls, "__init__", lambda self, *a, **k: built.append(type(self)))
    cfg = SimpleNamespace(scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))
    made = S.DHiSparseScheduler(vllm_config=cfg)
    want = S.DHiSparseAsyncScheduler if async_scheduling else S.DHiSparseScheduler
    assert type(made) is want and built == [want]
    assert issubclass(S.DHiSparseAsyncScheduler,
                      expect("vllm.v1.core.sched.async_scheduler:AsyncScheduler"))
    assert S.is_ours(S.DHiSparseAsyncScheduler) and S.is_ours(S.DHiSparseScheduler)


# -- compat shims: each checks its targets when applied ----------------------------------------
def _apply(name):
    import importlib
    return importlib.import_module(name if "." in name else f"vllm_dhisparse.compat.{name}")


SHIMS = [
    ("tile_scheduler", "vllm.models.deepseek_v4.cpu.cpu_mla:DeepseekV4CPUSparseSWAMetadataBuilder",
     "build_tile_scheduler", lambda m: m.apply()),
    ("eager_kernels", "vllm.v1.worker.utils:KVBlockZeroer", "zero_block_ids",
     lambda m: m.apply()),
    ("cpu_attn_layout", "vllm.v1.attention.backends.cpu_attn:CPUAttentionBackend",
     "supported_kv_cache_layouts", lambda m: m.apply()),
    ("kv_spec_registry", "vllm.v1.kv_cache_spec_registry:KVCacheSpecRegistry", "register",
     lambda m: m.check()),
    ("harness.cpu_scheduling", "vllm.platforms.cpu:CpuPlatform", "check_and_update_config",
     lambda m: m.force(True, 0)),
    ("spec_step_budget", "vllm.platforms.cpu:CpuPlatform", "check_and_update_config",
     lambda m: m.apply()),
    ("spec_step_budget", "vllm.config.vllm:VllmConfig", "_set_max_num_scheduled_tokens",
     lambda m: m.apply()),
    ("omp_reserved_cores", "vllm.utils.ompmultiprocessing:OMPProcessManager", "__init__",
     lambda m: m.apply(lambda ktc: True)),
]


@pytest.mark.parametrize("shim,target,attr,apply", SHIMS, ids=[f"{s[0]}-{s[2]}" for s in SHIMS])
def test_a_shim_whose_target_moved_says_so(monkeypatch, shim, target, attr, apply):
    monkeypatch.setattr(expect(target), attr, None)
    with pytest.raises(IntegrationError, match=rf"{VERSION}: .*{attr}"):
        apply(_apply(shim))


def test_a_shim_whose_module_attribute_moved_says_so(monkeypatch):
    sparse_swa = expect("vllm.v1.attention.backends.mla.sparse_swa:")
    monkeypatch.delattr(sparse_swa, "_COMPUTE_SWA_INDICES_AND_LENS_KERNEL")
    with pytest.raises(IntegrationError, match=r"has no attribute "
                                               r"'_COMPUTE_SWA_INDICES_AND_LENS_KERNEL'"):
        _apply("eager_kernels").apply()
