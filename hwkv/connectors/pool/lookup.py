"""The pool's lookup bridge: the scheduler side asks the worker side (which owns the store client)
how many leading chunks of a prompt the pool holds — ZMQ REQ/REP, msgspec msgpack on the wire.

Request ``[hashes]`` (the chain hashes of the prompt's chunk-end blocks, in order); reply
``[hits, error]``: the number of leading chunks present (one batched ``exists``, counting from the
first chunk and stopping at the first miss) and an empty string, or ``0`` and why. With KV-cache
groups the request asks for ``presence`` instead: the reply's ``present`` has, group after group, one
flag per hash (that group's chunk is in the pool; under tensor parallelism, every rank's shard). The server binds
an IPC socket in a private temporary directory by default (``tcp://127.0.0.1:*`` where IPC is
unavailable); the client treats a reply that does not come within ``timeout_s`` as a miss and starts
a fresh socket (a REQ socket that lost its reply cannot send again).
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from collections.abc import Callable

import msgspec
import zmq


class LookupRequest(msgspec.Struct, array_like=True):
    hashes: list[bytes]
    presence: bool = False  # KV-cache groups: every group's flag per hash instead of a leading count


class LookupReply(msgspec.Struct, array_like=True):
    hits: int
    error: str = ""
    present: list[bool] = []  # presence requests: group-major flags


class LookupServer:
    """REP socket served by a daemon thread; ``count_hits(hashes) -> int`` answers each request,
    ``presence(hashes) -> list[bool]`` (group-major) each presence request."""

    def __init__(self, count_hits: Callable[[list[bytes]], int], address: str | None = None,
                 presence: Callable[[list[bytes]], list[bool]] | None = None):
        self._count, self._presence = count_hits, presence
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._tmp = None
        if address is None and zmq.has("ipc"):
            self._tmp = tempfile.mkdtemp(prefix="hwkv-pool-")
            address = f"ipc://{os.path.join(self._tmp, 'lookup.sock')}"
            atexit.register(shutil.rmtree, self._tmp, True)  # an engine that is never shut down
        self._sock.bind(address or "tcp://127.0.0.1:*")
        self.address: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._dec, self._enc = msgspec.msgpack.Decoder(LookupRequest), msgspec.msgpack.Encoder()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="hwkv-pool-lookup")
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            raw = self._sock.recv()
            try:
                req = self._dec.decode(raw)
                if req.presence and self._presence is not None:
                    reply = LookupReply(0, "", self._presence(req.hashes))
                elif req.presence:
                    reply = LookupReply(0, "presence asked of a cache without KV-cache groups")
                else:
                    reply = LookupReply(self._count(req.hashes))
            except msgspec.DecodeError as e:
                reply = LookupReply(0, f"bad request: {e}")
            except Exception as e:  # the store failed: a miss, with the reason
                reply = LookupReply(0, f"{type(e).__name__}: {e}"[:300])
            self._sock.send(self._enc.encode(reply))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._sock.close(linger=0)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)


class LookupClient:
    """REQ side; :meth:`lookup` never raises for a slow or absent server (that is a miss)."""

    def __init__(self, address: str, timeout_s: float = 1.0):
        self.address, self.timeout_ms = address, max(1, int(timeout_s * 1000))
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._enc, self._dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(LookupReply)
        self.timeouts = 0
        self.errors = 0
        self.last_error = ""

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            s.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            s.connect(self.address)
            self._sock = s
        return self._sock

    def lookup(self, hashes: list[bytes]) -> int:
        """Leading chunks the pool holds (0 on timeout or error, counted)."""
        reply = self._ask(LookupRequest(hashes)) if hashes else None
        return 0 if reply is None else max(0, min(reply.hits, len(hashes)))

    def presence(self, hashes: list[bytes], groups: int) -> list[list[bool]]:
        """Per KV-cache group, per hash: the pool holds that group's chunk (all False on timeout or
        error, counted)."""
        m = len(hashes)
        reply = self._ask(LookupRequest(hashes, True)) if hashes else None
        flags = reply.present if reply is not None and len(reply.present) == groups * m else [False] * (groups * m)
        return [flags[g * m:(g + 1) * m] for g in range(groups)]

    def _ask(self, request: LookupRequest) -> LookupReply | None:
        sock = self._socket()
        try:
            sock.send(self._enc.encode(request))
            reply = self._dec.decode(sock.recv())
        except zmq.Again:
            self.timeouts += 1
            self.last_error = f"no reply from the lookup server at {self.address} in {self.timeout_ms} ms"
            self._reset()
            return None
        except (zmq.ZMQError, msgspec.DecodeError) as e:
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            self._reset()
            return None
        if reply.error:
            self.errors += 1
            self.last_error = reply.error
        return reply

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def close(self) -> None:
        self._reset()
