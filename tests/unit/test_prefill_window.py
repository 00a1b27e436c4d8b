"""When the c4a window may free blocks: only after a request's (re)prefill is complete.

The scheduler half decides per step (chunked prefill, prefix hits, resumption
after preemption) and records the computed-token count in its ``window_from``
register, which the scheduler class hands to the window managers; the window manager
frees nothing for a request before that.  No vLLM engine: fake
requests and scheduler outputs, and the manager's method on a fake manager.
"""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from vllm_dhisparse.integration.kv_spec import DHiSparseWindowManager
from vllm_dhisparse.integration.engine_core.scheduler_side import SchedulerSide


def request(rid: str, prompt: int, outputs: int = 0):
    return SimpleNamespace(request_id=rid, num_prompt_tokens=prompt, num_tokens=prompt + outputs,
                           sampling_params=SimpleNamespace(max_tokens=16))


def output(new=(), cached=(), resumed=(), preempted=(), finished=(), drafts=None):
    """new / cached: (rid, num_computed_tokens, num_scheduled_tokens)."""
    return SimpleNamespace(
        scheduled_spec_decode_tokens=drafts or {},
        scheduled_new_reqs=[SimpleNamespace(req_id=r, num_computed_tokens=c, block_ids=([1],),
                                            prompt_token_ids=None) for r, c, _ in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], num_computed_tokens=[c for _, c, _ in cached],
            new_block_ids=[([2],) for _ in cached], resumed_req_ids=set(resumed)),
        num_scheduled_tokens={r: n for r, _, n in (*new, *cached)},
        preempted_req_ids=set(preempted), finished_req_ids=set(finished))


def completes(meta) -> dict[str, bool]:
    return {rs.req_id: rs.completes_prefill for rs in meta.requests}


@pytest.fixture
def side():
    return SchedulerSide(max_model_len=8192)


def test_chunked_prefill_completes_on_its_last_chunk(side):
    side.on_new_request(request("a", 2600))
    assert completes(side.build_connector_meta(output(new=[("a", 0, 1000)]))) == {"a": False}
    assert completes(side.build_connector_meta(output(cached=[("a", 1000, 1000)]))) == {"a": False}
    assert "a" not in side.window_from  # the second and third chunks read the first one's blocks
    assert completes(side.build_connector_meta(output(cached=[("a", 2000, 600)]))) == {"a": True}
    assert side.window_from["a"] == 2600
    assert completes(side.build_connector_meta(output(cached=[("a", 2600, 1)]))) == {"a": False}


def test_prefix_hit_then_the_rest_of_the_prompt(side):
    side.on_new_request(request("b", 3000))
    meta = side.build_connector_meta(output(new=[("b", 2816, 184)]))
    assert completes(meta) == {"b": True} and side.window_from["b"] == 3000


def test_preemption_restarts_the_prefill_over_prompt_and_outputs(side):
    req = request("c", 2600)
    side.on_new_request(req)
    side.build_connector_meta(output(new=[("c", 0, 2600)]))
    assert side.window_from["c"] == 2600
    req.num_tokens = 2610  # ten outputs, then preempted: every block freed
    side.build_connector_meta(output(preempted=["c"]))
    assert "c" not in side.window_from
    # resumed with a prefix hit, re-prefilled in chunks: the prompt alone is not enough
    meta = side.build_connector_meta(output(cached=[("c", 2304, 300)], resumed=["c"]))
    assert completes(meta) == {"c": False} and "c" not in side.window_from
    meta = side.build_connector_meta(output(cached=[("c", 2604, 6)]))
    assert completes(meta) == {"c": True} and side.window_from["c"] == 2610


def test_preempted_and_resumed_in_one_step(side):
    req = request("d", 1000)
    side.on_new_request(req)
    side.build_connector_meta(output(new=[("d", 0, 1000)]))
    req.num_tokens = 1003
    meta = side.build_connector_meta(output(cached=[("d", 0, 1003)], resumed=["d"],
                                            preempted=["d"]))
    assert completes(meta) == {"d": True} and side.window_from["d"] == 1003


def test_placeholder_drafts_are_not_prefill(side):
    """vLLM pads a one-token step of a waiting request to 1 + K with placeholder drafts."""
    side.on_new_request(request("f", 3000))
    meta = side.build_connector_meta(output(new=[("f", 2999, 4)], drafts={"f": [-1, -1, -1]}))
    (rs,) = meta.requests
    assert rs.completes_prefill and rs.num_spec_tokens == 3 and side.window_from["f"] == 3000


def test_drafts_counted_before_their_output_arrived_are_unverified(side):
    """vLLM's asynchronous scheduler counts a step's 1 + K output placeholders until the
    step's output arrives: all but one may be rejected drafts."""
    req = request("g", 3000)
    side.on_new_request(req)
    meta = side.build_connector_meta(output(cached=[("g", 3004, 4)], drafts={"g": [-1] * 3}))
    assert meta.requests[0].num_unverified_tokens == 0  # no step in flight (synchronous)
    req.num_output_placeholders = 4
    meta = side.build_connector_meta(output(cached=[("g", 3008, 4)], drafts={"g": [-1] * 3}))
    assert meta.requests[0].num_unverified_tokens == 3


def test_streaming_input_session_keeps_its_blocks_and_prefills_each_turn(side):
    req = request("s", 500)
    req.resumable = True
    side.on_new_request(req)
    assert completes(side.build_connector_meta(output(new=[("s", 0, 500)]))) == {"s": True}
    assert "s" not in side.window_from  # its blocks are the next turn's prefix: never windowed
    req.num_tokens = 900  # turn 2 appended to prompt and outputs; scheduled as new again
    meta = side.build_connector_meta(output(new=[("s", 510, 390)]))
    assert completes(meta) == {"s": True} and "s" not in side.window_from


def test_finish_forgets_the_request(side):
    req = request("e", 600)
    side.on_new_request(req)
    side.build_connector_meta(output(new=[("e", 0, 600)]))
    side.request_finished(req)
    assert "e" not in side.window_from
    assert side.build_connector_meta(output()).finished == {"e"}


class FakeManager:
    """What ``remove_skipped_blocks`` uses of a vLLM single-type manager."""
    block_size = 64

    def __init__(self, window: int, blocks: int):
        self.device_window_tokens = window
        self.req_to_blocks = {"r": list(range(blocks))}
        self.freed: list[tuple[int, int]] = []

    def _remove_blocks_in_range(self, rid, first, last):
        self.freed.append((first, last))

    remove_skipped_blocks = DHiSparseWindowManager.remove_skipped_blocks


@pytest.mark.parametrize("start,processed,freed", [
    (None, 3000, []),  # prefill (or prefix hit) not complete: nothing skipped
    (2600, 2000, []),  # chunked prefill still below its end
    (2600, 2600, [(0, 32)]),  # (2600 - 512) // 64 whole blocks behind the window
    (2600, 2700, [(0, 34)]),
    (400, 450, []),  # the window covers everything
])
def test_window_manager_frees_only_after_the_prefill(side, start, processed, freed):
    if start is not None:
        side.window_from["r"] = start
    m = FakeManager(window=512, blocks=50)
    m.window_from = side.window_from  # what DHiSparseScheduler hands it
    m.remove_skipped_blocks("r", processed, num_prompt_tokens=2600)
    assert m.freed == freed


def test_a_window_manager_without_the_register_stops_with_the_fix():
    m = FakeManager(window=512, blocks=50)
    m.window_from = None
    with pytest.raises(RuntimeError, match="must run DHiSparseScheduler"):
        m.remove_skipped_blocks("r", 3000, num_prompt_tokens=2600)


def test_the_scheduler_class_hands_the_register_to_its_window_managers(side):
    from vllm_dhisparse.compat.targets import IntegrationError
    from vllm_dhisparse.integration.engine_core.scheduler import share_prefill_register
    ours, other = object.__new__(DHiSparseWindowManager), SimpleNamespace()
    ours.window_from = None
    coordinator = SimpleNamespace(single_type_managers=(other, ours))
    scheduler = SimpleNamespace(connector=SimpleNamespace(scheduler_side=side),
                                kv_cache_manager=SimpleNamespace(coordinator=coordinator))
    share_prefill_register(scheduler)
    assert ours.window_from is side.window_from and not hasattr(other, "window_from")
    scheduler.kv_cache_manager = SimpleNamespace()  # a vLLM that keeps them elsewhere
    with pytest.raises(IntegrationError, match="single_type_managers"):
        share_prefill_register(scheduler)
