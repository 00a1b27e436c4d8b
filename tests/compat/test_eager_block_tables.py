"""The eager block-table launches (compat/eager_block_tables.py) == vLLM's interpreted
Triton kernels, driven through vLLM's own ``BlockTables``."""

import pytest

from vllm_dhisparse.compat import early

early.install()  # TRITON_INTERPRET=1 + 'cpu' backend before vLLM's kernels load

torch = pytest.importorskip("torch")
importing = pytest.importorskip("vllm.triton_utils.importing")
if not importing.HAS_TRITON:
    pytest.skip("vLLM imported before the CPU compat hook", allow_module_level=True)

from vllm.v1.worker.cpu import buffer_utils as cpu_buffers  # noqa: E402
from vllm.v1.worker.gpu import block_table as bt  # noqa: E402
from vllm.v1.worker.gpu import buffer_utils  # noqa: E402

from vllm_dhisparse.compat import eager_block_tables as ebt  # noqa: E402

KERNELS = ("_gather_block_tables_kernel", "_compute_slot_mappings_kernel")
TRITON = {name: getattr(getattr(bt, name), "triton_kernel", getattr(bt, name))
          for name in KERNELS}
SIZES = [16, 64, 256, 8]  # block size per KV cache group
MAX_BLOCKS = [80, 20, 8, 160]  # 1,280 - 2,048 positions per request and group
MIN_BLOCKS = [63, 16, 4, 126]  # every request's blocks cover its 1,000 first positions
ENABLED = [True, True, False, True]  # a group without slot mappings (PAD for all)
MAX_TOKENS = 2100  # the padding program loops over the row in chunks of 1,024


@pytest.fixture(autouse=True)
def host_buffers(monkeypatch):
    """vLLM's CPU worker swaps the pinned staging buffers for plain host ones when it
    is imported (``v1/worker/cpu/shm.py``); here only while a test runs."""
    monkeypatch.setattr(buffer_utils, "UvaBuffer", cpu_buffers.UvaBuffer)


def block_tables(seed: int) -> "bt.BlockTables":
    """Six requests with their own block ids per group, staged and applied as vLLM does."""
    g = torch.Generator().manual_seed(seed)
    tables = bt.BlockTables(SIZES, max_num_reqs=8, max_num_batched_tokens=MAX_TOKENS,
                            max_num_blocks_per_group=MAX_BLOCKS, device=torch.device("cpu"),
                            slot_mapping_enabled=ENABLED)
    for req in range(6):
        ids = tuple(torch.randint(1, 1000, (int(torch.randint(lo, m + 1, (1,), generator=g)),),
                                  generator=g).tolist() for lo, m in zip(MIN_BLOCKS, MAX_BLOCKS))
        tables.append_block_ids(req, ids, overwrite=True)
    tables.apply_staged_writes()
    return tables


class Declined:
    """Stands where the Triton kernel would: an eager launch that declined fails the test."""

    def __getitem__(self, grid):
        raise AssertionError(f"the eager launch declined (grid {grid})")


def run(kernels: str, tables: "bt.BlockTables", idx_mapping, padded, qsl, positions):
    """The gathered tables and slot mappings with ``kernels`` bound at vLLM's globals
    ("eager": the eager launches alone, a fallback to the kernel fails)."""
    saved = {name: getattr(bt, name) for name in KERNELS}
    try:
        for name in KERNELS:
            if kernels == "triton":
                setattr(bt, name, TRITON[name])
            else:
                eager = (ebt.gather_block_tables if "gather" in name
                         else ebt.compute_slot_mappings)
                setattr(bt, name, ebt.EagerLaunch(Declined(), eager))
        for table in tables.input_block_tables:
            table.fill_(-7)  # what a kernel leaves alone shows up as -7
        tables.slot_mappings.fill_(-9)
        gathered = [t.clone() for t in tables.gather_block_tables(idx_mapping, padded)]
        slots = tables.compute_slot_mappings(idx_mapping, qsl, positions,
                                             int(qsl[-1])).clone()
        return gathered, tables.slot_mappings.clone(), slots
    finally:
        for name, kernel in saved.items():
            setattr(bt, name, kernel)


def batch(idx: list[int], q_lens: list[int], seed: int, tables):
    """A step's inputs: positions inside each request's blocks of the smallest group."""
    g = torch.Generator().manual_seed(seed)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    pos = []
    for r, q in zip(idx, q_lens):
        # positions the request's blocks cover in every enabled group
        cover = min(int(tables.num_blocks.np[i, max(r, 0)]) * SIZES[i]
                    for i in range(len(SIZES)) if ENABLED[i])
        start = int(torch.randint(0, max(cover - q, 0) + 1, (1,), generator=g))
        pos += list(range(start, start + q))
    positions = torch.tensor(pos + [0] * 5, dtype=torch.int64)  # padded tokens after
    return torch.tensor(idx, dtype=torch.int32), qsl, positions


@pytest.mark.parametrize("idx,q_lens,padded", [
    ([0], [1], 1),  # one decoding request
    ([3, 1, 5, 0], [1, 1, 1, 1], 6),  # decodes out of order, two padded rows
    ([2, 4], [37, 1], 2),  # a prefill chunk next to a decode
    ([5, 0, 2], [1, 900, 3], 4),  # a long chunk
])
def test_eager_equals_triton(idx, q_lens, padded):
    tables = block_tables(seed=len(idx))
    inputs = batch(idx, q_lens, seed=sum(q_lens), tables=tables)
    want = run("triton", tables, inputs[0], padded, *inputs[1:])
    got = run("eager", tables, inputs[0], padded, *inputs[1:])
    for w, e in zip(want[0], got[0]):
        assert torch.equal(w, e), (w != e).nonzero()[:10]
    assert torch.equal(want[1], got[1]), (want[1] != got[1]).nonzero()[:10]
    assert torch.equal(want[2], got[2])
    # what the comparison covers: real block ids and slots, PAD for the disabled group
    assert (want[1][2, :int(inputs[1][-1])] == -1).all()
    assert (want[1][0, :int(inputs[1][-1])] >= 0).all()


def slot_mappings(fn, tables, idx, qsl, positions) -> torch.Tensor:
    """``fn`` (the Triton kernel or the eager launch) on the tables' slot-mapping buffer."""
    tables.slot_mappings.fill_(-9)
    fn[(len(SIZES), idx.shape[0] + 1)](
        tables.slot_mappings.shape[1], idx, qsl, positions, tables.block_table_ptrs,
        tables.block_table_strides, tables.block_sizes_tensor, tables.slot_mapping_enabled,
        tables.dcp_sharded, tables.slot_mappings, tables.slot_mappings.stride(0), 0,
        CP_SIZE=1, CP_INTERLEAVE=1, PAD_ID=-1, TRITON_BLOCK_SIZE=1024)
    return tables.slot_mappings.clone()


def test_padding_request_in_slot_mappings():
    """A padding request (``idx_mapping`` -1) owns no blocks: PAD for its tokens, also at
    a position far past every row (only the slot mappings: the gather never gets one)."""
    tables = block_tables(seed=7)
    idx, qsl, positions = batch([1, 0], [2, 1], seed=3, tables=tables)
    idx[1] = -1
    positions[2] = 10**6
    want = slot_mappings(TRITON["_compute_slot_mappings_kernel"], tables, idx, qsl, positions)
    got = slot_mappings(ebt.EagerLaunch(Declined(), ebt.compute_slot_mappings), tables, idx,
                        qsl, positions)
    assert torch.equal(want, got)
    assert (want[:, 2] == -1).all() and (want[0, :2] >= 0).all()


def test_uncovered_inputs_go_to_the_kernel():
    """Context parallelism and a position past its row are the Triton kernel's."""
    tables = block_tables(seed=1)
    idx, qsl, positions = batch([0], [1], seed=0, tables=tables)
    args = (tables.slot_mappings.shape[1], idx, qsl, positions, tables.block_table_ptrs,
            tables.block_table_strides, tables.block_sizes_tensor,
            tables.slot_mapping_enabled, tables.dcp_sharded, tables.slot_mappings,
            tables.slot_mappings.stride(0), 0)
    before = tables.slot_mappings.clone()
    assert not ebt.compute_slot_mappings((4, 2), *args, CP_SIZE=2, CP_INTERLEAVE=1,
                                         PAD_ID=-1)
    for bad in (MAX_BLOCKS[0] * SIZES[0], -1):  # past the row, before it
        far = positions.clone()
        far[0] = bad
        assert not ebt.compute_slot_mappings((4, 2), *args[:3], far, *args[4:], CP_SIZE=1,
                                             CP_INTERLEAVE=1, PAD_ID=-1)
    gather = (idx, tables.block_table_ptrs, tables.input_block_table_ptrs,
              tables.block_table_strides, tables.num_blocks.gpu,
              tables.num_blocks.gpu.stride(0))
    assert not ebt.gather_block_tables((4, 1), torch.tensor([-1], dtype=torch.int32),
                                       *gather[1:], 1)
    assert not ebt.gather_block_tables((4, 0), *gather, 1)  # fewer rows than requests
    assert torch.equal(tables.slot_mappings, before)  # declined: nothing written


def test_apply_binds_vllms_globals():
    ebt.apply()
    for name in KERNELS:
        assert isinstance(getattr(bt, name), ebt.EagerLaunch)
    ebt.apply()  # a second application keeps one wrapper
    assert not isinstance(getattr(bt, KERNELS[0]).triton_kernel, ebt.EagerLaunch)
