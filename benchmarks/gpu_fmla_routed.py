"""DeepSeek-V4 c4a decode routed through KVHierarchy, held to vLLM's own FlashMLA (H200).

Resident arm: vLLM's layout, c4a rows in 37,440-B blocks scattered by a block table,
``extra_indices_in_kvcache`` = global indices of the top-k (request-local positions).
Routed arm: the same rows imported into a ``KVHierarchy`` (576 + 8 byte planes),
``KVHierarchy.resolve`` turns the top-k into locations (direct pages, hot cache,
misses fetched from pinned host by the fused resolver), FlashMLA reads the
hierarchy's device rows in place as one block.  Both arms share q, the SWA cache and
its indices, the sink and the lengths.  Checked, per step: output and LSE bitwise
equal; then a negative control (one location off) that must differ, the torch
reference (vllm_dhisparse/flashmla/reference.py) next to the kernel, and the routed
decode captured in one CUDA graph with resolve and replayed over changing
selections under ``torch.cuda.set_sync_debug_mode("error")``.  Timed: FlashMLA alone
vs resolve + FlashMLA at V4-Flash decode shapes, next to a pinned copy of the
missed bytes.  Writes JSON; exits 1 on any mismatch.

    CORRECTNESS=0 TESTS=0 COMMIT=$(git rev-parse --short HEAD) bash scripts/gpu_check.sh   # H200
    python benchmarks/gpu_fmla_routed.py --out benchmarks/results/x.json      # the same
    TRITON_INTERPRET=1 python benchmarks/gpu_fmla_routed.py --small --out /tmp/x.json

FlashMLA comes from vLLM 0.33.0's wheel (``_flashmla_C.abi3.so``, stable torch ABI)
under ``--fmla-dir`` (a folder holding ``vllm/``, see ../shared/notes/gpu_path.md §5);
``--small`` on a CPU uses the torch reference in its place.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_hierarchy_step import selections  # noqa: E402

from vllm_dhisparse.flashmla import layout as L  # noqa: E402
from vllm_dhisparse.flashmla import routing as R  # noqa: E402
from vllm_dhisparse.flashmla.reference import sparse_decode  # noqa: E402
from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy  # noqa: E402

HEADS, SWA_TOPK, SWA_BLOCKS = 64, 128, 8
SCALE = 512 ** -0.5
FULL = dict(top_k=512, hot=2048, history=2048, time_history=16384, batches=(1, 8, 64, 512), queries=(1, 2, 4),
            misses=(0.0, 0.05, 0.30), steps=6, graph_batch=64, time_batch=512, replays=8,
            routing_batch=64, routing_queries=2)
SMALL = dict(top_k=16, hot=64, history=200, time_history=400, batches=(1, 3), queries=(1, 2),
             misses=(0.0, 0.3), steps=5, graph_batch=0, time_batch=0, replays=0,
             routing_batch=3, routing_queries=2)


def fmla_dir(given: str | None, dev) -> str | None:
    """Where FlashMLA is loaded from: ``given`` (it must hold the kernel), else ./.fmla
    where it exists; None (the torch reference) without CUDA or without the kernel."""
    if dev.type != "cuda":
        return None
    found = given or str(ROOT / ".fmla")
    if not (Path(found) / "vllm" / "_flashmla_C.abi3.so").exists():
        if given:
            raise SystemExit(f"--fmla-dir {given}: no vllm/_flashmla_C.abi3.so there "
                             f"(bash scripts/fetch_flashmla.sh {given})")
        return None
    return found


class Kernel:
    """FlashMLA's V4 sparse decode, or the torch reference where it cannot run."""

    def __init__(self, fmla_dir: str | None):
        self.fmla = None
        if fmla_dir is not None:
            sys.path.insert(0, fmla_dir)
            from vllm.third_party.flashmla import flash_mla_interface as fmla
            self.fmla = fmla

    def __call__(self, q, swa, swa_idx, swa_len, sink, extra, extra_idx, extra_len):
        """q [T, 1, H, 512] bf16 -> (out [T, 1, H, 512], lse [T, H, 1] or None)."""
        if self.fmla is None:
            return sparse_decode(q, swa, swa_idx, swa_len, sink, SCALE, extra, extra_idx,
                                 extra_len), None
        meta, _ = self.fmla.get_mla_metadata()
        return self.fmla.flash_mla_with_kvcache(
            q=q, k_cache=swa, block_table=None, cache_seqlens=None, head_dim_v=512,
            tile_scheduler_metadata=meta, is_fp8_kvcache=True, indices=swa_idx,
            topk_length=swa_len, softmax_scale=SCALE, attn_sink=sink, extra_k_cache=extra,
            extra_indices_in_kvcache=extra_idx, extra_topk_length=extra_len)


def valid_rows(n: int, g: torch.Generator, dev) -> torch.Tensor:
    """fp8_ds_mla rows whose every value is finite and small enough that attention
    spreads over many rows (a softmax dominated by one row would hide a wrong index).
    # [n, 584] uint8"""
    fp8 = torch.randint(0, 0x40, (n, 448), generator=g, device=dev, dtype=torch.uint8)
    fp8 |= torch.randint(0, 2, (n, 448), generator=g, device=dev, dtype=torch.uint8) << 7
    rope = (torch.randn(n, 64, generator=g, device=dev) * 0.5).to(torch.bfloat16)
    scales = torch.randint(120, 125, (n, 8), generator=g, device=dev, dtype=torch.uint8)
    scales[:, 7] = 0
    return torch.cat([fp8, rope.view(torch.uint8).view(n, 128), scales], dim=1)


class World:
    """n requests' c4a rows twice: in vLLM's blocks and in a KVHierarchy."""

    def __init__(self, cfg: dict, n: int, miss: float, dev, seed: int,
                 resident: float | None = None, staging: dict | None = None):
        self.cfg, self.n, self.dev = cfg, n, dev
        self.g = torch.Generator(device=dev).manual_seed(seed)
        hist, ps = cfg["history"], L.ROWS_PER_BLOCK
        self.max_rows = hist + cfg["steps"] + ps
        per_req = -(-self.max_rows // ps)
        total = n * per_req + 4
        perm = torch.randperm(total, generator=torch.Generator().manual_seed(seed))
        self.block_table = perm[:n * per_req].view(n, per_req).to(torch.int32).to(dev)
        self.blocks = torch.zeros(total * L.BLOCK_STRIDE, dtype=torch.uint8, device=dev)
        self.blocks_2d = L.as_blocks_2d(L.block_view(self.blocks, total))
        self.put(self.blocks_2d, torch.arange(total * ps, device=dev),
                 valid_rows(total * ps, self.g, dev))  # rows no request owns: finite too
        self.truth = valid_rows(n * self.max_rows, self.g, dev).view(n, self.max_rows, 584)
        self.lens = [hist - (i * 7) % ps for i in range(n)]  # staggered within a page
        for i in range(n):
            self.write_blocks(i, 0, self.truth[i])
        hot_pages = -(-cfg["hot"] // ps)
        if resident is None:  # share of the history on device: all of it without misses
            resident = 1.0 if miss == 0 else 0.5
        optional = int(resident * n * (hist // ps))
        spec = dict(name="c4a", row_bytes=584, page_size=ps,
                    device_pages=n * (hot_pages + 2) + optional, host_rows=n * self.max_rows,
                    hot_cache_rows=cfg["hot"], tail_pages=2, max_req_slots=n, max_rows=self.max_rows,
                    plane_bytes=(L.DATA_BYTES, L.SCALE_BYTES))
        self.h = KVHierarchy([spec], device=dev, staging=staging)
        self.ids = [f"r{i}" for i in range(n)]
        for i, rid in enumerate(self.ids):
            assert self.h.admit(rid, self.max_rows, {"c4a": self.truth[i, :self.lens[i]]})
        self.swa = torch.zeros(SWA_BLOCKS * L.BLOCK_STRIDE, dtype=torch.uint8, device=dev)
        rows = valid_rows(SWA_BLOCKS * ps, self.g, dev)
        self.put(L.as_blocks_2d(L.block_view(self.swa, SWA_BLOCKS)),
                 torch.arange(SWA_BLOCKS * ps, device=dev), rows)
        self.sink = torch.randn(HEADS, generator=self.g, device=dev)

    @staticmethod
    def put(blocks_2d, slots, rows):
        """rows [m, 584] at global indices ``slots`` of a block-layout cache."""
        ps = L.ROWS_PER_BLOCK
        blk, off = (slots // ps).long(), (slots % ps).long()
        cols = torch.arange(L.DATA_BYTES, device=rows.device)
        blocks_2d[blk[:, None], (off * L.DATA_BYTES)[:, None] + cols] = rows[:, :L.DATA_BYTES]
        cols = torch.arange(L.SCALE_BYTES, device=rows.device)
        blocks_2d[blk[:, None], (L.SCALE_PLANE + off * L.SCALE_BYTES)[:, None] + cols] = \
            rows[:, L.DATA_BYTES:]

    def write_blocks(self, i: int, first: int, rows: torch.Tensor) -> None:
        pos = torch.arange(first, first + rows.shape[0], device=self.dev)
        slots = L.global_indices(self.block_table, torch.full((1,), i, device=self.dev),
                                 pos.view(1, -1).to(torch.int32)).view(-1)
        self.put(self.blocks_2d, slots, rows)

    def pool_view(self):
        """The hierarchy's device rows as FlashMLA reads them: in place, as one block."""
        rows = self.h.source("c4a").pool.device_rows
        return L.one_block_view(rows.storage, rows.num_rows)

    def draw(self, k_q: int, miss: float, step: int, batch: list[int] | None = None):
        """Top-k per query [n, k_q, k] int32 (-1 beyond each query's length) and lengths
        [n * k_q] int32, for the requests at ``batch`` (default all: n of them)."""
        batch = list(range(self.n)) if batch is None else batch
        n = len(batch)
        st = self.h.source("c4a").state
        ready = (st.page_table[[st.req_slot(self.ids[i]) for i in batch]] >= 0).cpu()
        plan = (ready, L.ROWS_PER_BLOCK, 12345 + step // 3)  # working set changes every 3
        n_rows = min(self.lens[i] for i in batch)
        sel = torch.stack([selections(self.cfg, plan, n_rows, miss, step * 8 + j, self.dev)[:, 0]
                           for j in range(k_q)], dim=1)  # [n, k_q, k]
        k = sel.shape[-1]
        g = torch.Generator().manual_seed(step)
        lens = torch.randint(k - k // 8, k + 1, (n * k_q,), generator=g).to(torch.int32)
        lens[0] = k  # one full row
        cut = torch.arange(k) >= lens.view(n, k_q, 1)
        sel = sel.masked_fill(cut.to(sel.device), -1)
        return sel, lens.to(self.dev)

    def append(self, batch: list[int] | None = None):
        """One decoded row per request (of ``batch``, default all), in both arms."""
        batch = list(range(self.n)) if batch is None else batch
        rows = torch.stack([self.truth[i, self.lens[i]] for i in batch])
        for j, i in enumerate(batch):
            self.write_blocks(i, self.lens[i], rows[j:j + 1])
            self.lens[i] += 1
        failed = self.h.append_batch("c4a", [self.ids[i] for i in batch], rows)
        assert not failed, failed

    def replace(self, i: int, seed: int) -> None:
        """Request i finishes; a new request with new rows takes its blocks and batch row."""
        self.h.finish(self.ids[i])
        g = torch.Generator(device=self.dev).manual_seed(seed)
        self.truth[i] = valid_rows(self.max_rows, g, self.dev)
        self.write_blocks(i, 0, self.truth[i])
        self.ids[i] = f"r{i}.{seed}"
        assert self.h.admit(self.ids[i], self.max_rows, {"c4a": self.truth[i, :self.lens[i]]})

    def inputs(self, k_q: int, step: int):
        t = self.n * k_q
        g = torch.Generator(device=self.dev).manual_seed(1000 + step)
        q = (torch.randn(t, 1, HEADS, 512, generator=g, device=self.dev) * 0.2).to(torch.bfloat16)
        swa_idx = torch.randint(0, SWA_BLOCKS * 64, (t, 1, SWA_TOPK), generator=g,
                                device=self.dev, dtype=torch.int32)
        swa_len = torch.full((t,), SWA_TOPK, dtype=torch.int32, device=self.dev)
        return q, L.block_view(self.swa, SWA_BLOCKS), swa_idx, swa_len

    def resident_indices(self, sel):
        n, k_q, k = sel.shape
        req = torch.arange(n, device=self.dev).repeat_interleave(k_q)
        return L.global_indices(self.block_table, req, sel.reshape(n * k_q, k)).view(n * k_q, 1, k)

    def resident_view(self):
        return L.block_view(self.blocks, self.blocks.numel() // L.BLOCK_STRIDE)


def equal(a, b) -> bool:
    return a is None and b is None or torch.equal(a, b)


def check_case(kernel, cfg, n, k_q, miss, dev, seed) -> dict:
    w = World(cfg, n, miss, dev, seed)
    res = dict(batch=n, queries=k_q, miss_target=miss, steps=[], passed=True)
    for step in range(cfg["steps"]):
        if step == 2 and n > 1:
            w.replace(n // 2, seed + 77)  # a finished request's place taken by a new one
        sel, lens = w.draw(k_q, miss, step)
        q, swa, swa_idx, swa_len = w.inputs(k_q, step)
        loc, counters = w.h.resolve("c4a", w.ids, sel, validate=True)
        t = n * k_q
        o_r, l_r = kernel(q, swa, swa_idx, swa_len, w.sink, w.pool_view(),
                          loc.view(t, 1, -1), lens)
        o_v, l_v = kernel(q, swa, swa_idx, swa_len, w.sink, w.resident_view(),
                          w.resident_indices(sel), lens)
        c = counters.sum(0).tolist()
        ok = torch.equal(o_r, o_v) and equal(l_r, l_v)
        res["steps"].append(dict(equal=ok, direct=c[0], hot=c[1], host=c[2], fetched=c[3],
                                 selected=int((sel >= 0).sum())))
        res["passed"] &= ok and c[4] == 0 and c[5] == 0
        if step == cfg["steps"] - 1:
            bad = loc.view(t, 1, -1).clone()
            bad[0, 0, 0] = (bad[0, 0, 0] + 1) % w.pool_view().shape[1]
            o_b, _ = kernel(q, swa, swa_idx, swa_len, w.sink, w.pool_view(), bad, lens)
            res["negative_control_differs"] = not torch.equal(o_b, o_v)
            res["passed"] &= res["negative_control_differs"]
            if kernel.fmla is not None and n <= 64:  # the reference runs on the CPU
                blocks = w.blocks.cpu()
                ref = sparse_decode(q.cpu(), L.block_view(w.swa.cpu(), SWA_BLOCKS),
                                    swa_idx.cpu(), swa_len.cpu(), w.sink.cpu(), SCALE,
                                    L.block_view(blocks, blocks.numel() // L.BLOCK_STRIDE),
                                    w.resident_indices(sel).cpu(), lens.cpu()).to(dev)
                diff = (ref.float() - o_v.float()).abs()
                res["reference_max_abs_diff"] = float(diff.max())
                res["reference_max_rel_diff"] = float(diff.max() / o_v.float().abs().max())
        w.append()
        w.h.step()
    res["host_share"] = (sum(s["host"] for s in res["steps"])
                         / max(1, sum(s["selected"] for s in res["steps"])))
    return res


def capture(fn):
    """``fn`` captured in a CUDA graph after a warm-up on a side stream (torch's recipe):
    (graph, what the captured call returned)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compiles, plans FlashMLA's tile schedule
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    # the default ("global") mode, as vLLM captures: a forbidden call anywhere fails it
    with torch.cuda.graph(graph):
        result = fn()
    return graph, result


def replay_without_syncs(graph) -> None:
    """Replays ``graph`` with torch's sync debug mode at "error": a synchronising call
    in the replayed work raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph.replay()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def graph_case(kernel, cfg, dev) -> dict:
    """resolve + routed FlashMLA in one CUDA graph, replayed over changing selections
    (fixed lengths: FlashMLA's tile schedule is planned for them)."""
    n, k_q, miss = cfg["graph_batch"], 1, 0.05
    w = World(cfg, n, miss, dev, seed=4242)
    fm = kernel.fmla
    sel0, lens = w.draw(k_q, miss, 0)
    lens.fill_(cfg["top_k"])
    sel_buf = torch.zeros_like(sel0)
    q_buf = torch.zeros(n, 1, HEADS, 512, dtype=torch.bfloat16, device=dev)
    _, swa, swa_idx, swa_len = w.inputs(k_q, 0)
    meta, _ = fm.get_mla_metadata()

    def routed():
        loc, _ = w.h.resolve("c4a", w.ids, sel_buf, validate=False)
        return fm.flash_mla_with_kvcache(
            q=q_buf, k_cache=swa, block_table=None, cache_seqlens=None, head_dim_v=512,
            tile_scheduler_metadata=meta, is_fp8_kvcache=True, indices=swa_idx,
            topk_length=swa_len, softmax_scale=SCALE, attn_sink=w.sink,
            extra_k_cache=w.pool_view(), extra_indices_in_kvcache=loc.view(n, 1, -1),
            extra_topk_length=lens)

    sel_buf.copy_(sel0)
    graph, (out, lse) = capture(routed)
    res = dict(batch=n, replays=[], passed=True)
    for r in range(cfg["replays"]):
        sel, _ = w.draw(k_q, miss, r + 1)
        sel = torch.where(sel >= 0, sel, sel0)  # full rows: the planned lengths
        q, _, _, _ = w.inputs(k_q, r + 1)
        sel_buf.copy_(sel)
        q_buf.copy_(q)
        replay_without_syncs(graph)
        o_v, l_v = kernel(q, swa, swa_idx, swa_len, w.sink, w.resident_view(),
                          w.resident_indices(sel), lens)
        ok = torch.equal(out, o_v) and torch.equal(lse, l_v)
        res["replays"].append(ok)
        res["passed"] &= ok
        w.h.step()
    return res


def routing_case(kernel, cfg, dev) -> dict:
    """The routed decode driven by vLLM's own decode metadata, as a FULL decode graph
    sees it: request slots found on the device (``flashmla/routing.py``) from the block
    table, ``seq_lens``, ``token_to_req_indices``, ``is_valid_token`` and a
    ``slot_by_block`` table written before each step; graph padding rows; between steps
    appends, a request replaced by a new one and a request that finishes (its row becomes
    padding).  On CUDA the routing and resolve are captured once and replayed under
    sync-debug "error" (FlashMLA follows eagerly, planned for the step's lengths;
    graph_case replays FlashMLA itself); on a CPU they run eagerly."""
    n, k_q, miss = cfg["routing_batch"], cfg["routing_queries"], 0.05
    w = World(cfg, n, miss, dev, seed=777)
    rows, k, ps = n + 2, cfg["top_k"], L.ROWS_PER_BLOCK  # two graph padding rows
    t = rows * k_q
    block_tokens = ps * 4  # 256 tokens of 4-token c4a rows per block
    i32 = dict(dtype=torch.int32, device=dev)
    block_table = torch.zeros(rows, w.block_table.shape[1], **i32)
    block_table[:n] = w.block_table
    seq_lens = torch.zeros(rows, **i32)
    token_to_req = torch.arange(rows, device=dev).repeat_interleave(k_q).to(torch.int32)
    is_valid = torch.zeros(t, dtype=torch.bool, device=dev)
    local = torch.full((t, k), -1, **i32)
    slot_by_block = torch.full((w.blocks.numel() // L.BLOCK_STRIDE,), -1, **i32)
    q_buf = torch.zeros(t, 1, HEADS, 512, dtype=torch.bfloat16, device=dev)
    _, swa, swa_idx0, swa_len0 = w.inputs(1, 0)
    swa_idx = swa_idx0[:1].expand(t, 1, SWA_TOPK).contiguous()
    swa_len = swa_len0[:1].expand(t).contiguous()

    def routed():
        slots = R.token_req_slots(slot_by_block, block_table, seq_lens, token_to_req,
                                  is_valid, block_tokens)
        sel, req_slots = R.group_queries(local, slots, k_q)
        loc, counters = w.h.resolve_req_slots("c4a", req_slots, sel)
        return loc, counters

    graph = None
    live = list(range(n))
    res = dict(batch=n, queries=k_q, padding_rows=rows - n, steps=[], passed=True)
    for step in range(cfg["steps"]):
        if step == 2:
            w.replace(0, seed=4343)  # a new request in the batch row of a finished one
        if step == 3 and n > 1:
            w.h.finish(w.ids[n - 1])  # its row is padding from now on
            live.remove(n - 1)
        sel, _ = w.draw(k_q, miss, step, live)
        valid = torch.zeros(rows, dtype=torch.bool, device=dev)
        valid[live] = True
        # the metadata vLLM would hand the step (written in place: a graph reads these)
        seq_lens.zero_()
        seq_lens[live] = torch.tensor([w.lens[i] * 4 + 1 for i in live], **i32)
        local.fill_(-1)
        local.view(rows, k_q, k)[live] = sel
        is_valid.copy_(valid.repeat_interleave(k_q))
        newest = block_table[live, (seq_lens[live].long() - 1) // block_tokens]
        R.write_slot_by_block(slot_by_block, newest, torch.tensor(
            [w.h.req_slot_of("c4a", w.ids[i]) for i in live], dtype=torch.int32))
        q_buf.zero_()  # padding tokens' queries
        q_buf[:n * k_q] = w.inputs(k_q, step)[0]
        if dev.type == "cuda":
            if graph is None:
                graph, (loc, counters) = capture(routed)
            replay_without_syncs(graph)
        else:
            loc, counters = routed()
        lens = R.topk_lengths(local, is_valid)
        # FlashMLA after the replay, with a schedule planned for this step's lengths
        # (graph_case replays FlashMLA itself, on a schedule planned once)
        out, lse = kernel(q_buf, swa, swa_idx, swa_len, w.sink, w.pool_view(),
                          loc.view(t, 1, k), lens)
        o_v, l_v = kernel(q_buf, swa, swa_idx, swa_len, w.sink, w.resident_view(),
                          L.global_indices(block_table, token_to_req, local).view(t, 1, k), lens)
        c = counters.sum(0).tolist()
        # padding rows read and count nothing
        ok = (torch.equal(out, o_v) and equal(lse, l_v)
              and int(counters[~valid].abs().sum()) == 0)
        res["steps"].append(dict(equal=ok, live=len(live), direct=c[0], hot=c[1], host=c[2],
                                 fetched=c[3], invalid=c[5]))
        res["passed"] &= ok and c[4] == 0 and c[5] == 0
        w.append(live)
        w.h.step()
    return res


def cuda_ms(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
          for _ in range(reps)]
    for a, b in ev:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return sorted(a.elapsed_time(b) for a, b in ev)[reps // 2]


def time_case(kernel, cfg, dev) -> dict:
    """V4-Flash decode shapes: T = 512 tokens, 64 heads, top-k 512 + SWA 128, 5 % of the
    selections fresh host rows."""
    n, miss = cfg["time_batch"], 0.05
    # 64K tokens of history (16K c4a rows) per session, far more than the B hot rows, so
    # fresh selections keep missing as they do at long context
    # a quarter of it on device: one block of all rows stays under 2**31 B (FlashMLA's
    # int block stride)
    w = World(dict(cfg, history=cfg["time_history"]), n, miss, dev, seed=99, resident=0.25)
    q, swa, swa_idx, swa_len = w.inputs(1, 0)
    draws = [w.draw(1, miss, s) for s in range(30)]
    sel0, lens = draws[0]
    resident_idx = w.resident_indices(sel0)
    fmla_ms = cuda_ms(lambda: kernel(q, swa, swa_idx, swa_len, w.sink, w.resident_view(),
                                     resident_idx, lens))
    it = iter(draws * 4)
    fetched = []

    def step():
        sel, ln = next(it)
        loc, counters = w.h.resolve("c4a", w.ids, sel, validate=False)
        fetched.append(counters[:, 3].sum())
        kernel(q, swa, swa_idx, swa_len, w.sink, w.pool_view(), loc.view(n, 1, -1), ln)

    routed_ms = cuda_ms(step)
    sel, ln = draws[0]
    loc, _ = w.h.resolve("c4a", w.ids, sel, validate=False)
    view = w.pool_view()
    fmla_routed_ms = cuda_ms(lambda: kernel(q, swa, swa_idx, swa_len, w.sink, view,
                                            loc.view(n, 1, -1), ln))
    resolve_it = iter(draws * 4)
    resolve_ms = cuda_ms(lambda: w.h.resolve("c4a", w.ids, next(resolve_it)[0], validate=False))
    # as vLLM's FULL decode graphs replay it: resolve + FlashMLA captured once, replayed
    # over new selections (full lengths: the tile schedule is planned for them)
    sel_buf = torch.where(sel0 >= 0, sel0, 0)
    full = torch.full_like(lens, cfg["top_k"])
    res_buf = w.resident_indices(sel_buf)
    meta_r, _ = kernel.fmla.get_mla_metadata()
    meta_v, _ = kernel.fmla.get_mla_metadata()

    def call(meta, view, idx):
        return kernel.fmla.flash_mla_with_kvcache(
            q=q, k_cache=swa, block_table=None, cache_seqlens=None, head_dim_v=512,
            tile_scheduler_metadata=meta, is_fp8_kvcache=True, indices=swa_idx,
            topk_length=swa_len, softmax_scale=SCALE, attn_sink=w.sink, extra_k_cache=view,
            extra_indices_in_kvcache=idx, extra_topk_length=full)

    def routed_call():
        loc, counters = w.h.resolve("c4a", w.ids, sel_buf, validate=False)
        call(meta_r, view, loc.view(n, 1, -1))
        return counters

    g_routed, graph_counters = capture(routed_call)
    g_resident, _ = capture(lambda: call(meta_v, w.resident_view(), res_buf))
    # selections never drawn before: their fresh rows miss (earlier draws are hot by now)
    filled = [torch.where(d[0] >= 0, d[0], sel_buf)
              for d in (w.draw(1, miss, 1000 + s) for s in range(40))]
    graph_fetched = []

    def replay_ms(graph, before, counters=None) -> float:
        times = []
        for sel in filled:
            before(sel)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            graph.replay()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
            if counters is not None:
                graph_fetched.append(int(counters[:, 3].sum()))
        return sorted(times[5:])[len(times[5:]) // 2]

    graph_resident_ms = replay_ms(g_resident, lambda sel: res_buf.copy_(w.resident_indices(sel)))
    graph_routed_ms = replay_ms(g_routed, lambda sel: sel_buf.copy_(sel), graph_counters)
    miss_rows = sorted(graph_fetched[5:])[len(graph_fetched[5:]) // 2]
    host = torch.empty(max(1, miss_rows) * 584, dtype=torch.uint8, pin_memory=True)
    devbuf = torch.empty_like(host, device=dev)
    copy_ms = cuda_ms(lambda: devbuf.copy_(host, non_blocking=True))
    overhead = graph_routed_ms - graph_resident_ms
    return dict(batch=n, fmla_ms=fmla_ms, fmla_routed_view_ms=fmla_routed_ms,
                routed_ms=routed_ms, resolve_ms=resolve_ms,
                graph_resident_ms=graph_resident_ms, graph_routed_ms=graph_routed_ms,
                routing_overhead_ms=overhead, miss_rows_per_step=miss_rows,
                eager_miss_rows_per_step=int(torch.stack(fetched).float().median()),
                miss_copy_ms=copy_ms, target_ms=1.25 * copy_ms + 0.020,
                within_target=overhead <= 1.25 * copy_ms + 0.020)


def plot(checks_json: str, timing_json: str, png: str) -> None:
    """The committed results as one figure: every routed-vs-resident case (host share of
    the selections, bitwise or not) and the graph-replayed cost next to the copy."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    checks, timing = (json.loads(Path(p).read_text()) for p in (checks_json, timing_json))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4))
    fig.suptitle(f"DeepSeek-V4 c4a decode routed through KVHierarchy vs vLLM 0.33 FlashMLA "
                 f"resident\n{checks['device']} | {checks['date']} | checks {checks['commit']}, "
                 f"timing {timing['commit']}", fontsize=9)
    cases = checks["cases"]
    names = [f"N{c['batch']} K{c['queries']} m{c['miss_target']:.2f}" for c in cases]
    a.bar(range(len(cases)), [c["host_share"] for c in cases],
          color=["tab:green" if c["passed"] else "tab:red" for c in cases])
    a.set_xticks(range(len(cases)), names, rotation=90, fontsize=6)
    a.set_ylabel("host-served share of selections")
    a.set_title(f"{sum(c['passed'] for c in cases)}/{len(cases)} cases bitwise (out, LSE); "
                f"graph replays {'ok' if checks['graph']['passed'] else 'FAIL'}", fontsize=9)
    t = timing["timing"]
    keys = [("graph_resident_ms", "FlashMLA\n(resident)"), ("graph_routed_ms", "resolve +\nFlashMLA"),
            ("routing_overhead_ms", "routing\noverhead"), ("miss_copy_ms", "pinned copy\nof misses"),
            ("target_ms", "target\n1.25 copy + 20 us")]
    b.bar(range(len(keys)), [t[k] * 1e3 for k, _ in keys], color="tab:blue")
    b.set_xticks(range(len(keys)), [label for _, label in keys], fontsize=8)
    b.set_ylabel("us per layer call (CUDA graph replay, median)")
    b.set_title(f"N={t['batch']} tokens, top-k 512 + SWA 128, 64 heads, "
                f"{t['miss_rows_per_step']} miss rows per call", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def setup(args, cfg: dict):
    """(device, kernel, the results' header) of a run from ``--fmla-dir`` / ``--commit``."""
    # --small is the CPU run (the tests), also on a GPU machine: the reference is CPU code
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.small else "cpu")
    kernel = Kernel(fmla_dir(args.fmla_dir, dev))
    commit = args.commit or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                                           capture_output=True, text=True).stdout.strip()
    out = dict(device=torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu",
               date=datetime.date.today().isoformat(), commit=commit, torch=torch.__version__,
               kernel="flashmla (vLLM 0.33.0 wheel)" if kernel.fmla else "torch reference",
               config=cfg)
    return dev, kernel, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", "--smoke", action="store_true", help="tiny shapes (CPU smoke run)")
    ap.add_argument("--fmla-dir", default=None,
                    help="folder holding vLLM 0.33's vllm/_flashmla_C.abi3.so and "
                         "vllm/third_party/flashmla (default ./.fmla where it exists; "
                         "without it or without CUDA: the torch reference)")
    ap.add_argument("--parts", default="checks,routing,graph,timing",
                    help="comma-separated: checks (routed vs resident cases), routing (from "
                         "vLLM's decode metadata, graph-captured on CUDA), graph, timing")
    ap.add_argument("--commit", default=None, help="commit recorded in the JSON (default: git's)")
    ap.add_argument("--plot", nargs=2, metavar=("CHECKS_JSON", "TIMING_JSON"),
                    help="draw committed results into --out (a PNG) and exit")
    args = ap.parse_args(argv)
    if args.plot:
        plot(*args.plot, args.out)
        return 0
    cfg = SMALL if args.small else FULL
    dev, kernel, out = setup(args, cfg)
    out.update(parts=args.parts, cases=[])
    t0 = time.time()
    ok = True
    parts = set(args.parts.split(","))
    for n in cfg["batches"] if "checks" in parts else ():
        for k_q in cfg["queries"]:
            for miss in cfg["misses"]:
                try:
                    r = check_case(kernel, cfg, n, k_q, miss, dev, seed=n * 100 + k_q * 10)
                except Exception as e:  # noqa: BLE001
                    r = dict(batch=n, queries=k_q, miss_target=miss, passed=False,
                             error=repr(e)[:2000], host_share=float("nan"))
                ok &= r["passed"]
                out["cases"].append(r)
                print(f"N={n:4d} Kq={k_q} miss={miss:.2f}: {'ok' if r['passed'] else 'FAIL'} "
                      f"host share {r['host_share']:.3f}", flush=True)
    if "routing" in parts:
        try:
            out["routing"] = routing_case(kernel, cfg, dev)
        except Exception as e:  # noqa: BLE001
            out["routing"] = dict(passed=False, error=repr(e)[:2000])
        ok &= out["routing"]["passed"]
        print("routing:", out["routing"], flush=True)
    for key, fn, cond in (("graph", graph_case, cfg["graph_batch"]),
                          ("timing", time_case, cfg["time_batch"])):
        if kernel.fmla is None or not cond or key not in parts:
            continue
        try:
            out[key] = fn(kernel, cfg, dev)
        except Exception as e:  # noqa: BLE001
            out[key] = dict(passed=False, error=repr(e)[:2000])
        ok &= out[key].get("passed", True)
        print(f"{key}:", out[key], flush=True)
    out["passed"], out["seconds"] = ok, round(time.time() - t0, 1)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("passed" if ok else "FAILED", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
