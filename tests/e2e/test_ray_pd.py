"""P/D through Ray Serve LLM's app (``build_pd_app``) on a local Ray cluster.

One prefill and two decode replicas of the demo model behind Ray's OpenAI
ingress on 127.0.0.1 (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``: every node
reports 127.0.0.1); each role pinned by a custom node resource.  Compared with
resident serving (connector off, offline): requests one at a time (equal batch
composition) for logprobs, concurrent ones for tokens and for both decode
replicas receiving handoffs.
"""
import glob
import json
import os
import socket
from concurrent.futures import ThreadPoolExecutor
import time
import urllib.request

import pytest

from .conftest import run_offline

ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "1", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
       "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
# Ray reads its node address when it is imported: loopback only (every node 127.0.0.1)
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
pytest.importorskip("ray.serve.llm", reason="Ray P/D needs ray[serve]==2.60.0")

pytestmark = pytest.mark.e2e

LENS = [900, 2000]
MAX_TOKENS = 6
# three engines on one host: a small KV share each (on CPU the fraction is of RAM)
ENGINE = dict(enforce_eager=True, block_size=256, max_model_len=8192, max_num_seqs=8, seed=0,
              gpu_memory_utilization=0.08)


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


@pytest.fixture(scope="module")
def pd_app(demo_model, resident, tmp_path_factory):
    os.environ.update(ENV)  # before Ray starts: its nodes and workers inherit it
    import ray
    from ray import serve

    from vllm_dhisparse.ray_pd import RoleConfig, build_pd_app
    tmp = tmp_path_factory.mktemp("ray_pd")
    stats = str(tmp / "decode_stats_{pid}.json")  # one file per decode replica
    # logical CPUs: each role's bundle, Serve's controller, proxy and ingress
    ray.init(num_cpus=8, include_dashboard=False, resources={"prefill_node": 1, "decode_node": 1},
             runtime_env={"env_vars": ENV})
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    app = build_pd_app(
        demo_model, model_id="demo", engine_kwargs=ENGINE,
        prefill=RoleConfig(node_resource="prefill_node", env=ENV),
        decode=RoleConfig(replicas=2, node_resource="decode_node", env=ENV,
                          connector={"hot_cache_rows": 512, "optional_residency": False,
                                     "stats_file": stats}))
    t0 = time.time()
    serve.run(app, blocking=False)
    while (st := serve.status().applications.get("default")) is None or st.status != "RUNNING":
        assert time.time() - t0 < 600, f"P/D app not RUNNING after 600 s: {st}"
        assert st is None or st.status not in ("DEPLOY_FAILED", "UNHEALTHY"), st
        time.sleep(3)
    yield dict(url=f"http://127.0.0.1:{port}/v1/completions", ray=ray, start_s=time.time() - t0,
               stats=lambda: [json.load(open(f)) for f in
                              sorted(glob.glob(stats.replace("{pid}", "*")))])
    serve.shutdown()
    ray.shutdown()


def complete(url: str, i: int) -> dict:
    from vllm_dhisparse.tools.offline_run import prompt_ids
    r = post(url, dict(model="demo", prompt=prompt_ids(LENS[i], i), max_tokens=MAX_TOKENS,
                       temperature=0.0, logprobs=1, return_token_ids=True))
    return r["choices"][0]


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
        choice = complete(pd_app["url"], i)
        w = want["outputs"][i]
        assert choice["token_ids"] == w["token_ids"], f"prompt {i}: tokens differ from resident"
        got_lp = choice["logprobs"]["token_logprobs"]
        # the first logprob comes from the recomputed last prompt token (test_pd_handoff.py)
        assert got_lp[1:] == pytest.approx(w["logprobs"][1:], abs=1e-6), f"prompt {i}"
        assert abs(got_lp[0] - w["logprobs"][0]) < 1e-3, f"prompt {i}"
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
    """Each replica's placement group holds its role's custom resource."""
    groups = [g for g in pd_app["ray"].util.placement_group_table().values()
              if g["state"] == "CREATED"]
    held = sorted(k for g in groups for b in g["bundles"].values() for k in b
                  if k.endswith("_node"))
    assert held == ["decode_node", "decode_node", "prefill_node"], groups
