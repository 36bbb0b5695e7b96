"""Does Mooncake TransferEngine's intra-node NVLink transport work here? (issue #33's first question)

Two processes, a writer on ``--src`` and a target on ``--dst``; each creates a TransferEngine with
``MC_INTRANODE_NVLINK=1``, initializes it with protocol ``nvlink_intra`` (P2P handshake, no
metadata server), registers a ``cudaMalloc``-ed torch buffer (the default caching allocator, never
expandable segments), and the writer writes 1 MiB .. 256 MiB in 1 .. 4096 pieces with
``batch_transfer_sync_write``, checking bytes through a checksum the target computes. Every step is
bounded; every outcome (an init failure code included) is printed as one JSON line.

    python backends/cuda/scripts/mooncake_nvlink_probe.py --src cuda:0 --dst cuda:1
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MiB = 1 << 20


def _engine(protocol: str):
    import torch

    torch.cuda.init()  # loads libcudart.so.13, which the wheel's engine.so links by soname
    from mooncake.engine import TransferEngine

    e = TransferEngine()
    rc = e.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")
    return e, rc


def target(args: argparse.Namespace) -> None:
    import torch

    torch.cuda.set_device(args.dst)
    buf = torch.zeros(args.bytes, dtype=torch.uint8, device=args.dst)
    e, rc = _engine(args.protocol)
    reg = e.register_memory(buf.data_ptr(), args.bytes) if rc == 0 else None
    print(json.dumps({"init": rc, "register": reg, "port": e.get_rpc_port() if rc == 0 else None,
                      "ptr": buf.data_ptr()}), flush=True)
    for line in sys.stdin:
        if line.strip() == "sum":
            torch.cuda.synchronize()
            w = torch.arange(args.bytes, device=args.dst, dtype=torch.int64) % 65521
            print(json.dumps({"weighted": int((buf.long() * w).sum())}), flush=True)
            buf.zero_()
        else:
            break


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--src", default="cuda:0")
    p.add_argument("--dst", default="cuda:1")
    p.add_argument("--protocol", default="nvlink_intra")
    p.add_argument("--bytes", type=int, default=256 * MiB)
    p.add_argument("--target", action="store_true")
    args = p.parse_args()
    os.environ.setdefault("MC_INTRANODE_NVLINK", "1")
    if args.target:
        target(args)
        return 0
    import torch

    out = {"protocol": args.protocol, "env": {k: v for k, v in os.environ.items() if k.startswith("MC_")}}
    child = subprocess.Popen([sys.executable, __file__, "--target", "--dst", args.dst, "--protocol", args.protocol,
                              "--bytes", str(args.bytes)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        info = json.loads(child.stdout.readline() or "{}")
        out["target"] = info
        torch.cuda.set_device(args.src)
        src = torch.randint(0, 256, (args.bytes,), dtype=torch.uint8, device=args.src)
        e, rc = _engine(args.protocol)
        out["init"] = rc
        if rc != 0 or info.get("init") != 0 or info.get("register") != 0:
            print(json.dumps(out), flush=True)
            return 1
        out["register"] = e.register_memory(src.data_ptr(), args.bytes)
        peer = f"127.0.0.1:{info['port']}"
        rows = []
        w = torch.arange(args.bytes, device=args.src, dtype=torch.int64) % 65521
        for size in (1 * MiB, 16 * MiB, 256 * MiB):
            if size > args.bytes:
                continue
            for nseg in (1, 64, 4096):
                seg = size // nseg
                if seg < 4096:
                    continue
                order = list(range(nseg))[::-1]
                sp = [src.data_ptr() + i * seg for i in range(nseg)]
                dp = [info["ptr"] + order[i] * seg for i in range(nseg)]
                times, rcs = [], []
                for _ in range(4):
                    t0 = time.perf_counter()
                    rcs.append(e.batch_transfer_sync_write(peer, sp, dp, [seg] * nseg))
                    times.append(time.perf_counter() - t0)
                child.stdin.write("sum\n")
                child.stdin.flush()
                got = json.loads(child.stdout.readline())["weighted"]
                expect = torch.zeros(args.bytes, dtype=torch.uint8, device=args.src)
                expect[:size] = src[:size].view(nseg, seg).flip(0).reshape(-1)
                ok = got == int((expect.long() * w).sum())
                s = sorted(times[1:])[1]
                rows.append({"MiB": size / MiB, "segments": nseg, "rc": sorted(set(rcs)), "GBps": size / s / 1e9,
                             "ok": ok})
                print(json.dumps(rows[-1]), flush=True)
        out["rows"] = rows
        print(json.dumps(out), flush=True)
        return 0 if rows and all(r["ok"] and r["rc"] == [0] for r in rows) else 1
    finally:
        if child.poll() is None:
            child.stdin.write("exit\n")
            child.stdin.flush()
            try:
                child.wait(20)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait(10)


if __name__ == "__main__":
    sys.exit(main())
