"""scripts/shrink_needle_model.py: each narrowing keeps what it claims to keep.

The indexer's head copies keep every index score; the LoRA rank cuts and the expert cut are
exact on weights that already fit the narrower width, and a change the shrink cannot make is
refused by name."""
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
import shrink_needle_model as shrink  # noqa: E402

A = "layers.0.attn."
g = torch.Generator().manual_seed(0)


def rand(*shape):
    return torch.randn(*shape, generator=g)


def index_scores(w, q_latent, hidden, keys, heads, head_dim):
    """HF's scorer: sum_h w_h(x) relu(q_h . k) / sqrt(head_dim) / sqrt(heads)."""
    q = (w[A + "indexer.wq_b.weight"] @ q_latent).view(heads, head_dim)
    weights = w[A + "indexer.weights_proj.weight"] @ hidden * heads ** -0.5
    return (torch.relu(q @ keys.T) * head_dim ** -0.5 * weights[:, None]).sum(0)


def test_copied_indexer_heads_give_every_score_unchanged():
    w = {A + "indexer.wq_b.weight": rand(8 * 16, 12),
         A + "indexer.weights_proj.weight": rand(8, 20)}
    old = {"index_n_heads": 8, "index_head_dim": 16}
    q_latent, hidden, keys = rand(12), rand(20), rand(30, 16)
    before = index_scores(w, q_latent, hidden, keys, 8, 16)
    shrink.indexer_heads(w, A, old, {"index_n_heads": 32})
    assert w[A + "indexer.wq_b.weight"].shape == (32 * 16, 12)
    after = index_scores(w, q_latent, hidden, keys, 32, 16)
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def rms_norm(x, gain):
    return gain * x / x.pow(2).mean().sqrt()


def test_query_rank_cut_is_exact_when_latent_and_readers_fit_the_new_rank():
    r0, r1, hidden = 16, 6, 24
    basis, _ = torch.linalg.qr(rand(r0, r1))  # [r0, r1] orthonormal columns
    w = {A + "wq_a.weight": basis @ rand(r1, hidden),  # the latent lives in the basis
         A + "q_norm.weight": torch.full((r0,), 1.3),
         A + "wq_b.weight": rand(40, r1) @ basis.T,  # and the readers read only it
         A + "indexer.wq_b.weight": rand(10, r1) @ basis.T}
    x = rand(hidden)

    def queries(w):
        n = rms_norm(w[A + "wq_a.weight"] @ x, w[A + "q_norm.weight"])
        return w[A + "wq_b.weight"] @ n, w[A + "indexer.wq_b.weight"] @ n

    before = queries(w)
    shrink.query_rank(w, A, {"q_lora_rank": r0}, {"q_lora_rank": r1})
    assert w[A + "wq_a.weight"].shape == (r1, hidden)
    for b, a in zip(before, queries(w)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_output_rank_cut_keeps_each_groups_product_of_the_new_rank():
    r0, r1, groups, width, hidden = 12, 4, 2, 30, 20
    wo_a = torch.cat([rand(r0, r1) @ rand(r1, width) for _ in range(groups)])
    w = {A + "wo_a.weight": wo_a, A + "wo_b.weight": rand(hidden, groups * r0)}
    products = [w[A + "wo_b.weight"][:, j * r0:(j + 1) * r0] @ wo_a[j * r0:(j + 1) * r0]
                for j in range(groups)]
    shrink.output_rank(w, A, {"o_lora_rank": r0, "o_groups": groups}, {"o_lora_rank": r1})
    assert w[A + "wo_a.weight"].shape == (groups * r1, width)
    for j, p in enumerate(products):
        rows = slice(j * r1, (j + 1) * r1)
        got = w[A + "wo_b.weight"][:, rows] @ w[A + "wo_a.weight"][rows]
        torch.testing.assert_close(got, p, rtol=1e-4, atol=1e-4)


def test_expert_cut_keeps_the_neurons_that_carry_the_output():
    e = "layers.1.ffn.experts.3."
    w1, w3, w2 = rand(10, 8), rand(10, 8), rand(8, 10)
    dead = torch.tensor([0, 2, 3, 5, 7, 9])
    w1[dead] = 0.0  # these neurons contribute nothing
    w = {e + "w1.weight": w1, e + "w2.weight": w2, e + "w3.weight": w3}
    x = rand(8)

    def out(w):
        return w[e + "w2.weight"] @ (torch.nn.functional.silu(w[e + "w1.weight"] @ x)
                                     * (w[e + "w3.weight"] @ x))

    before = out(w)
    shrink.expert_width(w, e, 4)
    assert w[e + "w1.weight"].shape == (4, 8)
    torch.testing.assert_close(out(w), before)


def test_a_change_it_cannot_make_is_refused_by_name():
    old = {"hidden_size": 256, "num_hidden_layers": 3}
    with pytest.raises(SystemExit, match=r"hidden_size differs \(256 -> 128\)"):
        shrink.shrink({}, old, {**old, "hidden_size": 128})
