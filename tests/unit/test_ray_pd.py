"""ray_pd: the two LLMConfigs Ray Serve LLM's P/D app gets (no cluster started)."""
import pytest

pytest.importorskip("ray.serve.llm", reason="Ray P/D needs ray[serve]==2.60.0")

from vllm_dhisparse.ray_pd import RoleConfig, pd_llm_configs  # noqa: E402


def kv(cfg):
    return cfg.engine_kwargs["kv_transfer_config"]


def test_roles_resources_and_defaults():
    p, d = pd_llm_configs(
        "/models/m", model_id="m", engine_kwargs={"max_model_len": 8192},
        prefill=RoleConfig(replicas=2, node_resource="prefill_node"),
        decode=RoleConfig(autoscaling={"min_replicas": 1, "max_replicas": 3}, gpus=2,
                          node_resource="decode_node", connector={"hot_cache_rows": 512}),
        failure_policy="recompute")
    assert (kv(p)["kv_role"], kv(d)["kv_role"]) == ("kv_producer", "kv_consumer")
    assert kv(p)["kv_connector"] == kv(d)["kv_connector"] == "DHiSparseConnector"
    assert kv(p)["kv_connector_extra_config"] == {"handoff_port": 0}  # a free port per replica
    assert kv(d)["kv_connector_extra_config"] == {"hot_cache_rows": 512}
    assert kv(d)["kv_load_failure_policy"] == "recompute"
    assert d.engine_kwargs["enable_prefix_caching"] is False
    assert "enable_prefix_caching" not in p.engine_kwargs
    assert d.engine_kwargs["tensor_parallel_size"] == 2
    assert p.placement_group_config["bundles"] == [{"CPU": 1.0, "prefill_node": 0.01}]
    assert d.placement_group_config["bundles"] == [
        {"GPU": 1, "CPU": 1.0, "decode_node": 0.01}, {"GPU": 1}]
    assert p.deployment_config["num_replicas"] == 2
    assert d.deployment_config["autoscaling_config"]["max_replicas"] == 3
    assert p.model_id == d.model_id == "m"


def test_bad_input_fails_before_any_replica_starts():
    with pytest.raises(ValueError, match="valid keys"):
        pd_llm_configs("/m", decode=RoleConfig(connector={"hot_cache_row": 1}))
    with pytest.raises(ValueError, match="replicas"):
        RoleConfig(replicas=0)
