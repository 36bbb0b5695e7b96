"""A tensor-parallel worker process (rank > 0): ``python -m hwkv.engine.tp.worker CONFIG_JSON``.

Started by :class:`hwkv.engine.tp.executor.TPExecutor` in a fresh interpreter (no fork of a process
holding threads or a device context). It says ``Hello``, joins the group, loads its shard of the
weights, sizes its KV cache with the others (the smallest pool any rank can hold), then applies the
driver's runner calls in order until ``Shutdown``. It exits when the driver process is gone (checked
every second while idle; a collective with a dead peer fails or times out), and on any error it
reports ``Failed`` with the traceback and exits: a tensor-parallel group cannot continue without a
rank. With a KV connector it builds its own instance (``bind_tp`` names its rank) whose worker side
serves this rank's KV shard, and reports its completions after every forward step (``KVOut``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from hwkv.connectors import bind_connector, make_connector
from hwkv.core.kv_groups import KVCacheGroup
from hwkv.engine.build import set_kv_scales
from hwkv.engine.config import EngineArgs
from hwkv.engine.kv_groups import GroupedKVCache
from hwkv.engine.tp import messages as m
from hwkv.engine.tp.runner import WorkerRunner, decode_step, recapture
from hwkv.interfaces.kv_quant import kv_storage_dtype
from hwkv.model import load_model
from hwkv.model.fuse import fuse_elementwise
from hwkv.parallel.communicator import TorchDistCommunicator
from hwkv.parallel.sharding import TPShard
from hwkv.plugins import get_backend

IDLE_POLL_MS = 1000


def _run(cfg: m.WorkerConfig, cmd: Any, out: Any) -> None:
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(m.ToWorker)
    backend = get_backend(cfg.backend)
    backend.device.seed(cfg.seed)
    out.send(enc.encode(m.Hello(cfg.rank, os.getpid())))
    comm = TorchDistCommunicator(backend.device, cfg.rank, cfg.world_size, cfg.port, cfg.timeout_s, group=cfg.group)
    conn = None
    try:
        model, model_config, *_ = load_model(cfg.model, backend, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                                             load_tokenizer=False, tp=TPShard(cfg.rank, cfg.world_size, comm))
        model.kv_cache_dtype = kv_storage_dtype(cfg.kv_cache_dtype, model.dtype)  # before the pool is sized
        conn = _connector(cfg, backend, model_config)
        # the driver's pool sizing, over this rank's shard; the pool is the smallest any rank holds
        args = EngineArgs(model=cfg.model, backend=cfg.backend, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                          block_size=cfg.block_size, num_kv_blocks=cfg.num_kv_blocks,
                          memory_fraction=cfg.memory_fraction, max_num_seqs=cfg.max_num_seqs,
                          kv_cache_groups=False)  # every layer's blocks: at most what the driver's groups use
        cc = args.resolve(backend, model, agree=comm.all_reduce_min).cache
        block_size = cc.block_size
        kv_cache = runner = None  # allocated at Setup: the driver's KV-cache groups (if any) come with it
        meta_type = conn.metadata_type if conn is not None else Any

        prof: Any = None  # a KernelProfile between two Profile messages, and its forward steps
        prof_steps = 0

        def report(step: int, kvo: Any) -> None:
            out.send(enc.encode(m.KVOut(cfg.rank, step, None if kvo is None else enc.encode(kvo))))

        while True:
            try:  # the driver runs ahead: the next call is usually queued (no Poller built for it)
                raw = cmd.recv(zmq.NOBLOCK)
            except zmq.Again:
                if not cmd.poll(IDLE_POLL_MS):
                    if os.getppid() != cfg.parent_pid:  # the driver is gone
                        return
                    continue
                raw = cmd.recv()
            msg = dec.decode(raw)
            if isinstance(msg, m.Execute):
                runner.step_id, runner.argmax = msg.step, msg.argmax  # type: ignore[union-attr]
                runner.execute_async(decode_step(msg, meta_type), msg.forward)  # type: ignore[union-attr]
                prof_steps += msg.forward
            elif isinstance(msg, m.Flush):
                runner.flush()  # type: ignore[union-attr]
            elif isinstance(msg, m.Release):
                runner.release(msg.req_id)  # type: ignore[union-attr]
            elif isinstance(msg, m.Preempt):
                runner.preempt(msg.req_id)  # type: ignore[union-attr]
            elif isinstance(msg, m.Rollback):
                runner.rollback()  # type: ignore[union-attr]
            elif isinstance(msg, m.Setup):
                spec = model.kv_cache_spec(cc.num_kv_blocks, block_size)
                if msg.kv_groups:
                    groups = tuple(KVCacheGroup(tuple(layers), w, n) for layers, w, n in msg.kv_groups)
                    kv_cache = GroupedKVCache.allocate(groups, spec, backend.device, backend.attention.kv_layout)
                else:
                    kv_cache = backend.device.allocate_kv_cache(spec, backend.attention.kv_layout)
                set_kv_scales(kv_cache, model, cfg.kv_cache_scales)
                model.bind_kv_cache(kv_cache)
                runner = WorkerRunner(model, backend, kv_cache, block_size, msg.max_num_seqs, msg.max_model_len,
                                      connector=conn, comm=comm, report=report)
                if conn is not None:  # after register_kv_caches: what the driver's scheduler side needs of this rank
                    out.send(enc.encode(m.ConnectorInfo(cfg.rank, enc.encode(conn.tp_worker_info()))))
                if msg.fuse:
                    fuse_elementwise(model, kernels=backend.elementwise_ops())
            elif isinstance(msg, m.DecodeOps):
                model.set_decode_ops(backend.decode_ops() if msg.on else None, kv_cache.spec.dtype)  # type: ignore[union-attr]
            elif isinstance(msg, m.Graphs):
                runner.enable_graphs(msg.max_batch, msg.use_graphs)  # type: ignore[union-attr]
            elif isinstance(msg, m.Recapture):
                recapture(runner, msg.lo, msg.hi, msg.env)  # type: ignore[arg-type]
            elif isinstance(msg, m.Profile):
                from hwkv.engine.tp import profile

                if not msg.path:
                    prof, prof_steps = profile.KernelProfile(backend.device), 0
                    prof.start()
                elif prof is not None:
                    profile.write(msg.path, cfg.rank, prof.stop(prof_steps))
                    prof = None
            elif isinstance(msg, m.Shutdown):
                return
    finally:
        if conn is not None:
            conn.shutdown()
        # on a Shutdown the driver leaves the group at the same time: NCCL's abort frees its resources only
        # once every rank of the node aborts (one rank alone waits forever), so every rank aborts (bounded)
        comm.close()


def _connector(cfg: m.WorkerConfig, backend: Any, model_config: Any) -> Any:
    """This rank's instance of the engine's KV connector (its worker side serves this rank's shard)."""
    conn = make_connector(cfg.kv_connector, cfg.kv_connector_config)
    if conn is not None:
        bind_connector(conn, backend, cfg.model, model_config, cfg.rank, cfg.world_size)
    return conn


def _exit_with_driver(parent_pid: int) -> None:
    while True:
        time.sleep(1.0)
        if os.getppid() != parent_pid:
            os._exit(3)


def main(argv: list[str]) -> int:
    cfg = msgspec.json.decode(argv[1], type=m.WorkerConfig)
    # gone with the driver wherever this rank is stuck (a setup rendezvous, a collective): the idle loop's
    # check alone left a worker waiting in symmetric memory's rendezvous behind its killed driver, on the GPU
    # the next runs measured (batch 3 of 2026-11-28)
    threading.Thread(target=_exit_with_driver, args=(cfg.parent_pid,), name="hwkv-tp-orphan", daemon=True).start()
    ctx = zmq.Context()
    cmd, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (cmd, out):
        s.setsockopt(zmq.LINGER, 2000)
    cmd.connect(cfg.cmd_addr)
    out.connect(cfg.out_addr)
    code = 0
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
        _run(cfg, cmd, out)
    except BaseException:
        out.send(msgspec.msgpack.encode(m.Failed(cfg.rank, traceback.format_exc())))
        code = 1
    finally:
        cmd.close(0)
        out.close()
        ctx.term()
    return code


if __name__ == "__main__":
    code = main(sys.argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: collecting a CUDA / NCCL process group there can wait on peers that are gone
    os._exit(code)
