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


def test_cli_arguments():
    from vllm_dhisparse.ray_pd import parse_args
    args, kw = parse_args(["/m", "--model-id", "demo", "--decode-replicas", "2",
                           "--decode-max-replicas", "4", "--prefill-resource", "prefill_node",
                           "--decode-config", '{"hot_cache_rows": 512}', "--gpus", "1",
                           "--engine-kwargs", '{"max_model_len": 4096}',
                           "--failure-policy", "recompute", "--port", "8100"])
    assert (args.model, args.port, args.address) == ("/m", 8100, None)
    assert kw["model_id"] == "demo" and kw["failure_policy"] == "recompute"
    assert kw["engine_kwargs"] == {"max_model_len": 4096}
    assert kw["decode"].autoscaling == {"min_replicas": 2, "max_replicas": 4}
    assert kw["decode"].connector == {"hot_cache_rows": 512} and kw["decode"].gpus == 1
    assert kw["prefill"].node_resource == "prefill_node" and kw["prefill"].autoscaling is None
    p, d = pd_llm_configs(args.model, **kw)  # the configs build
    assert d.deployment_config["autoscaling_config"]["max_replicas"] == 4


def test_local_cluster_has_room_for_every_replica():
    from vllm_dhisparse.ray_pd import local_cpus, parse_args
    args, kw = parse_args(["/m", "--decode-replicas", "2", "--decode-max-replicas", "3"])
    assert local_cpus(args, kw) >= 3 + 2 * 1 + 3 * 2  # Serve + prefill 1 x 2 + decode 3 x 2
    args, kw = parse_args(["/m", "--num-cpus", "5"])
    assert local_cpus(args, kw) == 5
