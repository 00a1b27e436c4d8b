"""Trains the tiny DeepSeek-V4 demo model to answer passkey prompts (HF transformers).

    python scripts/train_needle_model.py --out /tmp/needle --minutes 9        (H200)
    python scripts/train_needle_model.py --out /tmp/needle --smoke            (CPU, seconds)

The model is the demo model's architecture (vllm_dhisparse/demo_build/model.py: 3 layers,
c4a / c128a / c4a, sliding window 128, index top-k 512), trained from its seeded
weights in HF transformers' DeepseekV4ForCausalLM (eager attention, float32).  Data:
vllm_dhisparse/needle.py, a passkey sentence and distractors of the same shape at random
depths, the question at the end.  Loss: cross-entropy of the answer's tokens, a little
language-model loss on the rest, and the Lightning Indexer's KL loss -- HF gives the
indexer no gradient (its top-k only masks), so, as DeepSeek's sparse attention does,
the indexer learns to match the main attention: KL(p || softmax(index scores)) over
the compressed entries the layer may read, p being the main attention's probabilities
on them summed over heads (detached), with the indexer's inputs detached so that this
loss trains the indexer alone.

Two stages: (A) dense, prompts of ``--len-a`` tokens (their compressed entries fit the
top-k, so the indexer reads everything while it learns), then (B) sparse, prompts of
``--len-b`` tokens (several times the top-k: the indexer must find the passkey).  Both
run in one process until ``--minutes`` are spent (stage A takes ``--share-a`` of them).
Writes ``<out>/hf`` (save_pretrained, 15 MB shards) and ``<out>/train_log.json`` (losses,
held-out exact-match accuracy per stage, seconds, the arguments).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
from vllm_dhisparse import needle as needle_data  # noqa: E402  (the package, installed or not)


class IndexerKL:
    """Forward hooks that collect, per c4a layer, the indexer's scores and the main
    attention's probabilities on the compressed entries; :meth:`loss` is their KL."""

    def __init__(self, model):
        from transformers.models.deepseek_v4 import modeling_deepseek_v4 as M
        self.parts: dict[int, dict] = {}
        self.handles = []
        for i, layer in enumerate(model.model.layers):
            comp = layer.self_attn.compressor
            if not isinstance(comp, M.DeepseekV4CSACompressor):
                continue
            self.handles += [
                comp.indexer.register_forward_pre_hook(self._detach_inputs),
                comp.indexer.scorer.register_forward_hook(self._keep(i, "scores")),
                comp.register_forward_hook(self._keep(i, "bias", lambda out: out[1])),
                layer.self_attn.register_forward_hook(self._keep(i, "probs", lambda out: out[1])),
            ]

    @staticmethod
    def _detach_inputs(module, args):
        return tuple(a.detach() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                     for a in args)

    def _keep(self, i, key, pick=lambda out: out):
        def hook(module, args, out):
            self.parts.setdefault(i, {})[key] = pick(out)
        return hook

    def loss(self) -> torch.Tensor:
        total, n = 0.0, 0
        for parts in self.parts.values():
            scores, bias, probs = parts["scores"], parts["bias"][:, 0], parts["probs"]
            t = scores.shape[-1]
            readable = bias == 0  # [B, S, T] the entries this query reads (causal, top-k)
            p = probs[..., -t:].detach().float().sum(1)  # [B, S, T] over heads
            p = p * readable
            mass = p.sum(-1, keepdim=True)
            rows = mass.squeeze(-1) > 0
            if not rows.any():
                continue
            p = p / mass.clamp(min=1e-30)
            logq = torch.log_softmax(scores.masked_fill(~readable, float("-inf")), dim=-1)
            kl = (p * (torch.log(p.clamp(min=1e-30)) - logq.masked_fill(~readable, 0.0))).sum(-1)
            total = total + kl[rows].mean()
            n += 1
        self.parts.clear()
        return total / max(n, 1) if n else torch.zeros(())


def batch(tok, n: int, length: int, rng: random.Random, dev):
    """``n`` prompts with their answers: (input ids [n, L], labels [n, L], answer mask)."""
    items = [needle_data.make(tok, length, rng, distractors=rng.randint(1, 4)) for _ in range(n)]
    seqs = [p.ids + p.answer_ids for p in items]
    width = max(map(len, seqs))
    ids = torch.full((n, width), 2, dtype=torch.long)  # <pad>
    labels = torch.full((n, width), -100, dtype=torch.long)
    answer = torch.zeros((n, width), dtype=torch.bool)
    for i, (p, s) in enumerate(zip(items, seqs)):
        ids[i, :len(s)] = torch.tensor(s)
        labels[i, :len(s) - 1] = torch.tensor(s[1:])
        answer[i, len(p.ids) - 1:len(s) - 1] = True  # positions predicting the answer
    return ids.to(dev), labels.to(dev), answer.to(dev)


def losses(model, kl: IndexerKL, ids, labels, answer, lm_weight: float):
    logits = model(input_ids=ids).logits.float()  # [B, L, V]
    ce = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view_as(labels)
    valid = labels >= 0
    ans = ce[answer].mean()
    lm = ce[valid & ~answer].mean()
    exact = ((logits.argmax(-1) == labels) | ~answer).all(-1).float().mean()
    return ans + lm_weight * lm, ans, lm, kl.loss(), exact


@torch.no_grad()
def evaluate(model, kl, tok, length: int, n: int, seed: int, dev, per_call: int) -> float:
    """Exact match of the whole answer (teacher-forced argmax) on held-out prompts."""
    model.eval()
    rng, hits = random.Random(seed), 0.0
    for _ in range(math.ceil(n / per_call)):
        ids, labels, answer = batch(tok, per_call, length, rng, dev)
        hits += float(losses(model, kl, ids, labels, answer, 0.0)[4]) * per_call
    model.train()
    return hits / (math.ceil(n / per_call) * per_call)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--init", default=os.path.join(ROOT, "demo_model"),
                    help="model to start from (the demo model, or a previous run's <out>/hf)")
    ap.add_argument("--minutes", type=float, default=9.0, help="training time, both stages")
    ap.add_argument("--share-a", type=float, default=0.45, help="stage A's share of it")
    ap.add_argument("--len-a", type=int, default=1024)
    ap.add_argument("--len-b", type=int, default=6000)
    ap.add_argument("--batch-a", type=int, default=16)
    ap.add_argument("--batch-b", type=int, default=2)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lm-weight", type=float, default=0.1)
    ap.add_argument("--kl-weight", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--state", default=None,
                    help="a file of the f32 weights and the optimiser: resumed from when it "
                         "exists, written at the end (continues a run in a second call)")
    ap.add_argument("--smoke", action="store_true", help="a few tiny steps on CPU")
    args = ap.parse_args()
    from transformers import AutoConfig, DeepseekV4ForCausalLM
    if args.smoke:
        args.minutes, args.len_a, args.len_b, args.batch_a, args.batch_b = 0.3, 300, 700, 2, 1
    torch.manual_seed(args.seed)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tok = needle_data.tokenizer(args.init)
    config = AutoConfig.from_pretrained(args.init)
    config._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM.from_pretrained(args.init, config=config,
                                                  dtype=torch.float32).to(dev)
    model.train()
    kl = IndexerKL(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(args.seed)
    resumed = bool(args.state) and os.path.exists(args.state)
    if resumed:
        state = torch.load(args.state, map_location=dev)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        rng.setstate(state["rng"])
        print(f"resumed from {args.state}", flush=True)
    log = dict(args=vars(args), device=str(torch.cuda.get_device_name(0) if dev.type == "cuda"
                                           else "cpu"), steps=[], evals={})
    t0 = time.time()
    budget = args.minutes * 60
    for stage, length, size, until in (("A", args.len_a, args.batch_a, args.share_a * budget),
                                       ("B", args.len_b, args.batch_b, budget)):
        step = 0
        while time.time() - t0 < until:
            warm = 1.0 if resumed else min(1.0, (step + 1) / 50)
            for g in opt.param_groups:
                g["lr"] = args.lr * warm * (0.3 if stage == "B" else 1.0)
            ids, labels, answer = batch(tok, size, length, rng, dev)
            loss, ans, lm, kl_loss, exact = losses(model, kl, ids, labels, answer, args.lm_weight)
            total = loss + args.kl_weight * kl_loss
            opt.zero_grad(set_to_none=True)
            total.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1
            if step % 10 == 1 or args.smoke:
                row = dict(stage=stage, step=step, s=round(time.time() - t0, 1),
                           answer_ce=float(ans), lm_ce=float(lm), kl=float(kl_loss),
                           exact=float(exact))
                log["steps"].append(row)
                print(json.dumps(row), flush=True)
        log["evals"][stage] = evaluate(model, kl, tok, length, 4 if args.smoke else 32,
                                       10_000 + ord(stage), dev, size)
        print(f"stage {stage}: {step} steps, held-out exact match {log['evals'][stage]:.3f}",
              flush=True)
    log["seconds"] = round(time.time() - t0, 1)
    log["resumed"] = resumed
    if args.state:
        torch.save(dict(model=model.state_dict(), opt=opt.state_dict(), rng=rng.getstate()),
                    args.state)
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(os.path.join(args.out, "hf"), max_shard_size="15MB")
    with open(os.path.join(args.out, "train_log.json"), "w") as f:
        json.dump(log, f, indent=1)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
