"""Pool get throughput on this host: N values of SIZE bytes held by a local holder (mooncake_client),
read by holder-mode clients (shared memory) and, unless NO_TCP=1, by a tcp client, with 1, 2 and 4
concurrent callers. Prints GB/s (best of 3). Usage: python bench/gpu/holder_tput.py [N] [SIZE] [SEGS]:
SEGS > 1 splits every value into that many equal segments (the pool connector's values are one
segment per KV tensor: 2 x layers of them, 16-32 KiB each at one block per chunk, 512 KiB at the 8B
shape with 256-token chunks). Environment: PARS (callers, default 1,2,4), CLIENTS (holder-mode
clients the callers are spread over, one shared memory and connection each; default 1; a list
runs each), HOLDER_THREADS (the holder's service threads, default 8), NO_TCP=1."""

import ctypes
import os
import sys
import threading
import time

from hwkv.stores.mooncake import MooncakeStore
from hwkv.stores.mooncake_service import mooncake_holder, mooncake_master

N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
SZ = int(sys.argv[2]) if len(sys.argv) > 2 else 1 << 20
SEGS = int(sys.argv[3]) if len(sys.argv) > 3 else 1
PARS = [int(x) for x in os.environ.get("PARS", "1,2,4").split(",")]
CLIENTS = [int(x) for x in os.environ.get("CLIENTS", "1").split(",")]
TCP = os.environ.get("NO_TCP") != "1"
keys = [f"k{i}" for i in range(N)]


def split(ptr: int) -> list[tuple[int, int]]:
    seg = SZ // SEGS
    return [(ptr + j * seg, seg) for j in range(SEGS)]


def timed(clients: list[tuple[MooncakeStore, int]], par: int) -> float:
    def part(j: int) -> None:
        store, base = clients[j % len(clients)]
        idx = list(range(j, N, par))
        res = store.get([keys[i] for i in idx], [split(base + i * SZ) for i in idx])
        assert all(r.ok for r in res), res[:2]

    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        ths = [threading.Thread(target=part, args=(j,)) for j in range(par)]
        for x in ths:
            x.start()
        for x in ths:
            x.join()
        best = min(best, time.perf_counter() - t)
    return N * SZ / best / 1e9


with mooncake_master() as m, mooncake_holder(m, N * SZ + (256 << 20), timeout_s=60.0,
                                             threads=int(os.environ.get("HOLDER_THREADS", "8"))) as h:
    kw = dict(master=m.master, metadata_server=m.metadata_server, global_segment_size=0, timeout_s=30.0)
    shms = []
    for _ in range(max(CLIENTS)):
        shm = MooncakeStore(**kw, holder=f"127.0.0.1:{h.port}", shm_bytes=N * SZ + (64 << 20))
        p = shm.host_buffer(N * SZ)
        ctypes.memset(p, 7, N * SZ)
        shm.register_buffer(p, N * SZ)
        shms.append((shm, p))
    assert all(r.ok for r in shms[0][0].put(keys, [split(shms[0][1] + i * SZ) for i in range(N)]))
    if TCP:
        buf = (ctypes.c_uint8 * (N * SZ))()
        tcp = MooncakeStore(**kw)
        tcp.register_buffer(ctypes.addressof(buf), N * SZ)
    for par in PARS:
        what = f"get {N} x {SZ >> 10} KiB in {SEGS} segment(s), {par} caller(s)"
        for c in CLIENTS:
            # first: a slow tcp may be cut
            print(f"{what}: holder mode, {c} client(s) {timed(shms[:c], par):.2f} GB/s", flush=True)
        if TCP:
            print(f"{what}: tcp {timed([(tcp, ctypes.addressof(buf))], par):.2f} GB/s", flush=True)
    if TCP:
        tcp.close()
    for shm, _ in shms:
        shm.close()
