"""Device bytes the hierarchy allocates, with per-request staging vs shared staging arenas.

    git archive BEFORE vllm_dhisparse | tar -x -C /tmp/before    # a tree without arenas
    python benchmarks/staging_memory.py --model demo_model --before-tree /tmp/before

For the demo model's sparse layers (read from its config.json) and three engine
configurations -- ``make demo`` (no speculation, default hot cache), ``make demo
DEMO_ARGS="--spec dflash2"`` (K = 3) and the speculative E2E test's (hot cache 512,
K = 3) -- builds the pools exactly as the worker does (``pool_sizing.plan_sources``,
then ``KVHierarchy``) and sums the bytes of the device tensors the hierarchy
allocated.  Each tree runs in its own process (``--before-tree`` is put first on
the import path there).  Memory is counted, not timed: the numbers do not depend
on the machine.  Results: ``results/staging_memory.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
# (name, kv_connector_extra_config, max_queries = 1 + speculative tokens)
CONFIGS = [("demo", {}, 1), ("demo --spec dflash2", {}, 4),
           ("spec E2E (tests/e2e/test_spec_hierarchy.py)",
            {"hot_cache_rows": 512, "optional_residency": False}, 4)]
MAX_MODEL_LEN, MAX_NUM_SEQS = 8192, 8  # offline_run's and the demo server's defaults


def measure(model: str) -> list[dict]:
    """In this process's tree: allocated device bytes per configuration."""
    import vllm_dhisparse
    from vllm_dhisparse.config import DHiSparseConfig
    from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
    from vllm_dhisparse.integration.worker import pool_sizing as P
    from vllm_dhisparse.integration.layers.model_probe import (FP8_DS_MLA_PLANE_BYTES,
                                                               FP8_DS_MLA_ROW_BYTES)

    cfg_json = json.loads((Path(model) / "config.json").read_text())
    block = 256  # DeepSeek-V4's block size on vLLM
    layers = [P.LayerShape(f"layers.{i}", r, cfg_json["index_topk"], FP8_DS_MLA_ROW_BYTES,
                           block // r, FP8_DS_MLA_PLANE_BYTES)
              for i, r in enumerate(cfg_json["compress_ratios"]) if r == 4]
    out = []
    for name, extra, queries in CONFIGS:
        cfg = DHiSparseConfig.from_extra_config({**extra, "host_pool_gib": 0.05})
        plans = P.plan_sources(cfg, layers, MAX_MODEL_LEN, MAX_NUM_SEQS, queries)
        kw = {}
        if hasattr(P, "plan_staging"):
            kw["staging"] = P.plan_staging(cfg, plans)
        h = KVHierarchy([p.spec for p in plans], device="cpu", **kw)
        storages = {id(p.pool.storage): p.pool.storage for p in h.sources.values()}
        out.append(dict(config=name, tree=os.path.dirname(os.path.dirname(vllm_dhisparse.__file__)),
                        sparse_layers=len(layers), max_num_seqs=MAX_NUM_SEQS,
                        k_max=queries, device_bytes=sum(t.numel() for t in storages.values()),
                        required_pages_per_request=plans[0].floor_pages // MAX_NUM_SEQS))
    return out


def run_tree(tree: str | None, model: str) -> list[dict]:
    env = dict(os.environ)
    if tree:
        env["PYTHONPATH"] = os.pathsep.join([tree, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, __file__, "--model", model, "--measure"],
                          capture_output=True, text=True, env=env, cwd=tree or REPO)
    if proc.returncode:
        raise SystemExit(proc.stderr[-4000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the demo model directory")
    ap.add_argument("--before-tree", help="a vllm_dhisparse tree without staging arenas")
    ap.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(args.model)))
        return 0
    after = run_tree(None, args.model)
    before = run_tree(args.before_tree, args.model) if args.before_tree else [{}] * len(after)
    for b, a in zip(before, after):
        line = f"{a['config']}: {a['device_bytes']:,} B with arenas"
        if b:
            line += (f", {b['device_bytes']:,} B with per-request staging: "
                     f"{b['device_bytes'] - a['device_bytes']:,} B less")
        print(line)
    result = dict(before=before if args.before_tree else None, after=after)
    print(json.dumps(result))
    C.write_json("staging_memory", dict(meta=C.metadata(), **result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
