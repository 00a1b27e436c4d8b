"""P/D handoff pieces without an engine: lease store, ZMQ transport, scheduler protocol."""
import socket
import time
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm", reason="the handoff glue imports vLLM's logger")

from vllm_dhisparse.config import DHiSparseConfig  # noqa: E402
from vllm_dhisparse.integration.handoff.scheduler import (NAMESPACE,  # noqa: E402
                                                          HandoffScheduler)
from vllm_dhisparse.integration.handoff.store import Handoff, HandoffStore  # noqa: E402
from vllm_dhisparse.integration.handoff.transport import (HandoffError,  # noqa: E402
                                                          HandoffServer, pull)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_handoff(hid: str, n: int = 600) -> Handoff:
    g = torch.Generator().manual_seed(n)
    rows = {"c4a.0": torch.randint(0, 256, (n // 4, 584), dtype=torch.uint8, generator=g)}
    state = torch.randn(3, 4, 16, generator=g)  # float blocks keep their dtype
    return Handoff(hid, n, rows, {"swa": ([7, 8, 9], state)})


def verify_same(a: Handoff, b: Handoff) -> None:
    assert (a.handoff_id, a.num_tokens) == (b.handoff_id, b.num_tokens)
    assert a.rows.keys() == b.rows.keys() and a.blocks.keys() == b.blocks.keys()
    for k in a.rows:
        assert torch.equal(a.rows[k], b.rows[k])
    for k, (pos, t) in a.blocks.items():
        assert b.blocks[k][0] == pos and b.blocks[k][1].dtype == t.dtype
        assert torch.equal(b.blocks[k][1], t)


def test_store_lease_pull_and_capacity():
    h = make_handoff("a")
    store = HandoffStore(lease_s=5.0, capacity_bytes=h.nbytes * 2)
    assert store.put(h) and store.put(make_handoff("b"))
    assert not store.put(make_handoff("c")), "over capacity must be refused"
    assert store.counters.refused == 1 and store.held == 2
    assert store.take("a") is h and store.take("a") is None, "one pull per handoff"
    assert store.expire(now=time.monotonic() + 1) == []
    assert store.expire(now=time.monotonic() + 6) == ["b"]
    c = store.counters
    assert (c.captured, c.pulled, c.expired, store.held, store.bytes_held) == (2, 1, 1, 0, 0)
    assert c.bytes_sent == h.nbytes


def test_transport_round_trip_unknown_id_and_dead_producer():
    port = free_port()
    store = HandoffStore(lease_s=30.0, capacity_bytes=2**30)
    server = HandoffServer(store, "127.0.0.1", port)
    try:
        h = make_handoff("xyz", n=1500)
        store.put(h)
        got, seconds = pull("127.0.0.1", port, "xyz", timeout_s=5)
        verify_same(h, got)
        assert seconds > 0 and store.counters.pulled == 1
        with pytest.raises(HandoffError, match="'xyz'.*not held"):
            pull("127.0.0.1", port, "xyz", timeout_s=5)  # already pulled
        with pytest.raises(ValueError, match="handoff_port"):
            HandoffServer(store, "127.0.0.1", port)  # port taken: start-up error
    finally:
        server.close()
    with pytest.raises(HandoffError, match="'gone'.*no answer"):
        pull("127.0.0.1", free_port(), "gone", timeout_s=0.3)


def test_a_pull_the_producer_cannot_answer_leaves_the_channel_serving(monkeypatch):
    store = HandoffStore(lease_s=30.0, capacity_bytes=2**30)
    server = HandoffServer(store, "127.0.0.1", 0)
    answer = server._answer
    calls = []

    def once_broken(parts):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return answer(parts)
    monkeypatch.setattr(server, "_answer", once_broken)
    try:
        store.put(make_handoff("ok"))
        with pytest.raises(HandoffError, match="boom"):
            pull("127.0.0.1", server.port, "ok", timeout_s=5)
        verify_same(make_handoff("ok"), pull("127.0.0.1", server.port, "ok", timeout_s=5)[0])
    finally:
        server.close()


def test_port_zero_binds_a_free_port_that_the_scheduler_advertises():
    store = HandoffStore(lease_s=30.0, capacity_bytes=2**30)
    server = HandoffServer(store, "127.0.0.1", 0)
    try:
        assert server.port > 0 and server.address.endswith(f":{server.port}")
        store.put(make_handoff("p0"))
        verify_same(make_handoff("p0"), pull("127.0.0.1", server.port, "p0", timeout_s=5)[0])
    finally:
        server.close()
    prod = HandoffScheduler("kv_producer", DHiSparseConfig(handoff_port=0), "e", kv_config())
    prod.set_address("127.0.0.1", server.port)  # what the worker's handshake says
    r = request("p-2", {"do_remote_decode": True})
    prod.on_new_request(r)
    assert prod.request_finished(r, prefilled=True)["remote_port"] == server.port


def test_server_expires_leases_on_its_own():
    store = HandoffStore(lease_s=0.1, capacity_bytes=2**30)
    server = HandoffServer(store, "127.0.0.1", free_port())
    try:
        store.put(make_handoff("old"))
        deadline = time.monotonic() + 5
        while store.held and time.monotonic() < deadline:
            time.sleep(0.05)
        counters, held = store.snapshot()
        assert held == 0 and counters.expired == 1
    finally:
        server.close()


def request(rid, params, n=600, first_token=1):
    return SimpleNamespace(request_id=rid, kv_transfer_params=params, num_prompt_tokens=n,
                           prompt_token_ids=[first_token] + list(range(2, n + 1)))


def kv_config(groups=3):
    spec = SimpleNamespace(block_size=256)
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=spec)] * groups)


def test_scheduler_protocol_producer_to_consumer():
    cfg = DHiSparseConfig(handoff_host="127.0.0.1", handoff_port=6001)
    prod = HandoffScheduler("kv_producer", cfg, "eng-p", kv_config())
    r = request("p-1", {"do_remote_decode": True})
    prod.on_new_request(r)
    assert prod.request_finished(request("other", None), True) is None
    params = prod.request_finished(r, prefilled=True)
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert (params["remote_host"], params["remote_port"], params["remote_num_tokens"]) == \
        ("127.0.0.1", 6001, 600)
    hid = params[NAMESPACE]["handoff_id"]
    assert hid and params["remote_request_id"] == "p-1"

    cons = HandoffScheduler("kv_consumer", cfg, "eng-d", kv_config())
    assert cons.loaded_groups == (0, 1, 2)
    d = request("d-9", params)  # another engine request id, same handoff id
    assert cons.get_num_new_matched_tokens(d, 0) == (600, True)
    # vLLM could not allocate the blocks this step and asks again: the load still stands
    assert cons.get_num_new_matched_tokens(d, 0) == (600, True)
    assert cons.take_loads() == []
    blocks = SimpleNamespace(get_block_ids=lambda: ([1, 2, 3], [4], [5, 6, 7]))
    cons.update_state_after_alloc(d, blocks, 600, max_tokens=8)
    (item,) = cons.take_loads()
    assert (item.req_id, item.handoff_id, item.port, item.num_tokens) == ("d-9", hid, 6001, 600)
    # a failed load recomputes (policy recompute) or a preempted request: no second load
    assert cons.get_num_new_matched_tokens(d, 0) == (0, False)
    # no params, another connector's params, or a local prefix hit: computed here
    assert cons.get_num_new_matched_tokens(request("d-1", None), 0) == (0, False)
    assert cons.get_num_new_matched_tokens(
        request("d-2", {"do_remote_prefill": True}), 0) == (0, False)
    assert cons.get_num_new_matched_tokens(request("d-3", params), 256) == (0, False)
    # the handoff of another prompt of the same length: computed here
    assert cons.get_num_new_matched_tokens(request("d-4", params, first_token=7), 0) == (0, False)


def test_kv_both_ignores_pd_params():
    both = HandoffScheduler("kv_both", DHiSparseConfig(), "e", kv_config())
    r = request("b-1", {"do_remote_decode": True})
    both.on_new_request(r)
    assert both.request_finished(r, prefilled=True) is None
    assert both.get_num_new_matched_tokens(request("b-2", {"do_remote_prefill": True,
                                                           NAMESPACE: {"handoff_id": "h"}}),
                                           0) == (0, False)


def test_config_rejects_bad_port():
    with pytest.raises(ValueError, match="handoff_port"):
        DHiSparseConfig.from_extra_config({"handoff_port": 70000})
    with pytest.raises(ValueError, match="handoff_buffer_gib"):
        DHiSparseConfig.from_extra_config({"handoff_buffer_gib": 0})
    with pytest.raises(ValueError, match="valid keys"):
        DHiSparseConfig.from_extra_config({"handoff_prot": 1})


def test_auto_host_is_the_nodes_address(monkeypatch):
    from vllm_dhisparse.integration.handoff.worker import resolve_host
    monkeypatch.setenv("VLLM_HOST_IP", "127.0.0.1")
    assert resolve_host("auto") == "127.0.0.1"
    assert resolve_host("10.1.2.3") == "10.1.2.3"


def test_a_request_aborted_while_waiting_for_room_is_never_admitted():
    from vllm_dhisparse.integration.handoff.worker import (Consumer, HandoffCounters,
                                                           HandoffWorker, LoadJob)
    from vllm_dhisparse.integration.metadata import LoadItem
    pd = HandoffWorker.__new__(HandoffWorker)  # consumer state only, no engine
    pd.consumer = Consumer.__new__(Consumer)
    pd.consumer.jobs = {}
    pd.finished, pd.ready, pd.counters, pd.handoff_ids = set(), [], HandoffCounters(), {}
    job = LoadJob(LoadItem("r1", "h1", "127.0.0.1", 1, 600, ([1],), 8), handoff=make_handoff("h1"))
    job.done.set()
    pd.consumer.jobs["r1"] = job
    admitted = []
    assert pd.transfer_results(lambda j: False) == (set(), set())  # no room: it waits
    pd.begin_step(SimpleNamespace(requests=[], finished={"r1"}, loads=[]))  # then aborted
    assert pd.transfer_results(lambda j: admitted.append(j) or True) == ({"r1"}, set())
    assert admitted == [] and pd.ready == []


def test_block_positions_from_the_producer_are_checked():
    """A handoff's block positions come from the socket: negative, repeated, unordered,
    out-of-range or miscounted positions fail the load before any block is written."""
    from vllm_dhisparse.integration.handoff.worker import Consumer, KVLayout
    from vllm_dhisparse.integration.metadata import LoadItem
    cache = torch.zeros(8, 4, 2)
    cfg = SimpleNamespace(num_blocks=8, kv_cache_groups=[
        SimpleNamespace(kv_cache_spec=SimpleNamespace(block_size=4), layer_names=["swa"])])
    cons = Consumer.__new__(Consumer)  # no load thread: _check alone
    cons.layout, cons.c4a = KVLayout({"swa": cache}, cfg, set()), {}
    item = LoadItem("d-1", "h", "127.0.0.1", 1, 10, ([3, 5, 6],), 4)  # 10 tokens: 3 blocks

    def handoff(pos, n=None):
        data = torch.ones(len(pos) if n is None else n, 4, 2)
        return Handoff("h", 10, {}, {"swa": (pos, data)})

    cons._check(item, handoff([0, 1, 2]))  # fine
    for pos, n in (([-1, 1, 2], None), ([0, 0, 2], None), ([0, 2, 1], None), ([0, 1, 3], None),
                   ([0, 1, 2], 2)):
        with pytest.raises(HandoffError, match="block positions"):
            cons._check(item, handoff(pos, n))
    assert cache.sum() == 0
