"""Eager replacements in vllm_dhisparse/compat/eager_kernels.py == interpreted Triton."""

import pytest

from vllm_dhisparse.compat import early

early.install()  # TRITON_INTERPRET=1 + 'cpu' backend before vLLM's kernels load

torch = pytest.importorskip("torch")
importing = pytest.importorskip("vllm.triton_utils.importing")
if not importing.HAS_TRITON:
    pytest.skip("vLLM imported before the CPU compat hook", allow_module_level=True)

from vllm.v1.attention.backends.mla import sparse_swa  # noqa: E402
from vllm.v1.worker import utils as worker_utils  # noqa: E402

from vllm_dhisparse.compat import eager_kernels  # noqa: E402

TRITON_SWA = sparse_swa._COMPUTE_SWA_INDICES_AND_LENS_KERNEL
TRITON_SWA = getattr(TRITON_SWA, "triton_kernel", TRITON_SWA)


def swa_inputs(seed, has_image):
    g = torch.Generator().manual_seed(seed)
    block_size, window = 16, 24
    q_lens = [1, 1, 37, 5]
    seq_lens = [50, 3, 90, 40]
    num_reqs = len(q_lens)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    n_tok = int(qsl[-1]) + 3  # 3 padded tokens at the end
    tok2req = torch.cat(
        [torch.full((q,), r, dtype=torch.int32) for r, q in enumerate(q_lens)]
        + [torch.full((3,), 7, dtype=torch.int32)]  # garbage request ids
    )
    valid = torch.ones(n_tok, dtype=torch.bool)
    valid[-3:] = False
    valid[5] = False
    blocks = torch.randperm(64, generator=g).to(torch.int32)[: num_reqs * 8].view(num_reqs, 8)
    replay = torch.tensor([0, 0, 30, 0], dtype=torch.int32)
    left = torch.randint(0, 20, (n_tok,), generator=g, dtype=torch.int32)
    right = torch.randint(0, 3, (n_tok,), generator=g, dtype=torch.int32)
    width = window + (40 if has_image else 0)
    return dict(
        window_size=window, index_width=width, left_visible=left, right_visible=right,
        query_start_loc=qsl, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        token_to_req_indices=tok2req, is_valid_token=valid, block_table=blocks,
        block_size=block_size, replay_start=replay,
    ), n_tok, width


@pytest.mark.parametrize("has_image", [False, True])
@pytest.mark.parametrize("token_offset", [0, 2])
def test_swa_indices_match_triton(has_image, token_offset):
    args, n_tok, width = swa_inputs(0, has_image)
    n = n_tok - token_offset
    out = []
    for fn in (TRITON_SWA, eager_kernels.compute_swa_indices_and_lens):
        idx = torch.full((n + 4, width + 8), 12345, dtype=torch.int32)
        lens = torch.full((n + 4,), 12345, dtype=torch.int32)
        fn(idx, lens, *args.values(), num_tokens=n, token_offset=token_offset,
           has_image=has_image)
        out.append((idx, lens))
    (ti, tl_), (ei, el) = out
    assert torch.equal(tl_, el), (tl_, el)
    assert torch.equal(ti, ei), (ti != ei).nonzero()[:10]


def test_zero_blocks_matches_kernel_semantics():
    """Triton 3.6's interpreter cannot run ``_zero_kv_blocks_kernel`` at all
    (``tl.cast(int, tl.pointer_type(...))`` -> InterpreterError "Cannot call
    @triton.jit'd outside of the scope of a kernel"), so the eager version is
    checked against the kernel's contract: for every segment (addr, block
    stride, page size; int32 units) zero ``page`` elements at
    ``addr + block_id * stride``, nothing else."""
    a = torch.arange(10 * 6 * 8, dtype=torch.int32).view(10, 6, 8) + 1
    b = torch.arange(10 * 10, dtype=torch.int32).view(10, 10) + 1
    a0, b0 = a.clone(), b.clone()
    # Segment 0: whole block of a; segment 1: a[:, 1, :] only (stride 48,
    # page 8); segment 2: b rows.
    segs = [(a.data_ptr(), 48, 8), (a.data_ptr() + 4 * 8 * 3, 48, 8), (b.data_ptr(), 10, 10)]
    z = worker_utils.KVBlockZeroer.__new__(worker_utils.KVBlockZeroer)
    z.device = torch.device("cpu")
    z._meta = (
        torch.tensor([s[0] for s in segs], dtype=torch.uint64),
        torch.tensor([s[1] for s in segs], dtype=torch.int64),
        torch.tensor([s[2] for s in segs], dtype=torch.int64),
        1, 64, len(segs),
    )
    eager_kernels.zero_block_ids(z, [1, 7, 3])
    blocks = [1, 3, 7]
    a0[blocks, 0, :] = 0
    a0[blocks, 3, :] = 0
    b0[blocks] = 0
    assert torch.equal(a, a0)
    assert torch.equal(b, b0)
