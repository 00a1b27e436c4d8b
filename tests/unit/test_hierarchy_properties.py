"""Stateful property test: random admit / append / resolve / step / finish / preempt
sequences over two sources keep every invariant (check_invariants after every step)
and every request's resolved bytes equal its own ground truth (eq. 12), whatever
the other requests do (reclaim by admission, repopulation, tail backups).

On CUDA the same machine runs with realistic asynchrony: every appended or
imported row is produced by GPU work that is still in flight (queued behind a
busy-wait kernel) when the hierarchy starts backing it up, and resolution runs
the Triton kernels.  A backup that read its rows before they landed stores wrong
bytes, which the invariant check (host rows marked backed) and the resolved
bytes catch."""
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from vllm_dhisparse.hierarchy.hierarchy import KVHierarchy
from vllm_dhisparse.hierarchy.invariants import check_invariants
from vllm_dhisparse.hierarchy.reclaim_policies import RECLAIM_POLICIES

# Small odd widths and page sizes; device pools small enough that admissions reclaim.
SOURCES = [
    dict(name="a", row_bytes=3, page_size=2, device_pages=30, host_rows=180, hot_cache_rows=3,
         tail_pages=1, max_req_slots=6, max_rows=30),  # K*k - B <= 4*2 - 3
    dict(name="b", row_bytes=5, page_size=3, device_pages=34, host_rows=180, hot_cache_rows=4,
         tail_pages=2, max_req_slots=6, max_rows=30,  # K*k - B <= 4*3 - 4
         plane_bytes=(4, 1)),  # rows stored in two planes, like fp8_ds_mla's 576 + 8 bytes
]
MAX_K = {"a": 2, "b": 3}
STAGING = dict(arenas=1, columns=8)  # one arena per row layout, the widest overflow
WIDTH = {s["name"]: s["row_bytes"] for s in SOURCES}


def random_rows(n, width, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, width), dtype=torch.uint8, generator=g)


class HierarchyMachine(RuleBasedStateMachine):
    device = "cpu"

    def produce(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows as the model would hand them over (here: already computed)."""
        return rows

    @initialize(policy=st.sampled_from(sorted(RECLAIM_POLICIES)), reserve=st.integers(0, 2),
                optional=st.booleans(), eager=st.booleans(), repop=st.integers(1, 3),
                run=st.integers(1, 3))
    def build(self, policy, reserve, optional, eager, repop, run):
        # short runs: placement, reclaim and tail backup copies split
        self.h = KVHierarchy(SOURCES, reclaim_policy=policy, admission_reserve_pages=reserve,
                             optional_residency=optional, eager_backup=eager,
                             repopulate_pages_per_step=repop, run_pages=run,
                             device=self.device, staging=STAGING)
        self.truth: dict[str, dict[str, torch.Tensor]] = {}
        self.max_rows: dict[str, int] = {}
        self.next_id = 0

    def snapshot(self):
        return [(p.pool.num_free, sorted(p.pool._used), p.state.page_table.tolist(),
                 {r: (dict(x.optional), sorted(x.pending)) for r, x in p.residency.requests.items()})
                for p in self.h.sources.values()]

    @precondition(lambda self: len(self.truth) < 5)  # beyond that nearly every admission waits
    @rule(n_a=st.integers(0, 24), n_b=st.integers(0, 24), max_rows=st.integers(24, 30),
          seed=st.integers(0, 2**16))
    def admit(self, n_a, n_b, max_rows, seed):
        req = f"r{self.next_id}"
        self.next_id += 1
        imported = {"a": random_rows(n_a, 3, seed), "b": random_rows(n_b, 5, seed + 1)}
        before = self.snapshot()
        if self.h.admit(req, max_rows, {k: self.produce(v) for k, v in imported.items()}):
            self.truth[req] = {k: v.clone() for k, v in imported.items()}
            self.max_rows[req] = max_rows
        else:  # "wait": nothing reclaimed, nothing allocated
            assert self.snapshot() == before

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), n=st.integers(1, 5), seed=st.integers(0, 2**16))
    def append(self, data, n, seed):
        req = data.draw(st.sampled_from(sorted(self.truth)))
        src = data.draw(st.sampled_from(["a", "b"]))
        n = min(n, self.max_rows[req] - self.truth[req][src].shape[0])
        if n <= 0:
            return
        rows = random_rows(n, WIDTH[src], seed)
        self.h.append(req, src, self.produce(rows))
        self.truth[req][src] = torch.cat([self.truth[req][src], rows])

    @precondition(lambda self: self.truth)
    @rule(data=st.data())
    def resolve(self, data):
        src = data.draw(st.sampled_from(["a", "b"]))
        reqs = data.draw(st.lists(st.sampled_from(sorted(self.truth)), min_size=1, max_size=3,
                                  unique=True))
        n_queries = data.draw(st.integers(1, 4))
        top_k = data.draw(st.integers(1, MAX_K[src]))
        sel = torch.full((len(reqs), n_queries, top_k), -1, dtype=torch.int32)
        for i, r in enumerate(reqs):
            n = self.truth[r][src].shape[0]
            values = data.draw(st.lists(st.integers(-1, n - 1), min_size=n_queries * top_k,
                                        max_size=n_queries * top_k))  # duplicates and -1 allowed
            sel[i] = torch.tensor(values, dtype=torch.int32).view(n_queries, top_k)
        pool = self.h.sources[src].pool
        with self.h.staging_arena(src) as arena:  # attention reads while the layer holds it
            loc, counters = self.h.resolve(src, reqs, sel.to(self.device), arena=arena)
            loc, counters = loc.cpu(), counters.cpu()
            for i, r in enumerate(reqs):
                m = sel[i] >= 0
                assert bool((loc[i][~m] == -1).all()), f"padding of {r} got a location"
                got = pool.read(loc[i][m].long()).cpu()
                assert torch.equal(got, self.truth[r][src][sel[i][m].long()]), \
                    f"request {r} source {src}: resolved bytes differ from its rows"
                assert int(counters[i, :3].sum()) == int(m.sum())

    @rule()
    def step(self):
        self.h.step()

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), n=st.integers(1, 5), seed=st.integers(0, 2**16))
    def append_and_step(self, data, n, seed):
        """Tail backups start while the rows they copy may still be in flight."""
        self.append(data, n, seed)
        self.h.step()

    @precondition(lambda self: self.truth)
    @rule(data=st.data(), preempt=st.booleans())
    def release(self, data, preempt):
        req = data.draw(st.sampled_from(sorted(self.truth)))
        (self.h.preempt if preempt else self.h.finish)(req)
        del self.truth[req], self.max_rows[req]

    @invariant()
    def consistent(self):
        if hasattr(self, "h"):
            check_invariants(self.h, self.truth)

    @invariant()
    def history_reads_back(self):
        """``read_history`` (what a host prefix capture copies) returns every request's
        rows, wherever each page lives now."""
        for req, rows in getattr(self, "truth", {}).items():
            for name, want in rows.items():
                got = self.h.read_history(req, name, want.shape[0])
                assert torch.equal(got, want.cpu()), (req, name)


HierarchyMachine.TestCase.settings = settings(
    max_examples=50, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestHierarchyProperties = HierarchyMachine.TestCase


class AsyncCudaHierarchyMachine(HierarchyMachine):
    # an explicit index: the hierarchy must treat it as the same GPU as plain "cuda"
    device = "cuda:0"

    def produce(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows land on the GPU ~2 ms after this returns: the copy that produces them is
        queued behind a busy-wait kernel on the compute stream."""
        out = torch.empty(rows.shape, dtype=rows.dtype, device=self.device)
        torch.cuda._sleep(4_000_000)
        out.copy_(rows.pin_memory(), non_blocking=True)
        return out


AsyncCudaHierarchyMachine.TestCase.settings = settings(
    max_examples=25, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestAsyncCudaHierarchyProperties = pytest.mark.cuda(pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")(AsyncCudaHierarchyMachine.TestCase))
