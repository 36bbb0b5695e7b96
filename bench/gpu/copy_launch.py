"""pool (#35): staging -> device landing of a restart load, one launch for every KV tensor vs one per tensor.

8B shape (32 layers, 8 KV heads x 128, 16-token blocks, per-layer K+V tensors), bf16 and fp8 KV. A staging
cache in ONE pinned host allocation (as a holder client's shared memory is) lands pieces of PIECE blocks
into scattered device blocks with ``CudaDevice.copy_blocks``; THREADS threads at once (each its own staging
and stream, as the holder clients of a routed load). Prints the host time to queue a piece and the GB/s
end to end, and checks every landed byte. Usage: python3 bench/gpu/copy_launch.py [PIECE] [THREADS,...]
"""

import math
import os
import random
import sys
import threading
import time

import torch
from hwkv_cuda.device import CudaDevice

from hwkv.interfaces.layout import KVCache, KVCacheSpec, KVLayoutKind

PIECE = int(sys.argv[1]) if len(sys.argv) > 1 else 64
THREADS = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "1,4,8").split(",")]
BLOCKS = 512  # an 8k prompt
dev = CudaDevice(0)
L = KVLayoutKind.PER_LAYER


def staging(spec: KVCacheSpec, base: torch.Tensor) -> KVCache:
    """A host cache over ``base`` (pinned, filled): its tensors one after the other, 256-byte aligned."""
    shapes = spec.tensor_shapes(L)
    item = torch.empty((), dtype=spec.dtype).element_size()
    ts, off = [], 0
    for s in shapes:
        ts.append(base[off:off + math.prod(s) * item].view(spec.dtype).view(s))
        off += -(-math.prod(s) * item // 256) * 256
    assert off <= base.numel()
    return KVCache(spec, L, ts)


def run(dtype: torch.dtype, gpu: KVCache, base: torch.Tensor, mode: str, nt: int) -> None:
    os.environ["HWKV_CUDA_COPY_LAUNCH"] = mode
    per = BLOCKS // nt
    share = base.numel() // nt // 256 * 256
    stages = [(staging(KVCacheSpec(32, per, 16, 8, 128, dtype), base[j * share:(j + 1) * share]), dev.new_stream())
              for j in range(nt)]
    dst = random.Random(nt).sample(range(2 * BLOCKS), BLOCKS)
    queue_s = [0.0] * nt

    def land(j: int) -> None:
        st, stream = stages[j]
        for a in range(0, per, PIECE):
            n = min(PIECE, per - a)
            t0 = time.perf_counter()
            dev.copy_blocks(st, gpu, [(a + i, dst[j * per + a + i]) for i in range(n)], stream)
            queue_s[j] += time.perf_counter() - t0

    land(0)  # compile / warm
    torch.cuda.synchronize()
    best = math.inf
    for _ in range(3):
        queue_s[:] = [0.0] * nt
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        th = [threading.Thread(target=land, args=(j,)) for j in range(1, nt)]
        for x in th:
            x.start()
        land(0)
        for x in th:
            x.join()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    ok = all(torch.equal(gpu.tensors[li][dst[j * per + i]].view(torch.uint8).cpu(),
                         stages[j][0].tensors[li][i].view(torch.uint8))
             for j in range(nt) for li in (0, 17, 31) for i in range(0, per, 7))
    gb = BLOCKS * gpu.spec.bytes_per_block / 1e9
    print(f"{str(dtype).split('.')[-1]:>14} launch={mode:<6} threads={nt} pieces of {PIECE}: "
          f"{1e3 * best:.2f} ms for {gb:.3f} GB = {gb / best:.1f} GB/s; queueing per piece "
          f"{1e6 * max(queue_s) / math.ceil(per / PIECE):.0f} us (slowest thread); bytes equal: {ok}", flush=True)


for dtype in (torch.bfloat16, torch.float8_e4m3fn):
    gpu = dev.allocate_kv_cache(KVCacheSpec(32, 2 * BLOCKS, 16, 8, 128, dtype), L)
    nbytes = BLOCKS * gpu.spec.bytes_per_block + 64 * 256 * 8  # room for each thread's alignment
    base = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    base.copy_(torch.randint(0, 120, (nbytes,), dtype=torch.uint8, device="cuda"))
    for mode in ("tensor", "one", "tensor", "one"):
        for nt in THREADS:
            run(dtype, gpu, base, mode, nt)
    del gpu, base
