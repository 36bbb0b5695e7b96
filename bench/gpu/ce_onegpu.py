"""The one-shot copy-engine all-reduce's device mechanics on ONE GPU: two ranks in one process, each with its own
"current" stream and side stream, their buffers both on this GPU (the copies are device-to-device on the copy
engines, not NVLink), flags by stream memory operations. Checks every rank's sums and fused add + RMSNorm against
the reference over many calls, each started with the one before in flight (the prefill halves' pattern), that
nothing deadlocks although the four streams may share hardware queues (a stuck device is reported after 5 s), and
times a call (local copies). Where two GPUs are not lent, this is what can run.

    python3 bench/gpu/ce_onegpu.py --out ce-onegpu.json
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import time

import torch
from hwkv_cuda.ce_allreduce import CopyEngineOneShot, CudaTransport

from hwkv.model.layers import add_rms_norm


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--slot-mb", type=int, default=128)
    ap.add_argument("--signal", default="memop")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(20, exit=True)  # where the host is, if anything hangs
    print(f"start: signal {args.signal}, slot {args.slot_mb} MB", flush=True)
    dev = torch.device("cuda", 0)
    ws, slot = 2, args.slot_mb << 20
    bufs = [torch.zeros(CopyEngineOneShot.buffer_bytes(ws, slot), dtype=torch.uint8, device=dev) for _ in range(ws)]
    addrs = [b.data_ptr() for b in bufs]
    mains = [torch.cuda.Stream(dev) for _ in range(ws)]
    ranks = []
    for r in range(ws):
        tr = CudaTransport(dev, args.signal)
        side = torch.cuda.Stream(dev, priority=-1)
        tr.stream = side
        ranks.append(CopyEngineOneShot(r, ws, addrs, bufs[r], slot, tr, side))
    out: dict = {"signal": args.signal, "slot_mb": args.slot_mb}

    def run(calls: list[list[tuple]]) -> list[list]:
        """calls[r]: (tensor, norm) per call; two in flight per rank; ranks' host calls interleaved."""
        torch.cuda.synchronize()  # the inputs (made on the default stream) before the ranks' own streams
        res: list[list] = [[] for _ in range(ws)]
        waits: list[list] = [[] for _ in range(ws)]
        for i in range(len(calls[0])):
            for r in range(ws):
                with torch.cuda.stream(mains[r]):
                    waits[r].append(ranks[r].start(calls[r][i][0], norm=calls[r][i][1]))
                    if len(waits[r]) == 2:
                        res[r].append(waits[r].pop(0)())
        for r in range(ws):
            with torch.cuda.stream(mains[r]):
                res[r] += [w() for w in waits[r]]
        done = [torch.cuda.Event() for _ in range(ws)]
        for r in range(ws):
            done[r].record(mains[r])
        t0 = time.monotonic()
        while not all(d.query() for d in done):  # a device-side deadlock is reported, not waited for forever
            if time.monotonic() - t0 > 5:
                print("DEVICE STUCK: the ranks' streams did not finish within 5 s", flush=True)
                os._exit(3)
            time.sleep(0.001)
        torch.cuda.synchronize()
        return res

    g = torch.Generator(device=dev).manual_seed(0)
    hid = 4096
    shapes = [(8192, hid), (8192, hid), (16384, hid), (3000, hid), (8192 * 4096 + 123,)]
    norms = [True, True, False, True, False]
    w = (torch.rand(hid, device=dev, generator=g) + 0.5).to(torch.bfloat16)
    resid = {i: torch.randn(s, device=dev, generator=g).to(torch.bfloat16) for i, s in enumerate(shapes) if norms[i]}
    parts = [[torch.randn(s, device=dev, generator=g).to(torch.bfloat16) for s in shapes] for _ in range(ws)]
    for rep in range(3):  # the flags and parities keep going across repetitions
        calls = [[(parts[r][i].clone(), (resid[i], w, 1e-5) if norms[i] else None) for i in range(len(shapes))]
                 for r in range(ws)]
        t0 = time.perf_counter()
        got = run(calls)
        dt = time.perf_counter() - t0
        bad = []
        for i in range(len(shapes)):
            s = (parts[0][i].float() + parts[1][i].float()).to(torch.bfloat16)
            want = add_rms_norm(s, resid[i], w, 1e-5) if norms[i] else s
            for r in range(ws):
                if norms[i]:
                    if not torch.equal(got[r][i][1], want[1]):
                        bad.append(f"call {i} rank {r}: h")
                    d = (got[r][i][0].float() - want[0].float()).abs().max().item()
                    if d > 0.02 * want[0].float().abs().max().item():
                        bad.append(f"call {i} rank {r}: norm off by {d}")
                    if not torch.equal(got[0][i][0], got[1][i][0]):
                        bad.append(f"call {i}: ranks' norms differ")
                elif not torch.equal(got[r][i], want):
                    bad.append(f"call {i} rank {r}: sum")
        out[f"rep{rep}"] = {"ok": not bad, "bad": bad[:8], "seconds": round(dt, 4)}
        print(f"rep {rep}: ok={not bad} {bad[:4]} {dt * 1e3:.1f} ms", flush=True)
    # a 64 MB round alone, both ranks (local device-to-device copies: HBM, not NVLink)
    x = [torch.randn(8192, hid, device=dev, generator=g).to(torch.bfloat16) for _ in range(ws)]
    for it in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        n = 20
        for _ in range(n):
            run([[(x[r], (resid[0], w, 1e-5))] for r in range(ws)])
        out[f"fused_64MB_pair_us_{it}"] = round((time.perf_counter() - t0) / n * 1e6, 1)
    print(json.dumps(out), flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
