"""The trained demo model's tooling on CPU (vllm_dhisparse/needle.py, train_needle_model.py,
convert_needle_model.py): prompts as specified, the indexer's KL loss trains the indexer
alone, and an HF checkpoint converts back to vLLM's names and dtypes bit for bit."""
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"
sys.path.insert(0, str(SCRIPTS))
import convert_needle_model as C  # noqa: E402

from vllm_dhisparse import needle as N  # noqa: E402

pytestmark = pytest.mark.e2e


def test_prompts_hide_the_key_where_asked(demo_model):
    tok = N.tokenizer(demo_model)
    p = N.make(tok, 3000, random.Random(1), depth=0.5, distractors=3)
    assert 2800 <= len(p.ids) <= 3000
    assert len(re.findall(rf"The {N.KEY} is \d{{{N.DIGITS}}}\.", p.text)) == 1
    assert p.text.endswith(N.QUESTION)
    assert tok.decode(p.answer_ids) == p.answer.strip() or tok.decode(p.answer_ids) == p.answer
    key = p.answer.strip(" .")
    assert f"The {N.KEY} is {key}." in p.text
    assert 0.4 < p.needle_token / len(p.ids) < 0.6
    labels = re.findall(rf"The ([a-z ]+) is \d{{{N.DIGITS}}}\.", p.text)
    assert len(labels) == 4 and set(labels) - {N.KEY} <= set(N.DISTRACTOR_LABELS)


def test_kl_trains_the_indexer_alone_and_the_checkpoint_converts_back(demo_model, tmp_path):
    from transformers import AutoConfig, DeepseekV4ForCausalLM
    import train_needle_model as T
    cfg = AutoConfig.from_pretrained(demo_model)
    cfg._attn_implementation = "eager"
    model = DeepseekV4ForCausalLM.from_pretrained(demo_model, config=cfg, dtype=torch.float32)
    kl = T.IndexerKL(model)
    ids, labels, answer = T.batch(N.tokenizer(demo_model), 1, 400, random.Random(0), "cpu")
    kl_loss = T.losses(model, kl, ids, labels, answer, 0.1)[3]
    assert float(kl_loss) > 0
    kl_loss.backward()
    with_grad = {n for n, p in model.named_parameters()
                 if p.grad is not None and p.grad.abs().sum() > 0}
    assert with_grad and all(".indexer." in n for n in with_grad), sorted(with_grad)[:5]
    # the untrained model through HF's save and the converter: vLLM's checkpoint again
    model = DeepseekV4ForCausalLM.from_pretrained(demo_model, config=cfg)
    model.save_pretrained(tmp_path / "hf", max_shard_size="15MB")
    subprocess.run([sys.executable, str(SCRIPTS / "convert_needle_model.py"), "--hf",
                    str(tmp_path / "hf"), "--out", str(tmp_path / "native"), "--like",
                    demo_model], check=True)
    want = C.read(f"{demo_model}/*.safetensors")
    got = C.read(str(tmp_path / "native" / "model-*.safetensors"))
    assert set(got) == set(want)
    assert all(got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)
