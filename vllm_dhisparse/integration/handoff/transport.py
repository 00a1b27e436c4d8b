"""Moving a handoff between processes and hosts: a ZMQ request/reply pull over TCP.

Why ZMQ: pyzmq ships with vLLM (its engine core and front-end already talk
over it), it gives message framing, timeouts and multipart zero-copy sends
without a service to run, and the producer only needs to answer pulls.  The
decode side pulls (as NIXL's default mode does), so a producer never has to
know its consumers and a consumer that dies simply never pulls: the lease
(handoff_store.py) frees what it left behind.  On GPU clusters NIXL (RDMA
from registered device or host memory) is the path to take instead of TCP;
the worker halves only see ``Handoff`` objects, so a transport swap stays here.

Wire format: a pull is ``[b"pull", handoff_id]``; the answer is a JSON header
(``ok``, ``error`` or the tensor list with shapes and dtypes) followed by one
frame per tensor, raw bytes in header order.
"""
from __future__ import annotations

import json
import threading
import time

import torch
import zmq
from vllm.logger import init_logger

from .store import Handoff, HandoffStore

logger = init_logger(f"vllm.{__name__}")  # under vLLM's handler and level

_POLL_MS = 200  # the server thread also expires leases at this pace


class HandoffError(RuntimeError):
    """A handoff could not be pulled (unknown id, producer gone, bad answer)."""


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise HandoffError(f"unknown dtype {name!r} in a handoff answer")
    return dt


def _raw(t: torch.Tensor) -> memoryview:
    return memoryview(t.contiguous().view(torch.uint8).numpy())


def encode(h: Handoff) -> list:
    header = dict(ok=True, handoff_id=h.handoff_id, num_tokens=h.num_tokens,
                  rows=[[k, list(t.shape), str(t.dtype)] for k, t in h.rows.items()],
                  blocks=[[k, pos, list(t.shape), str(t.dtype)] for k, (pos, t) in h.blocks.items()])
    frames = [_raw(t) for t in h.rows.values()] + [_raw(t) for _, t in h.blocks.values()]
    return [json.dumps(header).encode()] + frames


def decode(parts: list) -> Handoff:
    header = json.loads(bytes(parts[0]))
    if not header.get("ok"):
        raise HandoffError(header.get("error", "producer refused the pull"))
    frames = iter(parts[1:])

    def tensor(shape, dtype) -> torch.Tensor:
        try:
            buf = next(frames)
        except StopIteration:
            raise HandoffError(f"handoff {header['handoff_id']!r}: answer has fewer frames "
                               f"than its header lists") from None
        t = torch.frombuffer(bytearray(buf), dtype=torch.uint8)
        dt = _dtype(dtype)
        want = int(torch.Size(shape).numel()) * torch.empty((), dtype=dt).element_size()
        if t.numel() != want:
            raise HandoffError(f"handoff {header['handoff_id']!r}: frame of {t.numel()} B, "
                               f"header says {shape} {dtype} ({want} B)")
        return t.view(dt).reshape(shape)

    rows = {k: tensor(shape, dt) for k, shape, dt in header["rows"]}
    blocks = {k: (list(pos), tensor(shape, dt)) for k, pos, shape, dt in header["blocks"]}
    return Handoff(header["handoff_id"], int(header["num_tokens"]), rows, blocks)


class HandoffServer:
    """The producer's side channel: answers pulls from ``store`` on a thread of its own,
    so the engine step never waits for a consumer."""

    def __init__(self, store: HandoffStore, host: str, port: int):
        self.store = store
        self.host, self.port = host, port
        self.address = f"tcp://{host}:{port}"
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
                self.address = f"tcp://{host}:{self.port}"
            else:
                self._sock.bind(self.address)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"kv_producer: cannot bind the handoff side channel {self.address} "
                             f"({e}); set kv_connector_extra_config handoff_host / handoff_port "
                             f"to a free address (one port per prefill engine on a host)") from e
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dhisparse-handoff", daemon=True)
        self._thread.start()
        logger.info("DHiSparse: handoff side channel on %s (lease %.1f s)", self.address,
                    store.lease_s)

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            for hid in self.store.expire():
                logger.warning("DHiSparse: handoff %s was not pulled within its %.1f s lease; "
                               "freed", hid, self.store.lease_s)
            if not dict(poller.poll(_POLL_MS)):
                continue
            parts = self._sock.recv_multipart()
            try:
                reply = self._answer(parts)
            except Exception as e:  # noqa: BLE001 -- one bad pull must not end the channel
                logger.exception("DHiSparse: handoff side channel could not answer a pull")
                reply = [json.dumps(dict(ok=False, error=f"producer error: {e}")).encode()]
            self._sock.send_multipart(reply, copy=False)

    def _answer(self, parts: list) -> list:
        if len(parts) != 2 or parts[0] != b"pull":
            return [json.dumps(dict(ok=False, error="malformed pull")).encode()]
        hid = parts[1].decode(errors="replace")
        h = self.store.take(hid)
        if h is None:
            return [json.dumps(dict(ok=False, error=(
                f"handoff {hid!r} is not held by the producer at {self.address} (never "
                f"captured, already pulled, or its lease expired)"))).encode()]
        return encode(h)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _POLL_MS / 1000)
        self._sock.close()


def pull(host: str, port: int, handoff_id: str, timeout_s: float) -> tuple[Handoff, float]:
    """Pulls ``handoff_id`` from the producer at ``host:port``; ``(handoff, seconds)``.
    Raises :class:`HandoffError` naming the handoff on any failure."""
    address = f"tcp://{host}:{port}"
    sock = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    t0 = time.perf_counter()
    try:
        sock.connect(address)
        sock.send_multipart([b"pull", handoff_id.encode()])
        parts = sock.recv_multipart(copy=False)
    except zmq.Again:
        raise HandoffError(f"handoff {handoff_id!r}: no answer from the producer at {address} "
                           f"within {timeout_s:.1f} s (handoff_timeout_s)") from None
    except zmq.ZMQError as e:
        raise HandoffError(f"handoff {handoff_id!r}: pull from {address} failed: {e}") from e
    finally:
        sock.close()
    try:
        h = decode([p.buffer for p in parts])
    except HandoffError as e:
        raise HandoffError(f"handoff {handoff_id!r} from {address}: {e}") from None
    if h.handoff_id != handoff_id:
        raise HandoffError(f"handoff {handoff_id!r}: producer at {address} answered "
                           f"{h.handoff_id!r}")
    return h, time.perf_counter() - t0
