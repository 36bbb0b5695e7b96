"""A cuda_ipc peer process for test_ipc.py: owns one buffer on its GPU, serves it, obeys stdin.

argv: device nbytes. Prints one JSON line {"endpoint", "ptr", "pid"}; then per line on stdin:
``fill SEED`` (random bytes, answers their sum), ``sum`` (answers the buffer's byte sum and a
checksum), ``unregister``, ``close``, ``exit``."""

from __future__ import annotations

import json
import sys

import torch
from hwkv_cuda.ipc import CudaIpcMover

from hwkv.transfer.direct import DirectTransfer


def main() -> None:
    device, n = sys.argv[1], int(sys.argv[2])
    torch.cuda.set_device(device)
    buf = torch.zeros(n, dtype=torch.uint8, device=device)
    ep = DirectTransfer(CudaIpcMover(device))
    ep.register(buf.data_ptr(), n)
    print(json.dumps({"endpoint": ep.endpoint(), "ptr": buf.data_ptr(), "pid": __import__("os").getpid()}), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd or cmd[0] == "exit":
            break
        if cmd[0] == "fill":
            g = torch.Generator(device=device).manual_seed(int(cmd[1]))
            buf.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g))
        elif cmd[0] == "unregister":
            ep.unregister(buf.data_ptr())
        elif cmd[0] == "close":
            ep.close()
        torch.cuda.synchronize(device)
        w = torch.arange(n, device=device, dtype=torch.int64) % 65521
        print(json.dumps({"sum": int(buf.long().sum()), "weighted": int((buf.long() * w).sum())}), flush=True)


if __name__ == "__main__":
    main()
