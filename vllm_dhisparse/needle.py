"""Passkey prompts for the tiny DeepSeek-V4 (training, the needle benchmark, the demo).

A prompt is filler text (the demo tokenizer's own corpus: the Zen of Python and a few
standard-library docstrings) with one passkey sentence, ``The pass key is 47192.``, at a
chosen depth, distractor sentences of the same shape under other labels (``The door
code is 83506.``) elsewhere, and the question at the end::

    ... What is the pass key? The pass key is

whose answer is the digits and a full stop.  Everything is drawn from one seed, and the
text is tokenized whole, as a server tokenizes it.

    python -m vllm_dhisparse.needle --model demo_model --tokens 7000 --seed 3   (a summary)
"""
from __future__ import annotations

import argparse
import os
import random
import sys
from dataclasses import dataclass

KEY = "pass key"
DISTRACTOR_LABELS = ("door code", "room number", "lock code", "ticket number", "box number")
QUESTION = f" What is the {KEY}? The {KEY} is"
DIGITS = 5


@dataclass
class Prompt:
    text: str  # the prompt, question included
    answer: str  # the digits and a full stop
    ids: list[int]  # the prompt's tokens
    answer_ids: list[int]  # the answer's tokens (tokenized after the prompt)
    needle_token: int  # token index where the passkey sentence starts
    depth: float  # its place in the filler, 0 = start, 1 = end


def training_corpus() -> list[str]:
    """Fixed English text shipped with CPython 3.11 (no downloads): the demo tokenizer's
    training corpus (vllm_dhisparse/demo_build/model.py) and the prompts' filler."""
    import codecs
    import collections
    import contextlib
    import io
    import json as json_mod
    import re

    with contextlib.redirect_stdout(io.StringIO()):
        import this  # noqa: F401  (prints the Zen on import; text is in this.s)

    zen = codecs.decode(sys.modules["this"].s, "rot13")
    docs = [zen] + [m.__doc__ or "" for m in (collections, json_mod, re, argparse, os)]
    return [line for doc in docs for line in doc.splitlines() if line.strip()]


def code(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(DIGITS))


def make(tok, n_tokens: int, rng: random.Random, depth: float | None = None,
         distractors: int = 3) -> Prompt:
    """A prompt of about ``n_tokens`` tokens (within a sentence of it)."""
    lines = training_corpus()
    depth = rng.random() if depth is None else depth
    key = code(rng)
    others = [(rng.choice(DISTRACTOR_LABELS), code(rng), rng.random()) for _ in range(distractors)]
    budget = n_tokens - len(tok.encode(QUESTION).ids) - 16 * (1 + distractors)
    filler, used = [], 0
    while used < budget:
        line = " " + rng.choice(lines).strip()
        n = len(tok.encode(line).ids)
        if used + n > budget and filler:
            break
        filler.append(line)
        used += n
    inserts = [(depth, f" The {KEY} is {key}.")] + [(d, f" The {label} is {c}.")
                                                     for label, c, d in others]
    pieces = list(filler)
    for d, sentence in sorted(inserts, key=lambda x: -x[0]):  # back to front: indices hold
        pieces.insert(round(d * len(filler)), sentence)
    before = "".join(pieces[:pieces.index(inserts[0][1])])
    text = "".join(pieces) + QUESTION
    answer = f" {key}."
    ids = tok.encode(text).ids
    full = tok.encode(text + answer).ids
    if full[:len(ids)] != ids:  # the answer must not merge with the question's last token
        raise ValueError(f"answer {answer!r} changes the prompt's tokens")
    return Prompt(text, answer, ids, full[len(ids):], len(tok.encode(before).ids), depth)


def tokenizer(model_dir: str):
    from tokenizers import Tokenizer
    return Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="demo_model")
    ap.add_argument("--tokens", type=int, default=7000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--depth", type=float, default=None)
    args = ap.parse_args()
    p = make(tokenizer(args.model), args.tokens, random.Random(args.seed), args.depth)
    print(f"{len(p.ids)} tokens, passkey at token {p.needle_token} (depth {p.depth:.2f}), "
          f"answer {p.answer!r} = {len(p.answer_ids)} tokens")
    print(p.text[:300] + " ... " + p.text[-200:])


if __name__ == "__main__":
    main()
