"""TPExecutor: the driver side of a tensor-parallel engine (rank 0 is the engine's own process).

Process model (as vLLM's multiprocessing executor): the scheduler, block pool and detokenizer stay
single, in the driver; ranks 1..N-1 are worker processes (``python -m hwkv.engine.tp.worker``), each
pinned to one device through the backend's ``Device.visible_devices_env``. The driver sends every
runner call to them over ZMQ IPC sockets (msgspec; :mod:`hwkv.engine.tp.messages`) before making it
itself; tensors move only through the communicator's collectives.

Failure behaviour: a worker that cannot start reports why (``Hello`` never comes, ``Failed`` or its
exit does) and the engine's constructor raises with its traceback; every wait is bounded by
``timeout_s``. A worker failing later is fatal to the engine: the next call raises
:class:`TPWorkerError`, and so does every call after it. :meth:`close` (``Engine.close()``, or the
engine being collected, or interpreter exit) asks the workers to stop, then terminates and kills
them; workers also exit on their own when the driver process is gone.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import msgspec
import zmq

from hwkv.engine.spec_config import METHODS
from hwkv.engine.tp import messages as m
from hwkv.model.config import ModelConfig
from hwkv.parallel.sharding import TPShard, check_tp

PROC_POLL_S = 0.05  # send() looks for exited workers at most this often
DEFAULT_TIMEOUT_S = 300.0  # start, join, every collective (a rank may still load or compile); HWKV_TP_TIMEOUT_S


class TPWorkerError(RuntimeError):
    """A tensor-parallel worker failed; the engine cannot continue."""


def check_supported(cfg: Any, backend: Any, kv_connector: Any) -> None:
    """``ValueError`` for options tensor parallelism does not support (yet), naming each.
    ``kv_connector``: the connector built from ``cfg.kv_connector`` / ``cfg.kv_connector_config`` (or
    ``None``); every rank builds its own from those options."""
    n, connector_arg, connector_config = cfg.tensor_parallel_size, cfg.kv_connector, cfg.kv_connector_config
    reasons = []
    if not isinstance(cfg.backend, str):
        reasons.append("backend must be a registered backend name, not an instance (each worker builds its own)")
    if kv_connector is not None:
        name = getattr(kv_connector, "name", type(kv_connector).__name__)
        if not isinstance(connector_arg, str):
            reasons.append("kv_connector must be given by name (a registered name or 'package.module:Class') with "
                           "kv_connector_config, not as an instance (every rank builds its own worker side)")
        elif not kv_connector.supports_tensor_parallel:
            reasons.append(f"kv_connector {name!r} does not run tensor-parallel (allowed: offload, pool, or a "
                           "connector class declaring supports_tensor_parallel = True)")
        else:
            try:
                msgspec.json.encode(connector_config or {})
                kv_connector.check_tensor_parallel(n)
            except (TypeError, msgspec.EncodeError) as e:
                reasons.append(f"kv_connector_config must be plain JSON values (it is sent to every rank): {e}")
            except ValueError as e:
                reasons.append(str(e))
    if cfg.speculative_config is not None:
        method = cfg.speculative_config.method  # parsed by EngineArgs
        reasons.append(f"speculative decoding (method {method!r}) runs at tensor_parallel_size=1 only: the verify "
                       "step's rejection sampling and the proposer's state live in one runner (allowed at "
                       f"tensor_parallel_size > 1: speculative_config=None; at 1: methods {', '.join(METHODS)})")
    if reasons:
        raise ValueError(f"tensor_parallel_size={n}: " + "; ".join(reasons))
    check_tp(ModelConfig.from_dir(cfg.model), n)


class TPExecutor:
    def __init__(self, cfg: Any, backend: Any, timeout_s: float | None = None):
        """Start ranks 1..N-1 and join the group as rank 0 (see the module doc); each worker builds
        its own connector from ``cfg.kv_connector`` (a name) and ``cfg.kv_connector_config``."""
        from hwkv.parallel.communicator import TorchDistCommunicator, new_group_name, process_store

        n = cfg.tensor_parallel_size
        self.timeout_s = float(timeout_s or os.environ.get("HWKV_TP_TIMEOUT_S") or DEFAULT_TIMEOUT_S)
        self.procs: list[subprocess.Popen] = []
        self.error: str | None = None
        self._closed = False
        self._polled = 0.0
        self._dir = tempfile.mkdtemp(prefix="hwkv-tp-")
        self._ctx = zmq.Context()
        self._out = self._ctx.socket(zmq.PULL)
        self._out.bind(f"ipc://{self._dir}/out")
        self._cmds: list[Any] = []
        self._enc = msgspec.msgpack.Encoder()
        self._dec = msgspec.msgpack.Decoder(m.FromWorker)
        self.comm: Any = None
        self._hellos: set[int] = set()
        self._kv_outs: list[m.KVOut] = []  # the ranks' connector outputs not yet collected
        self._kv_steps = [-1] * n  # per rank: the last forward step it reported
        self._infos: dict[int, bytes] = {}  # per rank: its connector's tp_worker_info
        try:
            store, group = process_store(self.timeout_s), new_group_name()
            dtype = cfg.dtype if cfg.dtype is None or isinstance(cfg.dtype, str) else str(cfg.dtype)[len("torch."):]
            env_var = backend.device.visible_devices_env
            visible = os.environ.get(env_var, "") if env_var else ""
            ids = [v for v in visible.split(",") if v.strip()] or [str(i) for i in range(n)]
            name = cfg.kv_connector if isinstance(cfg.kv_connector, str) else None  # a no-op instance: none
            for rank in range(1, n):
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                sock.bind(f"ipc://{self._dir}/cmd{rank}")
                self._cmds.append(sock)
                wc = m.WorkerConfig(cfg.model, cfg.backend, dtype, cfg.max_model_len, cfg.block_size, cfg.num_kv_blocks,
                                    cfg.memory_fraction, cfg.max_num_seqs, cfg.seed, rank, n, store.port,
                                    f"ipc://{self._dir}/cmd{rank}", f"ipc://{self._dir}/out", self.timeout_s,
                                    os.getpid(), name, dict(cfg.kv_connector_config or {}), group,
                                    cfg.kv_cache_dtype, _scales_json(cfg.kv_cache_scales))
                env = dict(os.environ)
                if env_var:
                    if rank >= len(ids):
                        raise ValueError(f"tensor_parallel_size={n} needs {n} devices but {env_var}={visible!r} "
                                         f"lists {len(ids)}")
                    env[env_var] = ids[rank]
                self.procs.append(subprocess.Popen([sys.executable, "-m", "hwkv.engine.tp.worker",
                                                    msgspec.json.encode(wc).decode()], env=env,
                                                   stdin=subprocess.DEVNULL))
            self._await_hello(n - 1)
            self.comm = TorchDistCommunicator(backend.device, 0, n, store.port, self.timeout_s, store=store,
                                              group=group)
        except BaseException:
            self.close()
            raise
        self.shard = TPShard(0, n, self.comm)

    def _await_hello(self, count: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while len(self._hellos) < count:
            self.check()
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, count + 1)) - self._hellos)
                raise TPWorkerError(f"tensor-parallel workers {missing} did not start within {self.timeout_s:.0f} s")
            self._out.poll(100)

    def _fail(self, msg: m.Failed) -> None:
        self.error = f"tensor-parallel worker rank {msg.rank} failed:\n{msg.error}"
        raise TPWorkerError(self.error)

    def check(self) -> None:
        """Raise :class:`TPWorkerError` if a worker failed or exited (cheap: one poll, no wait)."""
        if self._closed:
            raise TPWorkerError("the tensor-parallel engine was closed (Engine.close())")
        if self.error is not None:
            raise TPWorkerError(self.error)
        self._drain(0)
        for rank, p in enumerate(self.procs, 1):
            if p.poll() is not None:
                self._drain(200)  # its last words may still be in flight
                self.error = f"tensor-parallel worker rank {rank} (pid {p.pid}) exited with code {p.returncode}"
                raise TPWorkerError(self.error)

    def _drain(self, wait_ms: int) -> None:
        while self._out.poll(wait_ms):
            msg = self._dec.decode(self._out.recv())
            if isinstance(msg, m.Failed):
                self._fail(msg)
            elif isinstance(msg, m.ConnectorInfo):
                self._infos[msg.rank] = msg.info
            elif isinstance(msg, m.KVOut):
                self._kv_outs.append(msg)
                self._kv_steps[msg.rank] = msg.step
            else:
                self._hellos.add(msg.rank)
            wait_ms = 0

    def send(self, msg: Any) -> None:
        """Send one runner call to every worker (raises if one failed; a worker's failure or exit is
        looked for at most every ``PROC_POLL_S``: a step sends a message or more, and a waitpid or a
        socket poll per message is host time every step pays — a poll alone costs as much as the
        send; a failed worker's peers fail their next collective anyway, within the timeout)."""
        now = time.monotonic()
        if now - self._polled > PROC_POLL_S or self.error is not None or self._closed:
            self._polled = now
            self.check()
        data = self._enc.encode(msg)
        for s in self._cmds:
            try:
                s.send(data, zmq.NOBLOCK)
            except zmq.Again:  # no peer (a worker that died since the last check) or a full queue
                self._send_waiting(s, data)

    def _send_waiting(self, sock: Any, data: bytes) -> None:
        """A send that would block: wait for room, looking for dead workers meanwhile (a PUSH socket
        whose worker died blocks a plain send forever), at most ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            self.check()
            if sock.poll(100, zmq.POLLOUT):
                try:
                    sock.send(data, zmq.NOBLOCK)
                    return
                except zmq.Again:
                    pass
            if time.monotonic() > deadline:
                self.error = f"a tensor-parallel worker took no message within {self.timeout_s:.0f} s"
                raise TPWorkerError(self.error)

    def collect_info(self) -> list[bytes]:
        """Every worker's connector ``tp_worker_info`` (ranks 1..N-1, encoded), once they sent it."""
        deadline, n = time.monotonic() + self.timeout_s, len(self._kv_steps)
        while len(self._infos) < n - 1:
            self.check()
            if time.monotonic() > deadline:
                self.error = (f"tensor-parallel workers did not describe their KV connector within "
                              f"{self.timeout_s:.0f} s")
                raise TPWorkerError(self.error)
            self._out.poll(10)
        return [self._infos[r] for r in range(1, n)]

    def collect_kv(self, step: int) -> list[m.KVOut]:
        """Every rank's connector outputs up to forward step ``step`` not collected yet (older ones
        first: a step the driver abandoned after sending still reports what its ranks finished)."""
        deadline = time.monotonic() + self.timeout_s
        while min(self._kv_steps[1:]) < step:
            self.check()
            if time.monotonic() > deadline:
                late = [r for r in range(1, len(self._kv_steps)) if self._kv_steps[r] < step]
                self.error = (f"tensor-parallel workers {late} reported no KV connector output within "
                              f"{self.timeout_s:.0f} s")
                raise TPWorkerError(self.error)
            self._out.poll(10)
        outs, self._kv_outs = self._kv_outs, []
        return outs

    def agree(self, n: int) -> int:
        return self.comm.all_reduce_min(n)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the workers (Shutdown, then terminate, then kill; bounded) and leave the group. Idempotent."""
        if self._closed:
            return
        self._closed = True
        # every rank leaves the group at the same time: the workers on their Shutdown, the driver right after
        # sending it. NCCL's abort frees a communicator only once every rank of the node aborts: the driver's
        # alone, with the workers idle (bf27901) or gone (a51b4e4), never returned, and the abort left
        # running on its thread kept the process's next tp engine from coming up (479d2cf)
        data = self._enc.encode(m.Shutdown())
        for s in self._cmds:
            with contextlib.suppress(zmq.ZMQError):
                s.send(data, zmq.NOBLOCK)
        if self.comm is not None:
            self.comm.close()
        for p in self.procs:
            for stop in (None, p.terminate, p.kill):
                if stop is not None:
                    stop()
                try:
                    p.wait(timeout)
                    break
                except subprocess.TimeoutExpired:
                    continue
        for s in [*self._cmds, self._out]:
            s.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)


def _scales_json(scales: Any) -> str | None:
    """``kv_cache_scales`` for a worker's argv: a JSON string as given, a tensor or numbers as JSON."""
    if scales is None or isinstance(scales, str):
        return scales
    import json

    return json.dumps(scales.tolist() if hasattr(scales, "tolist") else scales)

