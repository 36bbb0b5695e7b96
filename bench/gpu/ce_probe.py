"""Copy-engine all-reduce (hwkv_cuda.ce_allreduce) against NCCL on two GPUs, one process per GPU each
seeing its GPU as cuda:0 (as a tensor-parallel engine's ranks): µs per call eager by size, bit-equality with
NCCL, and the overlap with a GEMM on the compute stream (the prefill row halves' case).

    python3 bench/gpu/ce_probe.py --out ce.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch.multiprocessing as mp

SIZES_MB = [4, 16, 64, 128]
EXTRA = os.environ.get("CE_PROBE_EXTRA") == "1"


def _worker(rank: int, world: int, q, res_q, args) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = str(rank)
    import torch
    from hwkv_cuda.device import CudaDevice

    from hwkv.parallel.communicator import TorchDistCommunicator, open_store

    dev = CudaDevice(0)
    torch.cuda.set_device(0)
    out: dict = {"rank": rank}

    def make(group: str, env: dict) -> TorchDistCommunicator:
        old = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            store = None
            if rank == 0:
                store = open_store(None, 120)
                for _ in range(world - 1):
                    q.put(store.port)
                port = store.port
            else:
                port = q.get()
            return TorchDistCommunicator(dev, rank, world, port, 120.0, store=store, group=group)
        finally:
            for k, v in old.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v

    for mode in filter(None, args.modes.split(",")):
        _probe_mode(rank, mode, make, out)
    if args.norm:
        _probe_norm(rank, make, out)
    res_q.put(out)
    os._exit(0)


def _probe_norm(rank, make, out) -> None:
    """The push all-reduce + RMSNorm kernel at a decode step's rows (Llama-3-8B hidden 4096) by warps per row:
    µs per call inside a CUDA graph of 63 calls back to back (a decode step's count)."""
    import torch

    comm = make("ce-norm", {"HWKV_CE_ALLREDUCE": "0"})
    ar = comm._custom
    res = {}
    for rows in (128, 256):
        x = torch.randn(rows, 4096, device="cuda").to(torch.bfloat16)
        r = torch.randn(rows, 4096, device="cuda").to(torch.bfloat16)
        w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
        for warps in (4, 8, 16):
            ar.norm_warps = warps
            ar.all_reduce_add_rms_norm(x, r, w, 1e-5)
            torch.cuda.synchronize()
            comm.all_reduce_min(1)
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                ar.all_reduce_add_rms_norm(x, r, w, 1e-5)
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            with torch.cuda.graph(g):
                for _ in range(63):
                    ar.all_reduce_add_rms_norm(x, r, w, 1e-5)
            g.replay()
            torch.cuda.synchronize()
            comm.all_reduce_min(1)
            t0 = time.perf_counter()
            for _ in range(5):
                g.replay()
            torch.cuda.synchronize()
            res[f"rows{rows}_warps{warps}_us"] = round((time.perf_counter() - t0) / (5 * 63) * 1e6, 2)
            comm.all_reduce_min(1)
    ar.norm_warps = 0
    print(f"rank {rank}: push norm {res}", flush=True)
    out["push_norm"] = res
    comm.close()


def _probe_mode(rank, mode, make, out) -> None:
    import torch

    comm = make(f"ce-{mode}", {"HWKV_CE_ALLREDUCE": mode, "HWKV_CE_MIN": str(4 << 20)})
    ar = comm._custom
    out = out.setdefault(f"mode{mode}", {})
    out["ce_min"], out["ce_signal"], out["ce_error"], out["ce_mode"] = ar.ce_min, ar.ce_signal, ar.ce_error, ar.ce_mode
    print(f"rank {rank} mode {mode}: ce_min={ar.ce_min} signal={ar.ce_signal!r} error={ar.ce_error!r}", flush=True)
    pg = comm._group()

    def nccl(t):
        pg.allreduce([t]).wait()
        return t

    def bar():
        torch.cuda.synchronize()
        comm.all_reduce_min(1)

    def timeit(fn, iters):
        for _ in range(3):
            fn()
        bar()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / iters * 1e6
        bar()
        return round(dt, 1)

    rows = []
    for mb in SIZES_MB:
        n = (mb << 20) // 2
        g = torch.Generator(device="cuda").manual_seed(100 + rank)
        x = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        a, b = x.clone(), x.clone()
        nccl(a)
        if ar.ce_min:
            ar._ce_run(b)
        bar()
        row = {"MB": mb, "equal_nccl": bool(torch.equal(a, b)) if ar.ce_min else None}
        row["nccl_us"] = timeit(lambda a=a: nccl(a), 10)
        if ar.ce_min:
            row["ce_us"] = timeit(lambda b=b: ar._ce_run(b), 10)
            row["ce_GBps_per_dir"] = round(mb * (1 << 20) / 2 * 2 / (row["ce_us"] * 1e-6) / 1e9, 1)
        print(f"rank {rank}: {row}", flush=True)
        rows.append(row)
    out["sizes"] = rows

    # overlap: a GEMM loop (a row half's gate_up at tp=2: 8192 x 4096 -> 7168 x 2) beside a 64 MB all-reduce
    xa = torch.randn(8192, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(14336, 4096, device="cuda", dtype=torch.bfloat16) * 0.01
    t = torch.randn(8192 * 4096, device="cuda").to(torch.bfloat16)

    def gemm():
        for _ in range(2):
            torch.nn.functional.linear(xa, w)

    ov = {"gemm_us": timeit(gemm, 10), "nccl_us": timeit(lambda: nccl(t), 10)}

    def nccl_overlap():
        work = pg.allreduce([t])
        gemm()
        work.wait()

    ov["nccl_beside_gemm_us"] = timeit(nccl_overlap, 10)
    if ar.ce_min:
        ov["ce_us"] = timeit(lambda: ar._ce_run(t), 10)

        def ce_overlap():
            wait = ar.all_reduce_start(t)
            gemm()
            wait()

        ov["ce_beside_gemm_us"] = timeit(ce_overlap, 10)
        if ar.ce_mode == "oneshot":  # the sum fused into the next RMSNorm (the prefill halves' sites)
            from hwkv.model.layers import add_rms_norm

            t2, res = t.view(8192, 4096), torch.randn(8192, 4096, device="cuda").to(torch.bfloat16)
            w = torch.ones(4096, device="cuda", dtype=torch.bfloat16)
            ov["nccl_then_norm_us"] = timeit(lambda: add_rms_norm(nccl(t2), res, w, 1e-5), 10)
            ov["ce_fused_norm_us"] = timeit(lambda: ar.all_reduce_add_rms_norm_start(t2, res, w, 1e-5)(), 10)

            def ce_norm_overlap():
                wait = ar.all_reduce_add_rms_norm_start(t2, res, w, 1e-5)
                gemm()
                wait()

            ov["ce_fused_norm_beside_gemm_us"] = timeit(ce_norm_overlap, 10)
            a2, b2 = t2.clone(), t2.clone()
            want = add_rms_norm(nccl(a2), res, w, 1e-5)
            got = ar.all_reduce_add_rms_norm_start(b2, res, w, 1e-5)()
            torch.cuda.synchronize()
            ov["fused_h_equal"] = bool(torch.equal(got[1], want[1]))
            ov["fused_out_max_diff"] = float((got[0].float() - want[0].float()).abs().max())
    print(f"rank {rank}: overlap {ov}", flush=True)
    out["overlap"] = ov

    # several rounds (small buffers) and the kernel flags, bit-equal to NCCL
    extra = {}
    for name, env in () if not EXTRA else (("rounds_4MB", {"HWKV_CE_CHUNK_MAX": str(4 << 20)}),
                      ("kernel_flags", {"HWKV_CE_SIGNAL": "kernel"})):
        c2 = make(f"ce-{name}-{mode}", {"HWKV_CE_ALLREDUCE": mode, "HWKV_CE_MIN": str(4 << 20), **env})
        a2 = c2._custom
        x = torch.randn(3 * (8 << 20) + 4096 * 3 + 7, device="cuda").to(torch.bfloat16)
        a, b = x.clone(), x.clone()
        c2._group().allreduce([a]).wait()
        info = {"ce_min": a2.ce_min, "signal": a2.ce_signal, "error": a2.ce_error}
        if a2.ce_min:
            a2._ce_run(b)
            torch.cuda.synchronize()
            info["equal_nccl"] = bool(torch.equal(a, b))
            for _ in range(3):
                a2._ce_run(b)
            torch.cuda.synchronize()
            c2.all_reduce_min(1)
            t0 = time.perf_counter()
            for _ in range(10):
                a2._ce_run(b)
            torch.cuda.synchronize()
            info["us_48MB"] = round((time.perf_counter() - t0) / 10 * 1e6, 1)
        print(f"rank {rank}: {name} {info}", flush=True)
        extra[name] = info
        c2.close()
    out["extra"] = extra
    comm.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="ce.json")
    p.add_argument("--extra", action="store_true", help="also several rounds (4 MB buffers) and the kernel flags")
    p.add_argument("--modes", default="2,1", help="HWKV_CE_ALLREDUCE values to probe ('' none)")
    p.add_argument("--norm", action="store_true", help="also the push + RMSNorm kernel at decode rows by warps")
    args = p.parse_args()
    if args.extra:
        os.environ["CE_PROBE_EXTRA"] = "1"
    ctx = mp.get_context("spawn")
    q, res_q = ctx.Queue(), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, 2, q, res_q, args)) for r in range(2)]
    for pr in procs:
        pr.start()
    results = [res_q.get(timeout=240) for _ in procs]
    for pr in procs:
        pr.join(10)
    results.sort(key=lambda r: r["rank"])
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(json.dumps(results[0], indent=1))
    sys.exit(0)


if __name__ == "__main__":
    main()
