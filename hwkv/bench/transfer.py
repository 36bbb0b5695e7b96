"""`hwkv bench transfer`: GB/s of one-sided writes between two processes of one host, device-direct
vs tcp staging, in one run.

The bench starts a peer process that owns the destination (``--dst-device``) and serves it through
an endpoint of every protocol measured; this process writes from its source (``--src-device``) in
``--segments`` pieces of ``--sizes`` MiB (the destination order shuffled so no two pieces merge:
the worst case of KV scattered over a block pool), then reads everything back once per setting
and checks it byte for byte. Protocols:

* a device-direct one the backend declares (``cuda_ipc``, one row per ``--methods`` entry;
  ``cma`` for host memory on the CPU backend);
* ``tcp`` staging as the p2p connector does it from device memory: device -> pinned host copy
  here, Mooncake TransferEngine tcp write host -> host, host -> device copy at the peer (each
  part timed, the sum reported);
* ``limit``: the same bytes copied by ``torch`` from one device to the other inside this process
  (``dst.copy_(src)``, contiguous) — the peer-copy limit the others are compared with.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from hwkv.bench import results_dir

MiB = 1 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--src-device", default=None, help="source device (cuda: 'cuda:0'; default: the backend's)")
    p.add_argument("--dst-device", default=None, help="destination device in the peer process ('cuda:1')")
    p.add_argument("--sizes", default="1,16,256,1024", help="MiB per transfer, comma-separated")
    p.add_argument("--segments", default="1,64,512,4096", help="pieces per transfer, comma-separated")
    p.add_argument("--protocols", default="direct,tcp,limit", help="direct (the backend's device-direct "
                   "protocol), tcp (staging), limit (in-process peer copy)")
    p.add_argument("--methods", default="auto", help="cuda_ipc copy methods to compare: auto,memcpy,batch,kernel")
    p.add_argument("--streams", type=int, default=2, help="cuda_ipc copy streams")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tcp-max-mib", type=int, default=256, help="skip tcp staging above this size (slow)")
    p.add_argument("--out-dir", default=None)
    p.add_argument("--tag", default="")
    p.add_argument("--peer", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--peer-bytes", type=int, default=0, help=argparse.SUPPRESS)


def _direct(backend: str, device: str | None, method: str, streams: int) -> Any:
    """The backend's same-host direct endpoint (through its ``create_transfer``: hwkv names no backend package)."""
    from hwkv.plugins import get_backend

    if backend == "cuda":
        return get_backend("cuda").create_transfer(protocol="cuda_ipc", device=device, method=method, streams=streams)
    return get_backend(backend).create_transfer(protocol="cma")


def _alloc(backend: str, device: str | None, nbytes: int, pinned: bool = False) -> Any:
    import torch

    if backend == "cuda" and not pinned:
        return torch.empty(nbytes, dtype=torch.uint8, device=device or "cuda:0")
    t = torch.empty(nbytes, dtype=torch.uint8)
    return t.pin_memory() if pinned and torch.cuda.is_available() else t


def _sync(backend: str) -> None:
    if backend == "cuda":
        import torch

        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _peer(args: argparse.Namespace) -> int:
    """The destination process: endpoints over one buffer; answers commands on stdin."""
    import torch

    n = args.peer_bytes
    dst = _alloc(args.backend, args.dst_device, n)
    dst.zero_()
    eps: dict[str, Any] = {}
    info: dict[str, Any] = {"pid": os.getpid(), "dst": dst.data_ptr()}
    for m in args.methods.split(","):
        if "direct" in args.protocols:
            ep = eps[f"direct-{m}"] = _direct(args.backend, args.dst_device, m, args.streams)
            ep.register(dst.data_ptr(), n)
            info[f"direct-{m}"] = ep.endpoint()
    host = None
    if "tcp" in args.protocols:
        from hwkv.transfer.mooncake import MooncakeTransfer

        host = _alloc(args.backend, None, n, pinned=True) if args.backend == "cuda" else dst
        ep = eps["tcp"] = MooncakeTransfer("tcp", timeout_s=60)
        ep.register(host.data_ptr(), n)
        info["tcp"] = ep.endpoint()
        info["tcp_dst"] = host.data_ptr()
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if cmd[0] == "h2d":  # the staging's last leg: host mirror -> device, timed
            size = int(cmd[1])
            _sync(args.backend)
            t0 = time.perf_counter()
            if host is not None and host is not dst:
                dst[:size].copy_(host[:size], non_blocking=True)
            _sync(args.backend)
            print(json.dumps({"s": time.perf_counter() - t0}), flush=True)
    for ep in eps.values():
        ep.close()
    del torch
    return 0


def _segments(size: int, nseg: int, base_src: int, base_dst: int, rng: random.Random) -> tuple[list, list, list]:
    seg = size // nseg
    order = list(range(nseg))
    rng.shuffle(order)
    if nseg > 1 and order == sorted(order):
        order.reverse()
    src = [base_src + i * seg for i in range(nseg)]
    dst = [base_dst + order[i] * seg for i in range(nseg)]
    return src, dst, [seg] * nseg


def _timed(fn: Any, repeats: int) -> float:
    fn()  # warm: attach, first launch
    best = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best.append(time.perf_counter() - t0)
    best.sort()
    return best[len(best) // 2]  # median


def run(args: argparse.Namespace) -> int:
    if args.peer:
        return _peer(args)
    import torch

    sizes = [int(float(s) * MiB) for s in args.sizes.split(",")]
    segs = [int(s) for s in args.segments.split(",")]
    protos = args.protocols.split(",")
    methods = args.methods.split(",") if args.backend == "cuda" else ["cma"]
    if args.backend == "cuda":
        args.src_device = args.src_device or "cuda:0"
        args.dst_device = args.dst_device or ("cuda:1" if torch.cuda.device_count() > 1 else "cuda:0")
    total = max(sizes)
    peer_cmd = [sys.executable, "-m", "hwkv", "bench", "transfer", "--peer", "--peer-bytes", str(total),
                "--backend", args.backend, "--protocols", args.protocols, "--methods", ",".join(methods),
                "--streams", str(args.streams)] + (["--dst-device", args.dst_device] if args.dst_device else [])
    peer = subprocess.Popen(peer_cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    rows: list[dict[str, Any]] = []
    eps: list[Any] = []
    try:
        line = peer.stdout.readline()
        if not line:
            raise RuntimeError("the peer process exited before it started (see its stderr above)")
        info = json.loads(line)
        src = _alloc(args.backend, args.src_device, total)
        src.copy_(torch.randint(0, 256, (total,), dtype=torch.uint8, device=src.device))
        back = _alloc(args.backend, args.src_device, total)
        rng = random.Random(0)
        if "limit" in protos and args.backend == "cuda":
            far = torch.empty(total, dtype=torch.uint8, device=args.dst_device)
            for size in sizes:
                def copy(size=size):
                    far[:size].copy_(src[:size])
                    torch.cuda.synchronize(src.device)
                    torch.cuda.synchronize(far.device)
                s = _timed(copy, args.repeats)
                rows.append(dict(protocol="limit", method="torch copy_", size_mib=size / MiB, segments=1, seconds=s,
                                 GBps=size / s / 1e9, ok=True))
                print(f"limit {args.src_device}->{args.dst_device} {size / MiB:g} MiB: {size / s / 1e9:.1f} GB/s",
                      flush=True)
            del far
        for m in methods:
            key = f"direct-{m}"
            if key not in info:
                continue
            ep = _direct(args.backend, args.src_device, m, args.streams)
            eps.append(ep)
            ep.register(src.data_ptr(), total)
            ep.register(back.data_ptr(), total)
            for size in sizes:
                for nseg in segs:
                    if size // nseg < 4096:
                        continue
                    sp, dp, ln = _segments(size, nseg, src.data_ptr(), info["dst"], rng)
                    try:
                        s = _timed(lambda ep=ep, peer=info[key], sp=sp, dp=dp, ln=ln: ep.write(peer, sp, dp, ln),
                                   args.repeats)
                        back[:size].zero_()
                        ep.read(info[key], [back.data_ptr() + (a - src.data_ptr()) for a in sp], dp, ln)
                        ok = bool(torch.equal(back[:size], src[:size]))
                    except Exception as e:  # one method failing must not hide the others' figures
                        rows.append(dict(protocol=ep.protocol, method=m, size_mib=size / MiB, segments=nseg,
                                         ok=False, error=f"{type(e).__name__}: {e}"))
                        print(f"{ep.protocol}/{m} {size / MiB:g} MiB x{nseg}: {rows[-1]['error']}", flush=True)
                        continue
                    rows.append(dict(protocol=ep.protocol, method=m, size_mib=size / MiB, segments=nseg, seconds=s,
                                     GBps=size / s / 1e9, ok=ok))
                    print(f"{ep.protocol}/{m} {size / MiB:g} MiB x{nseg}: {size / s / 1e9:.1f} GB/s "
                          f"{'ok' if ok else 'MISMATCH'}", flush=True)
        if "tcp" in info:
            from hwkv.transfer.mooncake import MooncakeTransfer

            ep = MooncakeTransfer("tcp", timeout_s=60)
            eps.append(ep)
            stage = _alloc(args.backend, None, total, pinned=True) if args.backend == "cuda" else src
            ep.register(stage.data_ptr(), total)
            for size in sizes:
                if size > args.tcp_max_mib * MiB:
                    continue
                for nseg in segs:
                    if size // nseg < 4096:
                        continue
                    sp, dp, ln = _segments(size, nseg, stage.data_ptr(), info["tcp_dst"], rng)
                    parts = []
                    for _ in range(max(1, min(args.repeats, 3))):
                        _sync(args.backend)
                        t0 = time.perf_counter()
                        if stage is not src:
                            stage[:size].copy_(src[:size], non_blocking=True)
                            _sync(args.backend)
                        t1 = time.perf_counter()
                        ep.write(info["tcp"], sp, dp, ln)
                        t2 = time.perf_counter()
                        peer.stdin.write(f"h2d {size}\n")
                        peer.stdin.flush()
                        h2d = json.loads(peer.stdout.readline())["s"]
                        parts.append((t1 - t0 + t2 - t1 + h2d, t1 - t0, t2 - t1, h2d))
                    parts.sort()
                    s, d2h, net, h2d = parts[len(parts) // 2]
                    rows.append(dict(protocol="tcp", method="staging", size_mib=size / MiB, segments=nseg,
                                     seconds=s, GBps=size / s / 1e9, ok=True, d2h_s=d2h, tcp_s=net, h2d_s=h2d))
                    print(f"tcp staging {size / MiB:g} MiB x{nseg}: {size / s / 1e9:.2f} GB/s (d2h {d2h * 1e3:.1f} "
                          f"ms, tcp {net * 1e3:.1f} ms, h2d {h2d * 1e3:.1f} ms)", flush=True)
    finally:
        for ep in eps:
            ep.close()
        if peer.poll() is None:
            try:
                peer.stdin.write("exit\n")
                peer.stdin.flush()
                peer.wait(30)
            except Exception:
                peer.kill()
                peer.wait(10)
    device = torch.cuda.get_device_name(0) if args.backend == "cuda" else "cpu"
    res = {"bench": "transfer", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "hwkv bench transfer " + shlex.join(sys.argv[3:]),
           "commit": os.environ.get("HWKV_COMMIT") or _commit(), "device": device, "backend": args.backend,
           "src_device": args.src_device, "dst_device": args.dst_device, "repeats": args.repeats,
           "note": "median of repeats; destination pieces shuffled (no merging); direct rows checked byte for byte "
                   "by a read back", "rows": rows}
    out_dir = Path(args.out_dir) if args.out_dir else _results()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"transfer-{device.replace(' ', '_')}-{time.strftime('%Y-%m-%d', time.gmtime())}"
    stem += f"-{args.tag}" if args.tag else ""
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out_dir / stem}.json")
    return 0 if all(r["ok"] for r in rows) else 1


def _commit() -> str | None:
    from hwkv.bench.serve import _commit as commit

    return commit()


def _results() -> Path:
    return results_dir()
