"""The p2p connector's side channel: a ZMQ ROUTER served by one thread (handshakes, pull
acquire/release, push requests and completion notices) and bounded request/reply calls to peers.

Every call has a timeout (a dead peer is an error, never a hang; one whose port refuses
connections is found within a second); messages are msgspec-encoded
(:mod:`hwkv.connectors.p2p.protocol`), never pickled.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from hwkv.connectors.p2p.protocol import Ack, decode, encode

log = logging.getLogger(__name__)


class ChannelError(RuntimeError):
    """A side-channel call failed: the peer did not answer in time or answered garbage."""


class SideChannel:
    """Serves ``handler(msg) -> reply`` on ``tcp://host:port`` (port 0: a free one) in a thread."""

    def __init__(self, host: str, port: int, handler: Callable[[Any], Any]):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        try:
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self.sock.close()
            self.ctx.term()
            raise ValueError(f"p2p: cannot bind the side channel to {host}:{port} ({e}); allowed: a free port, "
                             "or side_channel_port=0 for any free one") from None
        self.address = f"{host}:{port}"
        self.handler = handler
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"p2p-side-channel-{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            ident, _, data = self.sock.recv_multipart()
            try:
                reply = self.handler(decode(data))
            except Exception as e:  # a bad message must not kill the channel
                log.warning("p2p side channel: %s: %s", type(e).__name__, e)
                reply = Ack(False, f"{type(e).__name__}: {e}")
            self.sock.send_multipart([ident, b"", encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
        self.ctx.term()


_ctx_lock = threading.Lock()
_ctx: zmq.Context | None = None


def _client_ctx() -> zmq.Context:
    global _ctx
    with _ctx_lock:
        if _ctx is None:
            _ctx = zmq.Context()
        return _ctx


PROBE_S = 0.5  # a call unanswered this long checks that the peer still listens (a dead one: fails at once)


def listening(address: str, timeout_s: float = PROBE_S) -> bool:
    """False when nothing accepts TCP connections at ``host:port`` (refused, unreachable): the
    peer's process or host is gone. A probe that merely times out is not proof: True."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except TimeoutError:
        return True
    except OSError:
        return False


def call(address: str, msg: Any, timeout_s: float) -> Any:
    """Send ``msg`` to the side channel at ``host:port`` and return its reply; :class:`ChannelError`
    when none comes within ``timeout_s``, or as soon as a probe finds nothing listening there (every
    ``PROBE_S`` without an answer): a dead peer costs about a second, not the whole timeout. One
    socket per call: a lost reply cannot wedge the next."""
    sock = _client_ctx().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    ms = max(1, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, ms)
    deadline = time.monotonic() + timeout_s
    try:
        sock.connect(f"tcp://{address}")
        sock.send(encode(msg))
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise zmq.Again()
            if sock.poll(int(1000 * min(PROBE_S, left)), zmq.POLLIN):
                return decode(sock.recv())
            if time.monotonic() < deadline and not listening(address):
                raise ChannelError(f"p2p peer {address} is down (nothing listens there; {type(msg).__name__} "
                                   "unanswered)")
    except ChannelError:
        raise
    except zmq.Again:
        raise ChannelError(f"p2p peer {address} did not answer {type(msg).__name__} within {timeout_s:g} s") from None
    except zmq.ZMQError as e:
        raise ChannelError(f"p2p peer {address}: {type(msg).__name__} failed ({e})") from None
    except Exception as e:  # undecodable reply
        raise ChannelError(f"p2p peer {address} answered {type(msg).__name__} with garbage ({e})") from None
    finally:
        sock.close()
