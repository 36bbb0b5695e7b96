"""Do several holders on one host add get bandwidth? One holder's copies into clients' shared memory
did not run side by side on the H200 host (5.2-5.8 GB/s with 1-8 callers over 1-8 clients,
bench/gpu/holder_tput.py). Here H holders (H in HOLDERS, default 1,2,4) share the pool; N values of
SIZE bytes (SEGS segments each) are put and land on the holders Mooncake's allocator picks; each
value is then read by a holder-mode client attached to the holder that has it (its replica's
segment, from a plain client's batch_get_replica_desc, matched to the port each holder's log names
its segment by; since session 7 the segment names are fixed and MooncakeStore.locate asks), all holders'
clients at once. PLACE=even (default): value i put on holder i mod H (MooncakeStore.put(prefer=), as the
pool's puts do); PLACE=master: where the master's allocator puts them. Prints GB/s (best of 3).
Usage: python bench/gpu/holders_tput.py [N] [SIZE] [SEGS]."""

import ctypes
import os
import sys
import threading
import time
from contextlib import ExitStack

from hwkv.stores.mooncake import MooncakeStore
from hwkv.stores.mooncake_service import mooncake_holder, mooncake_master

N = int(sys.argv[1]) if len(sys.argv) > 1 else 32
SZ = int(sys.argv[2]) if len(sys.argv) > 2 else 16 << 20
SEGS = int(sys.argv[3]) if len(sys.argv) > 3 else 32
keys = [f"k{i}" for i in range(N)]


def split(ptr: int) -> list[tuple[int, int]]:
    seg = SZ // SEGS
    return [(ptr + j * seg, seg) for j in range(SEGS)]


for H in [int(x) for x in os.environ.get("HOLDERS", "1,2,4").split(",")]:
    with ExitStack() as stack:
        m = stack.enter_context(mooncake_master())
        hs = [stack.enter_context(mooncake_holder(m, N * SZ + (256 << 20), timeout_s=60.0, threads=4))
              for _ in range(H)]
        kw = dict(master=m.master, metadata_server=m.metadata_server, global_segment_size=0, timeout_s=30.0)
        cl = []
        for h in hs:
            s = MooncakeStore(**kw, holder=f"127.0.0.1:{h.port}", shm_bytes=N * SZ + (64 << 20))
            stack.callback(s.close)
            p = s.host_buffer(N * SZ)
            ctypes.memset(p, 7, N * SZ)
            s.register_buffer(p, N * SZ)
            cl.append((s, p))
        segs = [h.segment for h in hs]  # each holder's segment name is fixed (mooncake_holder)
        if os.environ.get("PLACE", "even") == "even":  # consecutive values on the holders in turn (the pool's puts)
            prefer = [segs[i % H] for i in range(N)]
        else:  # where the master's allocator puts them
            prefer = None
        assert all(r.ok for r in cl[0][0].put(keys, [split(cl[0][1] + i * SZ) for i in range(N)], prefer))
        meta = MooncakeStore(**kw)
        stack.callback(meta.close)
        where = [segs.index(w[0]) for w in meta.locate(keys)]
        share = [[i for i in range(N) if where[i] == j] for j in range(H)]

        def part(j: int, cl=cl, share=share) -> None:
            s, p = cl[j]
            res = s.get([keys[i] for i in share[j]], [split(p + i * SZ) for i in share[j]])
            assert all(r.ok for r in res), res[:2]

        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            ths = [threading.Thread(target=part, args=(j,)) for j in range(H) if share[j]]
            for x in ths:
                x.start()
            for x in ths:
                x.join()
            best = min(best, time.perf_counter() - t)
        print(f"{H} holder(s), {N} x {SZ >> 10} KiB in {SEGS} segments, values per holder "
              f"{[len(x) for x in share]}: {N * SZ / best / 1e9:.2f} GB/s", flush=True)
