"""The routed c4a decode as vLLM's FlashMLA layer calls it (``flashmla/decode.py``),
held to FlashMLA on vLLM's blocks (H200; the torch reference on a CPU).

One ``RoutedDecode`` per run; every step writes vLLM-shaped decode metadata into fixed
buffers -- block table, ``seq_lens``, ``query_start_loc``, ``token_to_req_indices``,
``is_valid_token``, the indexer's top-k -- and ``RoutedDecode.locations`` turns them
into storage rows (captured once in a CUDA graph on CUDA and replayed under sync-debug
"error"; eager on a CPU).  What changes between steps: 1..K_max queries per request
(ragged), 0..2 rows the compressor wrote in the step itself (in vLLM's blocks only,
selected by the step's queries; committed to the hierarchy after the step), graph
padding tokens and padding rows whose block-table rows are stale copies of a live
row's, and a request the hierarchy does not hold.  Checked per step: FlashMLA's output
and LSE on the hierarchy's storage equal FlashMLA on vLLM's blocks bitwise for every
token the hierarchy serves, and the counters name exactly the fresh selections and the
unrouted tokens.  Writes JSON; exits 1 on any mismatch.

    python benchmarks/gpu_fmla_decode.py --out x.json              (H200, via gpu_check.sh)
    python benchmarks/gpu_fmla_decode.py --small --out /tmp/x.json (CPU)
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from gpu_fmla_routed import HEADS, SMALL as R_SMALL, FULL as R_FULL  # noqa: E402
from gpu_fmla_routed import (World, capture, equal, replay_without_syncs,  # noqa: E402
                             setup)

from vllm_dhisparse.flashmla import decode as D  # noqa: E402
from vllm_dhisparse.flashmla import layout as L  # noqa: E402

FULL = dict(R_FULL, batch=64, max_queries=3, fresh_rows=2)
SMALL = dict(R_SMALL, batch=5, max_queries=3, fresh_rows=2)
PAD_ROWS, PAD_TOKENS = 2, 3


class Scenario:
    """n requests in vLLM's blocks, n - 1 of them in a KVHierarchy, and one
    ``RoutedDecode``; :meth:`steps` writes each step's decode metadata into fixed
    buffers (``bufs``, ``q``) and yields what the counters must show."""

    def __init__(self, cfg: dict, dev):
        n, kmax, f_max, k = cfg["batch"], cfg["max_queries"], cfg["fresh_rows"], cfg["top_k"]
        self.cfg, self.dev, self.n = cfg, dev, n
        # staging rows per request: overflow misses (K_max * k beyond the hot cache) + fresh
        overflow = max(0, kmax * k - cfg["hot"])
        self.w = w = World(cfg, n, 0.05, dev, seed=515,
                           staging=dict(arenas=1, columns=overflow + f_max))
        self.outsider = n - 1  # in vLLM's batch, not in the hierarchy
        w.h.finish(w.ids[self.outsider])
        self.num_blocks = w.blocks.numel() // L.BLOCK_STRIDE
        self.rd = D.RoutedDecode(w.h, "c4a", num_vllm_blocks=self.num_blocks, max_queries=kmax,
                                 fresh_rows=f_max, staging=w.h.staging[0].table[0])
        self.rows, self.t = n + PAD_ROWS, n * kmax + PAD_TOKENS
        i32 = dict(dtype=torch.int32, device=dev)
        self.bufs = dict(local=torch.full((self.t, k), -1, **i32),
                         token_to_req=torch.zeros(self.t, **i32),
                         query_start_loc=torch.zeros(self.rows + 1, **i32),
                         block_table=torch.zeros(self.rows, w.block_table.shape[1], **i32),
                         seq_lens=torch.zeros(self.rows, **i32),
                         is_valid=torch.zeros(self.t, dtype=torch.bool, device=dev))
        self.cache = L.block_view(w.blocks, self.num_blocks)  # vLLM's c4a blocks
        self.q = torch.zeros(self.t, 1, HEADS, 512, dtype=torch.bfloat16, device=dev)
        _, self.swa, swa_idx0, swa_len0 = w.inputs(1, 0)
        self.swa_idx = swa_idx0[:1].expand(self.t, 1, -1).contiguous()
        self.swa_len = swa_len0[:1].expand(self.t).contiguous()

    def locations(self):
        b = self.bufs
        return self.rd.locations(b["local"], b["token_to_req"], b["query_start_loc"],
                                 b["block_table"], b["seq_lens"], b["is_valid"], self.cache)

    def served(self) -> torch.Tensor:
        """Tokens the hierarchy serves.  # [T] bool"""
        return self.bufs["is_valid"] & (self.bufs["token_to_req"] != self.outsider)

    def steps(self):
        cfg, w, n, b = self.cfg, self.w, self.n, self.bufs
        kmax, f_max, k = cfg["max_queries"], cfg["fresh_rows"], cfg["top_k"]
        i32 = dict(dtype=torch.int32, device=self.dev)
        routed_reqs = [i for i in range(n) if i != self.outsider]
        g = torch.Generator().manual_seed(5)
        for step in range(cfg["steps"]):
            queries = [1 + (i + step) % kmax for i in range(n)]
            fresh = [(i + step) % (f_max + 1) for i in range(n)]
            for i in range(n):  # the compressor's rows of this step: in vLLM's blocks only
                if fresh[i]:
                    w.write_blocks(i, w.lens[i], w.truth[i, w.lens[i]:w.lens[i] + fresh[i]])
            sel, _ = w.draw(kmax, 0.05, step, routed_reqs)  # [n-1, kmax, k] committed rows
            out_sel = torch.randint(0, w.lens[self.outsider], (1, kmax, k), generator=g)
            sel = torch.cat([sel, out_sel.to(sel)])
            local, token_to_req, qsl = [], [], [0]
            expect_fresh = 0
            for i in range(n):
                for j in range(queries[i]):
                    s = sel[i, j].clone()
                    if fresh[i]:  # the last selected rows of the query: rows of this step
                        last = int((s >= 0).sum()) - 1
                        for m in range(min(fresh[i], last + 1)):
                            s[last - m] = w.lens[i] + (j + m) % fresh[i]
                        expect_fresh += min(fresh[i], last + 1) if i != self.outsider else 0
                    local.append(s)
                    token_to_req.append(i)
                qsl.append(qsl[-1] + queries[i])
            real = len(local)
            b["local"].fill_(-1)
            b["local"][:real] = torch.stack(local)
            b["token_to_req"].zero_()  # padding tokens point at row 0: they stay unrouted
            b["token_to_req"][:real] = torch.tensor(token_to_req, **i32)
            b["is_valid"].zero_()
            b["is_valid"][:real] = True
            b["query_start_loc"].fill_(real)
            b["query_start_loc"][:n + 1] = torch.tensor(qsl, **i32)
            b["block_table"][:n] = w.block_table
            b["block_table"][n:] = w.block_table[0]  # stale copies of a live row
            b["seq_lens"][:n] = torch.tensor([4 * (w.lens[i] + fresh[i]) + i % 4
                                              for i in range(n)], **i32)
            b["seq_lens"][n:] = b["seq_lens"][0]  # stale too: the rows have no valid token
            newest = b["block_table"][routed_reqs,
                                      (b["seq_lens"][routed_reqs].long() - 1) // 256]
            D.R.write_slot_by_block(self.rd.slot_by_block, newest, torch.tensor(
                [w.h.req_slot_of("c4a", w.ids[i]) for i in routed_reqs], dtype=torch.int32))
            self.q.zero_()
            self.q[:real] = w.inputs(kmax, step)[0][:real]
            yield dict(tokens=real, fresh=expect_fresh, unrouted=queries[self.outsider])
            for i in range(n):  # the step's rows are committed before the next step
                if fresh[i] and i != self.outsider:
                    w.h.append(w.ids[i], "c4a", w.truth[i, w.lens[i]:w.lens[i] + fresh[i]])
                w.lens[i] += fresh[i]
            w.h.step()


def decode_case(kernel, cfg, dev) -> dict:
    sc = Scenario(cfg, dev)
    t, k = sc.t, cfg["top_k"]
    b, w = sc.bufs, sc.w
    graph = None
    res = dict(batch=sc.n, max_queries=cfg["max_queries"], fresh_rows=cfg["fresh_rows"],
               steps=[], passed=True)
    for want in sc.steps():
        if dev.type == "cuda" and graph is None:  # its warm-up call counts too: before
            graph, (loc, lens) = capture(sc.locations)
        before = sc.rd.counters.clone()
        if dev.type == "cuda":
            replay_without_syncs(graph)
        else:
            loc, lens = sc.locations()
        counters = (sc.rd.counters - before).tolist()
        o_r, l_r = kernel(sc.q, sc.swa, sc.swa_idx, sc.swa_len, w.sink, w.pool_view(),
                          loc.view(t, 1, k), lens)
        o_v, l_v = kernel(sc.q, sc.swa, sc.swa_idx, sc.swa_len, w.sink, w.resident_view(),
                          L.global_indices(b["block_table"], b["token_to_req"],
                                           b["local"]).view(t, 1, k), lens)
        served = sc.served()
        # tokens the hierarchy does not serve (padding, the outsider) read no row at all
        ok = torch.equal(o_r[served], o_v[served]) and (
            l_r is None or equal(l_r[served], l_v[served])) and bool((loc[~served] == -1).all())
        counted = (counters[D.COUNTER_FRESH] == want["fresh"]
                   and counters[D.COUNTER_UNROUTED] == want["unrouted"]
                   and int(sc.rd.lost_by_slot.sum()) == 0)
        res["steps"].append(dict(equal=ok, counted=counted, tokens=want["tokens"],
                                 fresh_selections=counters[D.COUNTER_FRESH],
                                 unrouted=counters[D.COUNTER_UNROUTED]))
        res["passed"] &= ok and counted
    res["invalid_selections"] = w.h.invalid_selections()["c4a"]
    res["passed"] &= res["invalid_selections"] == 0
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", "--smoke", action="store_true", help="tiny shapes (CPU run; CI runs it)")
    ap.add_argument("--fmla-dir", default=None,
                    help="folder holding vLLM 0.33's FlashMLA (default ./.fmla where it "
                         "exists; without it or without CUDA: the torch reference)")
    ap.add_argument("--commit", default=None, help="commit recorded in the JSON (default: git's)")
    args = ap.parse_args(argv)
    cfg = SMALL if args.small else FULL
    dev, kernel, out = setup(args, cfg)
    t0 = time.time()
    try:
        out["decode"] = decode_case(kernel, cfg, dev)
    except Exception as e:  # noqa: BLE001
        out["decode"] = dict(passed=False, error=repr(e)[:2000])
    out["passed"], out["seconds"] = out["decode"]["passed"], round(time.time() - t0, 1)
    print("decode:", out["decode"], flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1))
    print("passed" if out["passed"] else "FAILED", args.out)
    return 0 if out["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
