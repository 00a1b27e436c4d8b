"""examples/: each way the project is used, run as a user runs it.

* ``offline.py`` (vLLM's Python API): with the connector it completes exactly as without
  it (tokens and logprobs), and rows came from host;
* ``ray_pd.sh``: the command it runs builds Ray Serve LLM's two role configs (the app
  itself runs in ``test_ray_pd.py``; here a stand-in ``vllm-dhisparse`` records the
  arguments, so no cluster starts);
* ``serve.sh`` and ``metrics.sh`` start the server and Prometheus of
  ``test_metrics.py``; every shell example parses.
"""
import json
import os
import stat
import subprocess
import sys

import pytest

from .conftest import INPROC, REPO

pytestmark = pytest.mark.e2e

EXAMPLES = os.path.join(REPO, "examples")
HIER = {"hot_cache_rows": 512, "optional_residency": False}  # small: host fetches


def run_example(*args: str, env: dict | None = None) -> dict:
    """The example's last line (its JSON result)."""
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "offline.py"), *args],
                          capture_output=True, text=True, timeout=900, cwd=REPO,
                          env={**os.environ, **(env or {})})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and lines, f"rc={proc.returncode}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


def test_offline_example_is_resident_serving(demo_model):
    # the engine core in the example's process, which halves a run's time on two cores
    # (conftest.INPROC); both arms reserve the same cores (compat/omp_reserved_cores.py)
    env = dict(INPROC)
    got = run_example(demo_model, "--max-tokens", "8", "--extra", json.dumps(HIER), env=env)
    want = run_example(demo_model, "--max-tokens", "8", "--no-connector", env=env)
    assert got["token_ids"] == want["token_ids"] and got["logprobs"] == want["logprobs"], \
        (got, want)
    assert got["rows"]["host"] > 0 and "rows" not in want, got


def test_ray_pd_example_builds_the_pd_app_configs(tmp_path):
    pytest.importorskip("ray.serve.llm", reason="Ray P/D needs ray[serve]==2.60.0")
    from vllm_dhisparse.ray_pd import parse_args, pd_llm_configs
    fake = tmp_path / "vllm-dhisparse"
    fake.write_text(f'#!/bin/sh\nshift\n{sys.executable} -c "import json, sys; '
                    f'print(json.dumps(sys.argv[1:]))" "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "MODEL": "/m",
           "DECODE_REPLICAS": "2", "DECODE_RESOURCE": "decode_node",
           "DECODE_CONFIG": json.dumps(HIER)}
    env.pop("ADDRESS", None)
    out = subprocess.run(["bash", os.path.join(EXAMPLES, "ray_pd.sh"), "--cpus", "2"],
                         capture_output=True, text=True, env=env, timeout=60, check=True)
    args, kw = parse_args(json.loads(out.stdout))
    assert (args.model, args.host, args.address) == ("/m", "127.0.0.1", None)
    assert kw["decode"].replicas == 2 and kw["decode"].node_resource == "decode_node"
    assert kw["decode"].connector == HIER and kw["decode"].cpus == 2
    prefill, decode = pd_llm_configs(args.model, **kw)
    assert decode.deployment_config["num_replicas"] == 2


@pytest.mark.parametrize("script", ["serve.sh", "metrics.sh", "ray_pd.sh"])
def test_shell_examples_parse_and_ask_for_what_they_need(script):
    path = os.path.join(EXAMPLES, script)
    subprocess.run(["bash", "-n", path], check=True)
    if script != "metrics.sh":  # the others need a model
        env = {k: v for k, v in os.environ.items() if k != "MODEL"}
        proc = subprocess.run(["bash", path], capture_output=True, text=True, env=env,
                              timeout=60)
        assert proc.returncode != 0 and "MODEL" in proc.stderr, proc.stderr
