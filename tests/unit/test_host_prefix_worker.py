"""The worker half's host prefix order on fake vLLM caches (no model): a finished request is
captured in the step that reports it finished, before its rows are released, and reported
in ``finished_sending``; a preempted one in ``handle_preemptions`` only; a load writes the
entry into another request's blocks, c4a rows included, bytes as captured."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="WorkerSide logs through vLLM's logger")

from vllm_dhisparse.config import DHiSparseConfig  # noqa: E402
from vllm_dhisparse.integration.layers.model_probe import SparseLayer  # noqa: E402
from vllm_dhisparse.integration.metadata import (DHiSparseMetadata, PrefixCapture,  # noqa: E402
                                                 PrefixLoad, RequestStep)
from vllm_dhisparse.integration.worker.worker_side import WorkerSide  # noqa: E402

# group 0: the c4a layer (16 tokens per block); group 1: full attention, 16 tokens;
# group 2: a sliding window of 8 tokens in 4-token blocks.  Boundaries: 16 tokens.
C4A = SparseLayer("c4a", compress_ratio=4, top_k=4, row_bytes=6, rows_per_block=4, group=0,
                  plane_bytes=(4, 2))
NUM_BLOCKS = 64


def spec(bs, window=None):
    return SimpleNamespace(block_size=bs, sliding_window=window, extra_retained_tokens=0,
                           page_size_bytes=8)


def make_worker():
    cfg = DHiSparseConfig(hot_cache_rows=4, host_pool_gib=0.001, tail_pages=1,
                          optional_residency=False, device_window_tokens=0, host_prefix_gib=0.01)
    w = WorkerSide(cfg, [C4A], max_model_len=128, max_num_seqs=2, max_spec_queries=2,
                   device=torch.device("cpu"), host_prefix=True)
    g = torch.Generator().manual_seed(0)
    caches = {"c4a": torch.randint(0, 256, (NUM_BLOCKS, 24), dtype=torch.uint8, generator=g),
              "idx": torch.randint(0, 256, (NUM_BLOCKS, 8), dtype=torch.uint8, generator=g),
              "swa": torch.randint(0, 256, (NUM_BLOCKS, 8), dtype=torch.uint8, generator=g)}
    config = SimpleNamespace(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=spec(16), layer_names=["c4a"]),
        SimpleNamespace(kv_cache_spec=spec(16), layer_names=["idx"]),
        SimpleNamespace(kv_cache_spec=spec(4, 8), layer_names=["swa"])])
    w.register_kv_caches(caches, config)
    return w, caches


def prefill(w, rid, blocks, tokens=40):
    w.begin_step(DHiSparseMetadata(step=0, requests=[
        RequestStep(rid, 0, tokens, prompt_len=tokens, block_ids=blocks, replace_blocks=True,
                    max_tokens=8, completes_prefill=True)]))
    w.end_step()


A = ([1, 2, 3], [4, 5, 6], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16])  # 40 tokens
B = ([20, 21, 22], [23, 24, 25], [0, 0, 0, 0, 0, 0, 26, 27, 28, 29])  # resumes at 32


def test_finished_request_is_captured_before_release_and_loads_elsewhere():
    w, caches = make_worker()
    prefill(w, "a", A)
    assert w.requests["a"].admitted
    want_rows = w.vllm_cache.rows(C4A, A[0], torch.arange(8))  # 32 tokens: 8 rows
    want = {"idx": caches["idx"][[4, 5]].clone(), "swa": caches["swa"][[13, 14]].clone()}
    w.begin_step(DHiSparseMetadata(step=1, finished={"a"},
                                   prefix_captures=[PrefixCapture(0, "a", 32)]))
    w.end_step()
    assert "a" not in w.hierarchy.requests  # released after the capture
    assert w.transfer_results()[0] == {"a"}  # finished_sending: vLLM frees its blocks now
    assert w.take_prefix_reports() == (set(), {0})
    for cache in caches.values():  # the blocks are reused by other requests
        cache.zero_()
    w.begin_step(DHiSparseMetadata(step=2, prefix_loads=[PrefixLoad("b", 0, 0, 32, B)]))
    w.end_step()
    assert w.transfer_results() == (set(), {"b"}, set())
    assert torch.equal(w.vllm_cache.rows(C4A, B[0], torch.arange(8)), want_rows)
    assert torch.equal(caches["idx"][[23, 24]], want["idx"])
    assert torch.equal(caches["swa"][[26, 27]], want["swa"])  # the window at 32: blocks 6, 7
    assert caches["swa"][28:31].eq(0).all()  # beyond the entry: left to the prefill
    hp = w.summary()["host_prefix"]
    assert hp["captured"] == hp["loads"] == 1 and hp["tokens_loaded"] == 32


def test_preempted_request_is_captured_only_in_handle_preemptions():
    w, _ = make_worker()
    prefill(w, "a", A)
    meta = DHiSparseMetadata(step=1, preempted={"a"},
                             prefix_captures=[PrefixCapture(3, "a", 32)])
    w.capture_preempted(meta)  # no block of "a" rewritten before it
    w.begin_step(meta)
    w.end_step()
    assert w.take_prefix_reports() == (set(), {3})
    assert w.transfer_results()[0] == set()  # vLLM freed a preempted request's blocks itself
    # without handle_preemptions (a model runner that does not call it) the blocks may be
    # zeroed already: the entry is lost, not captured
    prefill(w, "c", A)
    w.begin_step(DHiSparseMetadata(step=3, preempted={"c"},
                                   prefix_captures=[PrefixCapture(4, "c", 32)]))
    w.end_step()
    assert w.take_prefix_reports() == ({4}, set())


@pytest.mark.parametrize("rewritten, captured", [({5, 40}, False), ({40, 41}, True),
                                                  ({6, 3, 13}, True)],
                         ids=["a_block_it_reads", "others_only", "blocks_it_does_not_read"])
def test_a_preempted_request_whose_blocks_were_rewritten_is_given_up(rewritten, captured):
    """Model runner V2 calls handle_preemptions after zeroing the step's new blocks: a
    preempted request one of whose freed blocks went to another request is not captured."""
    w, _ = make_worker()
    # a capture at 32 tokens reads blocks 4, 5 (group 1); 6 is past it, 3 holds c4a rows the
    # hierarchy holds, 13 is a window block (snapshot after the forward that passed 32)
    prefill(w, "a", A)
    meta = DHiSparseMetadata(step=1, preempted={"a"}, rewritten_blocks=frozenset(rewritten),
                             prefix_captures=[PrefixCapture(3, "a", 32)])
    w.capture_preempted(meta)
    w.begin_step(meta)
    w.end_step()
    assert w.take_prefix_reports() == ((set(), {3}) if captured else ({3}, set()))
    assert w.summary()["host_prefix"]["capture_failed"] == (0 if captured else 1)


def test_a_failed_load_is_reported_and_its_entry_lost():
    w, _ = make_worker()
    w.begin_step(DHiSparseMetadata(step=0, prefix_loads=[PrefixLoad("b", 9, 0, 32, B)]))
    w.end_step()
    assert w.transfer_results() == (set(), {"b"}, {"b"})
    assert w.take_prefix_reports() == ({9}, set())


def test_the_worker_class_captures_a_preempted_request_before_the_model_runner(monkeypatch):
    """DHiSparseWorker.execute_model runs handle_preemptions before the model runner (which
    zeroes the step's new blocks first); the runner's own later call changes nothing."""
    from vllm_dhisparse.integration.worker import worker as worker_mod
    w, caches = make_worker()
    prefill(w, "a", A)
    want = caches["idx"][[4, 5]].clone()
    meta = DHiSparseMetadata(step=1, preempted={"a"}, rewritten_blocks=frozenset({5}),
                             prefix_captures=[PrefixCapture(3, "a", 32)])
    connector = SimpleNamespace(dhisparse_worker=w)
    monkeypatch.setattr(worker_mod, "get_kv_transfer_group", lambda: connector)

    def runner(self, scheduler_output):  # model runner V2: zeroes block 5, then the hook
        caches["idx"][5] = 0
        w.capture_preempted(scheduler_output.kv_connector_metadata)
        return "out"
    monkeypatch.setattr(worker_mod._Base, "execute_model", runner)
    cls = object.__new__(worker_mod.DHiSparseWorker)
    assert cls.execute_model(SimpleNamespace(kv_connector_metadata=meta)) == "out"
    w.begin_step(meta)
    w.end_step()
    assert w.take_prefix_reports() == (set(), {3})  # captured, before the zeroing
    assert torch.equal(w.host_prefix.entries[3].blocks["idx"][1], want)


def test_a_boundary_passed_under_async_speculation_is_snapshotted_once_verified():
    """An asynchronous scheduler counts the previous step's draft before its verification
    (``num_unverified_tokens``): the window at boundary 48 is snapshotted in the step whose
    verified tokens pass it, not lost between the optimistic count and the verified one."""
    w, _ = make_worker()
    prefill(w, "a", A)
    store = w.host_prefix
    for step, (computed, new_blocks) in enumerate([(41, [17]), (43, []), (45, [18]),
                                                   (47, []), (49, [19])], start=1):
        w.begin_step(DHiSparseMetadata(step=step, requests=[
            RequestStep("a", computed, 2, prompt_len=40, block_ids=([], [], new_blocks),
                        replace_blocks=False, max_tokens=16, num_spec_tokens=1,
                        num_unverified_tokens=1 if step > 1 else 0)]))
        w.end_step()
    # the last step: 48 verified tokens before it, 49 after it at least
    assert store.snapshots["a"].num_tokens == 48
