"""Passkey retrieval of the trained tiny DeepSeek-V4 (``models/needle_v4``), resident serving
against the connector under memory pressure, with the corrupted-mapping control and an
ablation of the indexer's top-k.

    python benchmarks/needle.py --out benchmarks/results/needle --ablation
    python benchmarks/needle.py --smoke --out /tmp/needle    # CI: one 4K prompt per arm

Prompts: vllm_dhisparse/needle.py (a five-digit pass key and three distractor keys in filler
text, the question at the end), ``--per-cell`` prompts for every ``--lengths`` x ``--depths``
cell, each from its own seed.  A prompt is answered when the greedy tokens are the answer's
tokens (the digits and the full stop).

Arms (vLLM on this machine, offline, every prompt of one length submitted at once):

* ``resident``: the connector off;
* ``connector``: ``device_window_tokens`` 512, a hot cache of 2 k rows (k = the indexer's
  top-k), so most of a prompt's compressed history sits on host and residency reclaims
  optional history while the prompts are admitted;
* ``control``: the connector with a corrupted mapping, every resolved location pointed
  half the storage away (tests/fault_injection.py ``scramble``): if the answers did not
  depend on the rows the hierarchy maps, this would not hurt them.  (The E2E tests'
  control, one location per layer call moved to another selected row, changes logprobs
  but not these answers: one row of 512.)

Per cell: the accuracy of each arm, whether the connector's tokens and logprobs equal
resident serving's for every prompt, and, per length (one run), the share of selections
served from host.  ``--ablation`` adds HF transformers' forward (float32, teacher-forced
argmax, CPU) of the same prompts with and without the pass key's compressed entries
removed from the c4a layers' top-k (the c128a layer keeps its dense view), on the first
prompt of every cell.

Writes ``<out>.json`` (device, date, commit, every prompt's answers) and ``<out>.png``
(accuracy heatmaps per arm).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))  # gpu_connector's arm environments (CUDA)
from vllm_dhisparse import needle as needle_data  # noqa: E402

from benchmarks import ledger  # noqa: E402
from benchmarks.common import metadata, new_figure  # noqa: E402

TOP_K = 512
ARMS = {
    "resident": None,
    "connector": {"device_window_tokens": 512, "hot_cache_rows": 2 * TOP_K},
    "control": {"device_window_tokens": 512, "hot_cache_rows": 2 * TOP_K},
}
FAULTY = ["--connector-class", "tests.fault_injection:FaultInjectingConnector"]


def make_prompts(model: str, lengths, depths, per_cell: int, seed: int) -> list[dict]:
    tok = needle_data.tokenizer(model)
    out = []
    for li, length in enumerate(lengths):
        for di, depth in enumerate(depths):
            for i in range(per_cell):
                s = seed + 10_000 * li + 100 * di + i
                p = needle_data.make(tok, length, random.Random(s), depth=depth, distractors=3)
                out.append(dict(length=length, depth=depth, seed=s, ids=p.ids,
                                answer=p.answer, answer_ids=p.answer_ids,
                                needle_token=p.needle_token,
                                needle_len=len(tok.encode(f" The {needle_data.KEY} is "
                                                          f"{p.answer.strip()}").ids)))
    return out


def run_arm(model: str, arm: str, prompts: list[dict], max_num_seqs: int, log: Path) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([p["ids"] for p in prompts], f)
    cmd = [sys.executable, "-m", "harness.offline_run", "--model", model,
           "--prompts-file", f.name, "--max-tokens", str(max(len(p["answer_ids"])
                                                              for p in prompts)),
           "--max-model-len", str(max(len(p["ids"]) for p in prompts) + 64),
           "--max-num-seqs", str(max_num_seqs)]
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if on_cuda():  # vLLM alone for resident, the package's plugin for the connector arms
        from gpu_connector import arm_env
        env = arm_env(ARMS[arm] is not None, in_process=True)
        cmd += ["--gpu-share", "0.15"]  # beside another engine on the GPU
    if ARMS[arm] is not None:
        cmd += ["--connector", json.dumps(ARMS[arm])]
    if arm == "control":
        cmd += FAULTY
        env["DHISPARSE_TEST_FAULTS"] = "scramble"
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    os.unlink(f.name)
    log.write_text(proc.stdout[-20000:] + "\n" + proc.stderr[-60000:])
    for line in proc.stdout.splitlines():
        if line.startswith("DHISPARSE_RESULT "):
            res = json.loads(line[len("DHISPARSE_RESULT "):])
            res["wall_s"] = round(time.time() - t0, 1)
            return res
    raise SystemExit(f"{arm} run failed (rc={proc.returncode}), log: {log}")


def on_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


def equal(per_prompt: dict, arm: str, i: int) -> bool:
    """Prompt i's tokens and logprobs in ``arm`` bit-equal to resident serving's."""
    a, b = per_prompt[arm][i], per_prompt["resident"][i]
    return a["token_ids"] == b["token_ids"] and a["logprobs"] == b["logprobs"]


def answered(out: dict, p: dict) -> bool:
    return out["token_ids"][:len(p["answer_ids"])] == p["answer_ids"]


def ablation(model: str, prompts: list[dict]) -> list[dict]:
    """HF forward of each prompt + answer, the answer's tokens by teacher-forced argmax,
    with and without the pass key's compressed entries masked in the c4a layers."""
    import torch
    from transformers import AutoConfig, DeepseekV4ForCausalLM
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M
    cfg = AutoConfig.from_pretrained(model)
    cfg._attn_implementation = "eager"
    hf = DeepseekV4ForCausalLM.from_pretrained(model, config=cfg, dtype=torch.float32).eval()
    masked: dict = {}

    def hide(module, args, out):
        if not masked:
            return out
        bias = out[1].clone()  # [B, 1, S, T]: 0 where a query may read an entry
        bias[..., masked["first"]:masked["end"]] = float("-inf")
        return (out[0], bias, *out[2:])

    ratios = []
    for layer in hf.model.layers:
        comp = layer.self_attn.compressor
        if isinstance(comp, M.DeepseekV4CSACompressor):
            comp.register_forward_hook(hide)
            ratios.append(4)
    rows = []
    for p in prompts:
        ids = torch.tensor([p["ids"] + p["answer_ids"]])
        n = len(p["answer_ids"])
        got = {}
        for name, hidden in (("full", False), ("ablated", True)):
            masked.clear()
            if hidden:
                masked.update(first=p["needle_token"] // 4,
                              end=(p["needle_token"] + p["needle_len"] + 3) // 4 + 1)
            with torch.no_grad():
                logits = hf(input_ids=ids).logits[0]
            pred = logits[len(p["ids"]) - 1:len(p["ids"]) - 1 + n].argmax(-1).tolist()
            got[name] = pred == p["answer_ids"]
        rows.append(dict(length=p["length"], depth=p["depth"], seed=p["seed"], **got))
        print(f"ablation {p['length']} @ {p['depth']:.2f}: full {got['full']}, "
              f"ablated {got['ablated']}", flush=True)
    return rows


def plot(res: dict, path: str) -> None:
    import numpy as np
    lengths, depths = res["lengths"], res["depths"]
    arms = list(ARMS) + (["ablated (HF)"] if res.get("ablation") else [])
    fig, axes = new_figure(len(arms), "passkey accuracy (trained tiny DeepSeek-V4)",
                           res["meta"])
    for ax, arm in zip(axes, arms):
        grid = np.full((len(lengths), len(depths)), np.nan)
        for c in res["cells"]:
            key = "ablated" if arm.startswith("ablated") else arm
            if key in c["accuracy"]:
                grid[lengths.index(c["length"]), depths.index(c["depth"])] = c["accuracy"][key]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, "-" if np.isnan(v) else f"{v:.2f}", ha="center", va="center",
                    color="w" if not np.isnan(v) and v < 0.6 else "k", fontsize=8)
        ax.set_xticks(range(len(depths)), [f"{d:.1f}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("needle depth")
        ax.set_ylabel("prompt tokens")
        ax.set_title(arm)
    fig.colorbar(im, ax=list(axes), shrink=0.8)
    fig.savefig(path, dpi=120)
    print("wrote", path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(ROOT / "models" / "needle_v4"))
    ap.add_argument("--out", default=None, help="results path without extension")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 6144, 8000])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 0.9])
    ap.add_argument("--per-cell", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--ablation", action="store_true",
                    help="also the HF ablation of the pass key's top-k entries")
    ap.add_argument("--resident2", action="store_true",
                    help="resident again in its own engine: whether vLLM's tokens and logprobs "
                         "are bitwise between two of its own runs (on a GPU they are not)")
    ap.add_argument("--together", action="store_true",
                    help="one engine per arm for the prompts of every length (an engine start "
                         "per arm instead of per arm and length: the GPU run)")
    ap.add_argument("--write-prompts", default=None, metavar="FILE",
                    help="only write the prompts as JSON (for a machine whose Python's "
                         "docstrings, the filler text, differ: the GPU's)")
    ap.add_argument("--prompts", default=None, metavar="FILE",
                    help="the prompts --write-prompts wrote, instead of making them here")
    ap.add_argument("--smoke", action="store_true",
                    help="one 4,096-token prompt (depth 0.5); exit 1 unless resident serving "
                         "answers it, the connector's tokens and logprobs equal resident's and "
                         "the control does not answer")
    args = ap.parse_args(argv)
    if args.smoke:  # its shapes, under any flag given explicitly
        ap.set_defaults(lengths=[4096], depths=[0.5], per_cell=1)
        args = ap.parse_args(argv)
    if args.resident2:
        ARMS["resident2"] = None
    if args.prompts:
        with open(args.prompts) as f:
            prompts = json.load(f)
    else:
        prompts = make_prompts(args.model, args.lengths, args.depths, args.per_cell, args.seed)
    if args.write_prompts:
        with open(args.write_prompts, "w") as f:
            json.dump(prompts, f)
        return 0
    if args.out is None:
        ap.error("--out is required (or --write-prompts)")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = dict(meta=metadata(), model=args.model, lengths=args.lengths, depths=args.depths,
               per_cell=args.per_cell, arms=ARMS, runs={}, cells=[])
    per_prompt = {arm: [None] * len(prompts) for arm in ARMS}
    res["together"] = args.together
    for group in ([args.lengths] if args.together else [[n] for n in args.lengths]):
        idx = [i for i, p in enumerate(prompts) if p["length"] in group]
        tag = "all" if args.together else str(group[0])
        for arm in ARMS:
            r = run_arm(args.model, arm, [prompts[i] for i in idx], args.max_num_seqs,
                        out.parent / f"{out.name}_{arm}_{tag}.log")
            totals = (r.get("stats") or {}).get("totals", {})
            res["runs"][f"{arm}/{tag}"] = dict(
                wall_s=r["wall_s"], max_running=r["max_running"], totals=totals,
                prefix_caching=r["prefix_caching"], chunked_prefill=r["chunked_prefill"])
            for i, o in zip(idx, r["outputs"]):
                per_prompt[arm][i] = o
            print(f"{arm:9s} {tag:>5s}: "
                  f"{sum(answered(per_prompt[arm][i], prompts[i]) for i in idx)}/{len(idx)} "
                  f"answered ({r['wall_s']} s)", flush=True)
    # the first prompt of every cell (HF's eager float32 forward is slow on CPU)
    abl = ablation(args.model, prompts[::args.per_cell]) if args.ablation else []
    res["ablation"] = abl
    for length in args.lengths:
        # with --together, one run served every length: its totals, not this length's
        host = res["runs"][f"connector/{'all' if args.together else length}"]["totals"]
        for depth in args.depths:
            idx = [i for i, p in enumerate(prompts)
                   if p["length"] == length and p["depth"] == depth]
            acc = {arm: sum(answered(per_prompt[arm][i], prompts[i]) for i in idx) / len(idx)
                   for arm in ARMS}
            ab = [a for a in abl if a["length"] == length and a["depth"] == depth]
            if ab:
                acc["hf_full"] = sum(a["full"] for a in ab) / len(ab)
                acc["ablated"] = sum(a["ablated"] for a in ab) / len(ab)
            same = all(equal(per_prompt, "connector", i) for i in idx)
            res["cells"].append(dict(length=length, depth=depth, accuracy=acc,
                                     connector_equals_resident=same,
                                     host_totals_of_length=host))
            if "resident2" in ARMS:
                res["cells"][-1]["resident2_equals_resident"] = all(
                    equal(per_prompt, "resident2", i) for i in idx)
    res["prompts"] = [dict({k: v for k, v in p.items() if k != "ids"},
                           **{arm: dict(text=per_prompt[arm][i]["text"],
                                        token_ids=per_prompt[arm][i]["token_ids"],
                                        logprobs=per_prompt[arm][i]["logprobs"])
                              for arm in ARMS})
                      for i, p in enumerate(prompts)]
    res["summary"] = {arm: sum(answered(per_prompt[arm][i], p) for i, p in enumerate(prompts))
                      / len(prompts) for arm in ARMS}
    res["summary"]["connector_equals_resident"] = all(c["connector_equals_resident"]
                                                      for c in res["cells"])
    if "resident2" in ARMS:
        res["summary"]["resident2_equals_resident"] = all(c["resident2_equals_resident"]
                                                          for c in res["cells"])
    if abl:
        res["summary"]["hf_full"] = sum(a["full"] for a in abl) / len(abl)
        res["summary"]["ablated"] = sum(a["ablated"] for a in abl) / len(abl)
    with open(f"{out}.json", "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res["summary"]))
    plot(res, f"{out}.png")
    # a run kept in results/ gets its record; a smoke run is not a result
    if out.resolve().parent == ledger.RESULTS and not args.smoke:
        ledger.append_from("needle", [f"{out.name}.json", f"{out.name}.png"])
    if args.smoke:
        s = res["summary"]
        wrong = [what for what, bad in (
            ("resident serving did not answer", s["resident"] < 1),
            ("the connector's outputs differ from resident serving's",
             not s["connector_equals_resident"]),
            ("the scrambled control still answered", s["control"] > 0)) if bad]
        print("CHECK: " + ("; ".join(wrong) if wrong else
                           "resident answers, the connector equals it, the control falls"))
        return 1 if wrong else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
