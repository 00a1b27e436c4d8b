"""P/D through Ray Serve LLM's app (``build_pd_app``) on a simulated three-node cluster.

One prefill and two decode replicas of the demo model behind Ray's OpenAI
ingress on 127.0.0.1; ``ray.cluster_utils.Cluster`` starts a head node and one
node per role, each role's node with its custom resource, all on this machine
(``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: every node reports 127.0.0.1).
Compared with resident serving (connector off, offline): requests one at a
time (equal batch composition) for logprobs, concurrent ones for tokens and for
both decode replicas receiving handoffs.  The fault tests come last (they kill
replicas of the shared app): a decode replica killed mid-stream, then the
prefill replica killed mid-prefill.
"""
import glob
import json
import os
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from .conftest import run_offline
from .ray_replicas import (Stream, cpu_seconds, kill_replica, pid_of, replica_actors,
                           replica_of, stream_completion, wait_for)

ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# Ray reads its node address when it is imported: loopback only (every node 127.0.0.1)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
pytest.importorskip("ray.serve.llm", reason="Ray P/D needs ray[serve]==2.60.0")

pytestmark = pytest.mark.e2e

LENS = [900, 2000]
MAX_TOKENS = 6
# three engines on one host: 1 GiB of KV memory each, in bytes (on CPU a fraction is of
# RAM less the worker's resident memory, which varies by machine)
ENGINE = dict(enforce_eager=True, block_size=256, max_model_len=8192, max_num_seqs=8, seed=0,
              kv_cache_memory_bytes=2**30)
# short enough for the fault test to watch an orphaned handoff expire, far longer than a
# decode replica takes to pull what it asked for
LEASE_S = 20.0
LONG_STREAM = 4000  # tokens: still streaming when its replica is killed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def resident(demo_model):
    """Before the Ray engines start (each holds a share of RAM)."""
    return run_offline(demo_model, "--prompt-lens", *map(str, LENS), "--max-tokens",
                       str(MAX_TOKENS), env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1",
                                             "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})


def read_stats(pattern: str) -> dict[int, dict]:
    """Engine process id -> its connector stats (one ``stats_file`` per engine)."""
    return {pid_of(f): json.load(open(f)) for f in sorted(glob.glob(pattern.replace("{pid}", "*")))}


@pytest.fixture(scope="module")
def pd_app(demo_model, resident, tmp_path_factory):
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)  # before Ray starts: its nodes and workers inherit it
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from vllm_dhisparse.ray_pd import RoleConfig, build_pd_app
    tmp = tmp_path_factory.mktemp("ray_pd")
    decode_stats = str(tmp / "decode_stats_{pid}.json")  # one file per replica's engine
    prefill_stats = str(tmp / "prefill_stats_{pid}.json")
    # logical CPUs: a replica reserves its bundle and one for its actor; the head has room
    # for replicas too, so only the role resources keep them off it; a replacement replica
    # fits next to the one it replaces
    cluster = Cluster(initialize_head=True,
                      head_node_args=dict(num_cpus=4, include_dashboard=False))
    nodes = {"head": cluster.head_node.node_id,
             "prefill_node": cluster.add_node(num_cpus=4, resources={"prefill_node": 1}).node_id,
             "decode_node": cluster.add_node(num_cpus=6, resources={"decode_node": 1}).node_id}
    ray.init(address=cluster.address, runtime_env={"env_vars": ENV})
    port = free_port()
    # one HTTP proxy: every node is this host, their proxies would share the port
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    app = build_pd_app(
        demo_model, model_id="demo", engine_kwargs=ENGINE,
        prefill=RoleConfig(node_resource="prefill_node", env=ENV,
                           connector={"handoff_lease_s": LEASE_S, "stats_file": prefill_stats}),
        decode=RoleConfig(replicas=2, node_resource="decode_node", env=ENV,
                          connector={"hot_cache_rows": 512, "optional_residency": False,
                                     "stats_file": decode_stats}))
    t0 = time.time()
    try:
        serve.run(app, blocking=False)
        while (st := serve.status().applications.get("default")) is None or st.status != "RUNNING":
            assert time.time() - t0 < 600, f"P/D app not RUNNING after 600 s: {st}"
            assert st is None or st.status not in ("DEPLOY_FAILED", "UNHEALTHY"), st
            time.sleep(3)
        yield dict(url=f"http://127.0.0.1:{port}/v1/completions", ray=ray, serve=serve,
                   nodes=nodes, start_s=time.time() - t0,
                   decode=lambda: read_stats(decode_stats),
                   prefill=lambda: read_stats(prefill_stats),
                   stats=lambda: list(read_stats(decode_stats).values()))
    finally:
        # a Serve handle's router thread that calls Ray after ray.shutdown() would connect
        # this driver again, and the cluster then refuses to remove its head node
        from ray._private import auto_init_hook
        auto_connect = auto_init_hook.enable_auto_connect
        auto_init_hook.enable_auto_connect = False
        try:
            serve.shutdown()
        finally:
            try:
                ray.shutdown()
            finally:
                cluster.shutdown()
                auto_init_hook.enable_auto_connect = auto_connect
                for k, v in saved.items():  # later modules run with their own threads
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v


def body(i: int, max_tokens: int = MAX_TOKENS, n: int | None = None) -> dict:
    from harness.offline_run import prompt_ids
    return dict(model="demo", prompt=prompt_ids(n or LENS[i], i), max_tokens=max_tokens,
                temperature=0.0, logprobs=1, return_token_ids=True)


def complete(url: str, i: int) -> dict:
    return post(url, body(i))["choices"][0]


def assert_matches_resident(choice: dict, want: dict, i: int) -> None:
    assert choice["token_ids"] == want["token_ids"], f"prompt {i}: tokens differ from resident"
    got_lp = choice["logprobs"]["token_logprobs"]
    # the first logprob comes from the recomputed last prompt token (test_pd_handoff.py)
    assert got_lp[1:] == pytest.approx(want["logprobs"][1:], abs=1e-6), f"prompt {i}"
    assert abs(got_lp[0] - want["logprobs"][0]) < 1e-3, f"prompt {i}"


def totals(pd_app) -> tuple[dict, dict]:
    """Summed over decode replicas: (handoff counters, hierarchy totals)."""
    handoff, tot = {}, {}
    for s in pd_app["stats"]():
        for k, v in s["handoff"].items():
            handoff[k] = handoff.get(k, 0) + v
        for k in ("prompt_tokens_computed", "host"):
            tot[k] = tot.get(k, 0) + s["totals"][k]
    return handoff, tot


def test_ray_pd_matches_resident(pd_app, resident):
    want = resident
    before, before_tot = totals(pd_app)
    for i, n in enumerate(LENS):
        assert_matches_resident(complete(pd_app["url"], i), want["outputs"][i], i)
    # the decode replicas loaded every prompt and ran one prompt token per request
    h, t = totals(pd_app)
    assert h["received"] - before.get("received", 0) == len(LENS), h
    assert h["failed"] == 0, h
    assert h["tokens_loaded"] - before.get("tokens_loaded", 0) == sum(LENS), h
    assert t["prompt_tokens_computed"] - before_tot.get("prompt_tokens_computed", 0) == \
        len(LENS), t
    assert t["host"] > 0, t


def test_both_decode_replicas_receive_handoffs(pd_app, resident):
    """Concurrent requests spread over the two decode replicas (Ray routes to the shorter
    queue of two); tokens equal resident serving (logprobs: other batches)."""
    idx = [0, 1] * 4
    with ThreadPoolExecutor(len(idx)) as pool:
        got = list(pool.map(lambda i: complete(pd_app["url"], i), idx))
    for i, choice in zip(idx, got):
        assert choice["token_ids"] == resident["outputs"][i]["token_ids"], f"prompt {i}"
    per_replica = [s["handoff"]["received"] for s in pd_app["stats"]()]
    assert len(per_replica) == 2 and min(per_replica) > 0, per_replica
    assert sum(s["handoff"]["failed"] for s in pd_app["stats"]()) == 0


def test_roles_land_on_their_nodes_resources(pd_app):
    """Each replica runs on a node that has its role's resource (the head, with room for
    replicas, has neither), and its placement group (its engine's CPUs) holds that
    resource on the same node."""
    ray, nodes = pd_app["ray"], pd_app["nodes"]
    for role, resource, count in (("Prefill", "prefill_node", 1), ("Decode", "decode_node", 2)):
        where = [a["node"] for a in replica_actors(ray, role)]
        assert where == [nodes[resource]] * count, (role, where, nodes)
    groups = [g for g in ray.util.placement_group_table().values() if g["state"] == "CREATED"]
    held = []
    for g in groups:
        for i, bundle in g["bundles"].items():
            for key in bundle:
                if key.endswith("_node"):
                    held.append(key)
                    assert g["bundles_to_node_id"][i] == nodes[key], (key, g, nodes)
    assert sorted(held) == ["decode_node", "decode_node", "prefill_node"], groups


def orphan_handoff(pd_app) -> dict:
    """A prefill answered for a decode server that never pulls its handoff: what a decode
    replica killed between its prefill call and its load leaves on the producer."""
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest
    from ray.llm._internal.serve.engines.vllm.kv_transfer.base import (
        base_prefill_kv_transfer_params)
    prefill = pd_app["serve"].get_deployment_handle("Prefill:demo", app_name="default")
    req = CompletionRequest(**{**body(0, max_tokens=1, n=700), "return_token_ids": False},
                            kv_transfer_params=base_prefill_kv_transfer_params())
    params = prefill.prewarm_prefill.remote(req).result(timeout_s=120)
    assert params and params["dhisparse"]["handoff_id"], params
    return params


def test_decode_replica_killed_mid_stream(pd_app, resident):
    """A decode replica dies while it streams: its stream breaks off, the stream on the
    other replica finishes with resident serving's tokens, new requests are served, and
    the handoff orphaned on the producer is freed when its lease runs out."""
    ray, url = pd_app["ray"], pd_app["url"]
    orphan = orphan_handoff(pd_app)
    t_orphan = time.time()  # the lease started at capture, before this
    [(prefill_pid, p)] = pd_app["prefill"]().items()
    assert p["handoff"]["held"] >= 1, p["handoff"]

    def start(i: int, max_tokens: int) -> tuple[Stream, threading.Thread, int]:
        """A stream, and the decode engine that received its handoff."""
        before = {pid: s["handoff"]["received"] for pid, s in pd_app["decode"]().items()}
        s = Stream()
        t = threading.Thread(target=stream_completion, args=(url, body(i, max_tokens), s),
                             daemon=True)
        t.start()
        wait_for(lambda: s.chunks or s.ended_at, 120, f"first chunk of stream {i}")
        grew = [pid for pid, st in pd_app["decode"]().items()
                if st["handoff"]["received"] > before.get(pid, 0)]
        assert len(grew) == 1 and s.error is None, (grew, s)
        return s, t, grew[0]

    # Ray routes a request to the replica with the shorter queue of two: the second
    # stream goes to the other replica
    victim, victim_thread, victim_pid = start(1, LONG_STREAM)
    other, other_thread, other_pid = start(0, 48)
    assert other_pid != victim_pid, "both streams on one decode replica"
    actor = replica_of(ray, "Decode", victim_pid)
    kill_replica(ray, actor, victim_pid)
    for t in (victim_thread, other_thread):
        t.join(timeout=180)
        assert not t.is_alive(), "a stream did not end within 180 s"
    assert not victim.done and victim.finish_reason is None, victim
    assert 0 < len(victim.token_ids) < LONG_STREAM, victim
    assert other.done and other.finish_reason == "length" and len(other.token_ids) == 48, other
    assert other.token_ids[:MAX_TOKENS] == resident["outputs"][0]["token_ids"]

    for i in range(len(LENS)):
        assert_matches_resident(complete(url, i), resident["outputs"][i], i)
    # the lease frees the orphan on the side channel's thread; the next prefill step
    # writes the producer's counters
    time.sleep(max(0.0, t_orphan + LEASE_S + 1 - time.time()))
    assert_matches_resident(complete(url, 0), resident["outputs"][0], 0)
    h = pd_app["prefill"]()[prefill_pid]["handoff"]
    # the orphan is never pulled: only its lease counts it; what may still be held is that
    # last request's handoff, captured in the step that wrote the counters
    assert h["expired"] >= 1 and h["held"] <= 1, (orphan["dhisparse"], h)
    assert h["captured"] == h["sent"] + h["expired"] + h["held"], h


def test_prefill_replica_killed_mid_prefill(pd_app):
    """The prefill replica dies while it computes a prompt: the request gets an error
    within a bound, nothing waits for the dead replica."""
    ray = pd_app["ray"]
    if not pd_app["prefill"]():  # its stats file appears after its first step
        complete(pd_app["url"], 0)
    [prefill_pid] = pd_app["prefill"]()
    actor = replica_of(ray, "Prefill", prefill_pid)
    cpu0 = cpu_seconds(prefill_pid)
    result: dict = {}

    def ask():
        try:
            result["answer"] = post(pd_app["url"], body(0, n=8000))
        except urllib.error.HTTPError as e:
            result["status"], result["error"] = e.code, e.read()[:1000]
        except Exception as e:  # noqa: BLE001 -- any end is an outcome to check
            result["error"] = f"{type(e).__name__}: {e}"

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    # the engine burns CPU only while it computes: the prompt's prefill has started
    wait_for(lambda: cpu_seconds(prefill_pid) - cpu0 > 0.5, 120, "prefill engine computing")
    assert t.is_alive(), f"the prefill ended before the kill: {result}"
    kill_replica(ray, actor, prefill_pid)
    t.join(timeout=120)
    assert not t.is_alive(), "request still waiting 120 s after the prefill replica died"
    assert "answer" not in result and result.get("error"), result
