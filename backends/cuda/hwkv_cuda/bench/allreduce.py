"""All-reduce microbenchmark on the GPUs of one host: µs per call by message size for every path of
:mod:`hwkv_cuda.allreduce` (one-shot push, with and without the fused residual add; PyTorch
symmetric-memory one-shot and two-shot) against NCCL, eager and inside a CUDA graph, each checked
bit for bit against the sum computed locally.

    hwkv bench allreduce --world-size 2 --out allreduce.json   (or python -m hwkv_cuda.bench.allreduce)

One process per GPU (spawned), joined through :class:`hwkv.parallel.communicator.TorchDistCommunicator`.
Keep ``NCCL_NVLS_ENABLE=0`` and ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` set (multicast is never used).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from typing import Any

SIZES = [2 << 10, 8 << 10, 32 << 10, 128 << 10, 256 << 10, 512 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20,
         16 << 20, 32 << 20]


def _inputs(rank: int, nbytes: int, world: int, dtype: Any, device: Any) -> tuple[Any, Any, Any]:
    import torch

    n = nbytes // torch.empty((), dtype=dtype).element_size()
    xs = [torch.randn(n, generator=torch.Generator().manual_seed(1000 * r + n)).to(dtype) for r in range(world)]
    res = torch.randn(n, generator=torch.Generator().manual_seed(7 + n)).to(dtype)
    total = torch.zeros(n, dtype=torch.float32)
    for x in xs:
        total += x.float()
    want = total.to(dtype)
    return xs[rank].to(device), res.to(device), (want.to(device), (want.float() + res.float()).to(dtype).to(device))


def _time(fn: Any, iters: int, graph: bool, comm: Any) -> float:
    """µs per call of ``fn`` (eager: back-to-back launches; graph: ``iters`` calls captured in one graph)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    comm.all_reduce_min(1)
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm on the side stream (NCCL's first use on a stream)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()
        torch.cuda.synchronize()
        comm.all_reduce_min(1)
        t0 = time.perf_counter()
        reps = 5
        for _ in range(reps):
            g.replay()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / (reps * iters)
    else:
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters
    comm.all_reduce_min(1)
    return dt * 1e6


def _worker(rank: int, world: int, port: int, group: str, q: Any, iters: int) -> None:
    import torch

    from hwkv.parallel.communicator import TorchDistCommunicator
    from hwkv_cuda.device import CudaDevice

    torch.cuda.set_device(rank)
    dev = CudaDevice(rank)
    store = None
    if rank == 0:
        from hwkv.parallel.communicator import open_store

        store = open_store(None, 120)
        q.put(("port", store.port))
    else:
        port = q.get()[1] if port == 0 else port
    comm = TorchDistCommunicator(dev, rank, world, port, 120.0, store=store, group=group)
    ar = comm._custom
    rows: list[dict[str, Any]] = []
    if ar is None:
        print(f"rank {rank}: custom all-reduce unavailable", flush=True)
    else:
        print(f"rank {rank}: custom all-reduce push<={ar.push_max} norm<={ar.norm_max} one_shot<={ar.one_shot_max} "
              f"two_shot<={ar.two_shot_max} symm_error={ar.symm_error!r}", flush=True)
    dtype = torch.bfloat16
    pg = comm._group()

    def nccl(t: Any) -> Any:
        pg.allreduce([t]).wait()
        return t

    paths: dict[str, Any] = {"nccl": nccl}
    if ar is not None:
        if ar.push_max:
            paths["push"] = lambda t: ar._push(t, None)
            paths["push_add"] = None  # filled per size (needs the residual)
        if ar.norm_max:
            paths["push_add_norm"] = None  # rows of 4096 (Llama-3-8B's hidden size), filled per size
        if ar.one_shot_max or ar.two_shot_max:
            def one(t: Any) -> Any:
                buf = ar.staging[:t.numel() * t.element_size()].view(t.dtype)
                buf.copy_(t)
                torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", ar.name, t)
                return t

            def two(t: Any) -> Any:
                buf = ar.staging[:t.numel() * t.element_size()].view(t.dtype)
                buf.copy_(t)
                torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", ar.name)
                t.copy_(buf)
                return t

            paths["symm_one_shot"], paths["symm_two_shot"] = one, two
        paths["auto"] = comm.all_reduce
    for nbytes in SIZES:
        x, res, (want, want_add) = _inputs(rank, nbytes, world, dtype, dev.torch_device)
        for name, fn in paths.items():
            if name in ("push", "push_add") and nbytes > ar.push_max:
                continue
            if name.startswith("symm") and nbytes > ar.staging.numel():
                continue
            if name == "push_add":
                def fn(t: Any, _r: Any = res) -> Any:
                    return ar._push(t, _r)
            if name == "push_add_norm":
                if nbytes > ar.norm_max or nbytes % 8192:
                    continue
                w = torch.randn(4096, generator=torch.Generator().manual_seed(5)).to(dtype).to(x.device)

                def fn(t: Any, _r: Any = res, _w: Any = w) -> Any:
                    return ar.all_reduce_add_rms_norm(t.view(-1, 4096), _r.view(-1, 4096), _w, 1e-5)[0].view(-1)
            row: dict[str, Any] = {"path": name, "bytes": nbytes}
            try:
                t = x.clone()
                got = fn(t)
                torch.cuda.synchronize()
                expect = want_add if name == "push_add" else want
                if name == "push_add_norm":
                    from hwkv.model.layers import rms_norm

                    expect = rms_norm(want_add.view(-1, 4096), w, 1e-5).view(-1)
                row["exact"] = bool(torch.equal(got, expect))
                if not row["exact"]:
                    row["max_err"] = float((got.float() - expect.float()).abs().max())
                    row["mismatches"] = int((got != expect).sum())
                buf = x.clone()
                n_it = iters if nbytes <= (1 << 20) else max(10, iters // 5)
                call = functools.partial(fn, buf)
                row["eager_us"] = round(_time(call, n_it, False, comm), 2)
                row["graph_us"] = round(_time(call, n_it, True, comm), 2)
            except Exception as e:  # noqa: BLE001 - reported per path, the others still run
                row["error"] = f"{type(e).__name__}: {e}"[:400]
                torch.cuda.synchronize()
                comm.all_reduce_min(1)
            rows.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    if ar is not None and ar.push_max:
        rows.append({"push_spin_timeouts": ar.failed()})
    if rank == 0:
        q.put(("rows", rows))
    comm.close()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--out", default=None)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(p)
    return run(p.parse_args(argv))


def run(a: argparse.Namespace) -> int:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import multiprocessing as mp

    import torch

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(0, a.world_size, 0, "bench-ar", q, a.iters))]
    procs[0].start()
    kind, port = q.get(timeout=120)
    for r in range(1, a.world_size):
        procs.append(ctx.Process(target=_worker, args=(r, a.world_size, port, "bench-ar", q, a.iters)))
        procs[-1].start()
    kind, rows = q.get(timeout=600)
    for pr in procs:
        pr.join(60)
    from hwkv.bench.common import source_commit

    doc = {"bench": "allreduce", "commit": source_commit(),
           "command": "python -m hwkv_cuda.bench.allreduce " + " ".join(sys.argv[1:]),
           "world_size": a.world_size, "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "dtype": "bfloat16", "iters": a.iters, "rows": rows,
           "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST")}}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0 if all(r.get("exact", True) or r["path"] == "push_add_norm" for r in rows if "path" in r) else 1


if __name__ == "__main__":
    sys.exit(main())
