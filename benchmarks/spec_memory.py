"""Per-session draft-KV and staging memory with speculation, from a running engine.

    VLLM_USE_V2_MODEL_RUNNER=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 \
        python benchmarks/spec_memory.py --model demo_model      # CPU, ~2 min
    ... spec_memory.py --model demo_model --smoke --out /tmp/sm  # CI: one 800-token prompt

Two arms on the demo model with the seeded DFlash2 drafter (window 128, K = 3;
vllm_dhisparse/demo_build/drafters.py), four concurrent requests of 600-7000 tokens: vLLM
alone (resident + DFlash2) and the hierarchy (+ its draft ring).  Checked first: both
arms give the same greedy tokens (exit 1 otherwise).  Measured per arm, from vLLM's own
block tables after every engine step (offline_run): the most draft blocks one request
held at any step (prefill included) and in decode, times the draft layers' page bytes;
from the connector's stats: R_d (eq. 9) and the staging arenas' bytes next to their
bound M_stage (eq. 11, chi = 1).  Next to them, the paper's Table 1 method
for the same shape: R_d x draft row bytes.  ``--smoke`` (one 800-token prompt, 4 output
tokens) also exits 1 unless the ring holds at most R_d / p blocks per
request at every decode step (and in prefill, where the ring bounds prefill) and the
staging arenas stay within M_stage.  Memory is counted, not timed, so the CPU
engine gives the same numbers a GPU would for this model.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common as C  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PROMPTS = ["--prompt-lens", "600", "2000", "4000", "7000", "--max-tokens", "24",
           "--repeat-prompt", "--seed", "2"]
SMOKE_PROMPTS = ["--prompt-lens", "800", "--max-tokens", "4", "--repeat-prompt",
                 "--seed", "2"]
HIER = {"hot_cache_rows": 512, "optional_residency": False, "spec": "dflash2"}
K, WINDOW = 3, 128


def offline(model: str, *args: str) -> dict:
    env = {**os.environ, "VLLM_USE_V2_MODEL_RUNNER": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    cmd = [sys.executable, "-m", "harness.offline_run", "--model", model, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    for line in proc.stdout.splitlines():
        if line.startswith("DHISPARSE_RESULT "):
            return json.loads(line[len("DHISPARSE_RESULT "):])
    raise SystemExit(f"offline run failed: {' '.join(cmd)}\n{proc.stderr[-4000:]}")


def draft_group(run: dict, first_layer: str) -> dict:
    g = next(i for i, grp in enumerate(run["kv_groups"]) if grp["first_layer"] == first_layer)
    grp = run["kv_groups"][g]
    return dict(spec=grp["spec"], block_size=grp["block_size"], page_bytes=grp["page_bytes"],
                blocks_any_step=run["max_blocks_per_group"][g],
                blocks_decode=run["max_decode_blocks_per_group"][g],
                bytes_any_step=run["max_blocks_per_group"][g] * grp["page_bytes"],
                bytes_decode=run["max_decode_blocks_per_group"][g] * grp["page_bytes"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="the demo model directory")
    ap.add_argument("--name", default="spec_memory")
    ap.add_argument("--out", default=None, help="result path without suffix (default: "
                    "benchmarks/results/NAME)")
    ap.add_argument("--smoke", action="store_true", help="one 800-token prompt; exit 1 unless "
                    "the arms' tokens are equal and the ring and staging bounds hold")
    args = ap.parse_args(argv)
    prompts = SMOKE_PROMPTS if args.smoke else PROMPTS
    drafter = os.path.join(tempfile.mkdtemp(prefix="dhisparse-drafter-"), "dflash2")
    subprocess.run([sys.executable, "-m", "vllm_dhisparse.demo_build.drafters", "dflash2",
                    "--target", args.model, "--out", drafter, "--k", str(K),
                    "--window", str(WINDOW)], check=True, capture_output=True)
    spec = json.dumps({"method": "dflash", "model": drafter, "num_speculative_tokens": K})
    resident = offline(args.model, *prompts, "--spec", spec)
    hier = offline(args.model, *prompts, "--spec", spec, "--connector", json.dumps(HIER))
    same = [a["token_ids"] == b["token_ids"] for a, b in zip(resident["outputs"], hier["outputs"])]
    if not all(same):
        print(f"CHECK FAILED: greedy tokens differ between the arms: {same}")
        return 1
    ring_layer = next(g["first_layer"] for g in hier["kv_groups"] if g["spec"] == "DraftRingSpec")
    sizes = hier["stats"]["spec"]
    ours, alone = draft_group(hier, ring_layer), draft_group(resident, ring_layer)
    row_bytes = ours["page_bytes"] // ours["block_size"]  # draft KV per token, all draft layers
    table1 = sizes["draft_ring_rows"] * row_bytes
    out = dict(meta=C.metadata(), config=dict(prompts=prompts, k=K, window=WINDOW, hier=HIER),
               check=dict(same_tokens=same), spec_sizes=sizes,
               draft_kv=dict(resident=alone, hierarchy=ours, draft_row_bytes=row_bytes,
                             table1_ring_bytes=table1),
               staging=dict(reserved_bytes=sizes["staging_reserved_bytes"],
                            bound_bytes=sizes["staging_bound_bytes"]))
    C.write_json(args.name, out, args.out and f"{args.out}.json")
    print(f"draft KV per session, most at any step: vLLM alone {alone['blocks_any_step']} blocks "
          f"({C.fmt_bytes(alone['bytes_any_step'])}), draft ring {ours['blocks_any_step']} blocks "
          f"({C.fmt_bytes(ours['bytes_any_step'])}); Table 1 method R_d x row = "
          f"{sizes['draft_ring_rows']} x {row_bytes} B = {C.fmt_bytes(table1)}")
    print(f"verification staging: reserved {C.fmt_bytes(sizes['staging_reserved_bytes'])} "
          f"(chi arenas shared by the layers) vs M_stage {C.fmt_bytes(sizes['staging_bound_bytes'])} (chi = 1)")
    fig, ax = C.new_figure(1, "Speculative memory (demo model, DFlash2 W=128, K=3): draft KV per "
                              "session, staging for all slots", out["meta"])
    a = ax[0]
    labels = ["draft KV\nvLLM alone", "draft KV\ndraft ring", "Table 1\nR_d x row",
              "staging\nreserved", "staging\nM_stage"]
    values = [alone["bytes_any_step"], ours["bytes_any_step"], table1,
              sizes["staging_reserved_bytes"], sizes["staging_bound_bytes"]]
    a.bar(range(len(values)), [v / 2**20 for v in values],
          color=["gray", "tab:blue", "tab:cyan", "tab:orange", "tab:red"])
    a.set_xticks(range(len(values)), labels, fontsize=7)
    a.set_ylabel("MiB")
    C.save_figure(fig, args.name, args.out and f"{args.out}.png")
    if args.smoke:
        return smoke_check(ours, sizes)
    return 0


def smoke_check(ring: dict, sizes: dict) -> int:
    """The ring's bound (eq. 9) at every decode step, and in prefill where the ring bounds
    prefill (no prefix caching); the staging arenas within M_stage (eq. 11)."""
    off = []
    if not 0 < ring["blocks_decode"] <= sizes["draft_ring_blocks"]:
        off.append(f"{ring['blocks_decode']} draft blocks held in decode, ring bound "
                   f"{sizes['draft_ring_blocks']}")
    if sizes["draft_ring_bounds_prefill"] and ring["blocks_any_step"] > sizes["draft_ring_blocks"]:
        off.append(f"{ring['blocks_any_step']} draft blocks held at some step, ring bound "
                   f"{sizes['draft_ring_blocks']}")
    if not 0 < sizes["staging_reserved_bytes"] <= sizes["staging_bound_bytes"]:
        off.append(f"staging reserved {sizes['staging_reserved_bytes']} B, M_stage "
                   f"{sizes['staging_bound_bytes']} B")
    print("CHECK: " + ("; ".join(off) if off else
                       "tokens equal, the draft ring and staging within their bounds"))
    return 1 if off else 0


if __name__ == "__main__":
    sys.exit(main())
