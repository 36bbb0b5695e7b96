"""Probe: the persistent (streaming) GEMV of the decode ops (``stream=N`` in ``HWKV_CUDA_DENSE_CONFIG``,
kernels/dense.py ``dense_kernel_stream``) against the engine's own tile per Llama-3.2-1B projection at one token.

Timed as dense_probe.py does (CUDA-graph replays of a chain over distinct weight copies, PDL on); prints one line a
config (µs, TB/s of weight + activation bytes) and writes stream-probe.json.

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/stream_probe.py --out DIR [--shapes gate_up,down]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import dense_probe
import torch
import triton
from dense_probe import MODELS, Case, run, time_graph
from hwkv_cuda.decode_ops import choose_config

# (block_n, num_warps, preload, programs per SM) per shape: light tiles (45-64 registers at sm_90 for 4-16 rows of 2048
# on 8 warps without a preload) at several programs per SM, the preloaded ones (preload 2: ~110 registers at 8 rows,
# ~64 at 4) at fewer
STREAM = {
    "gate_up": [(8, 8, 0, 2), (8, 8, 0, 3), (8, 8, 0, 4), (8, 8, 0, 5), (8, 8, 1, 2), (8, 8, 2, 2), (16, 8, 0, 3),
                (16, 8, 0, 4), (4, 8, 0, 4), (4, 8, 2, 4), (4, 4, 0, 8), (4, 4, 2, 4),
                (8, 8, 0, 1, 4), (8, 8, 0, 2, 3), (16, 8, 0, 1, 3),  # num_stages: the pipeliner, where it works
                (8, 8, 0, 16), (8, 8, 2, 16)],  # a grid of every tile (one a program, not persistent)
    "lm_head": [(8, 8, 0, 4), (8, 8, 2, 2), (16, 8, 0, 3), (4, 8, 2, 4), (4, 4, 0, 8)],
    "qkv": [(4, 8, 0, 4), (4, 8, 2, 4), (8, 8, 0, 3), (8, 8, 2, 2), (4, 4, 2, 4)],
    "o_proj": [(4, 8, 0, 4), (4, 8, 2, 4), (8, 8, 0, 4), (8, 8, 2, 2), (4, 4, 2, 4), (4, 4, 0, 8)],
    "down": [(2, 8, 0, 2), (2, 8, 2, 1), (2, 8, 1, 1)],
}


def stream_sweep(name: str) -> list[dict]:
    """The streaming configs of ``name`` as HWKV_CUDA_DENSE_CONFIG dicts."""
    return [dict(block_n=bn, block_k=2048, num_warps=wp, num_stages=st[0] if st else 1, preload=pre, evict=0,
                 stream=per) for bn, wp, pre, per, *st in STREAM[name]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp")
    ap.add_argument("--shapes", default="gate_up,qkv,lm_head,o_proj,down")
    ap.add_argument("--limit", type=int, default=0, help="at most this many stream configs a shape (0: all)")
    ap.add_argument("--model", default="llama-1b", help=f"one of {sorted(MODELS)} (dense_probe's shapes)")
    ap.add_argument("--configs", default="", help="JSON {shape: [HWKV_CUDA_DENSE_CONFIG strings]} instead of STREAM "
                    "(for the shapes it names)")
    args = ap.parse_args()
    shapes, dense_probe.H, dense_probe.HKV, dense_probe.D = MODELS[args.model]
    given = json.loads(args.configs) if args.configs else {}
    torch.manual_seed(0)
    res: dict = dict(device=torch.cuda.get_device_name(), date=time.strftime("%Y-%m-%d"), torch=torch.__version__,
                     triton=triton.__version__, rows=[])
    n = 1 << 28
    src, dst = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    res["copy_TBps"] = 2 * n / time_graph(lambda: [dst.copy_(src) for _ in range(16)], 16) / 1e6
    print(f"copy {res['copy_TBps']:.3f} TB/s", flush=True)
    order = args.shapes.split(",")
    for name, N, K, copies in sorted((s for s in shapes if s[0] in order), key=lambda s: order.index(s[0])):
        c = Case(name, N, K, copies, 1)
        row = dict(shape=name, N=N, K=K, M=1, MB=c.bytes / 1e6, configs=[])
        default = dict(choose_config(1, N, K)._asdict())
        sweep = [dict(kv.split("=") for kv in c.split(",")) for c in given[name]] if name in given \
            else stream_sweep(name)
        sweep = [{k: int(v) for k, v in c.items()} for c in sweep]
        for cfg in [default, *(sweep[:args.limit] if args.limit else sweep), default]:
            t0 = time.time()
            run(c, row, cfg, "1")
            if row["configs"] and row["configs"][-1].get("compile_s") is None:
                row["configs"][-1]["compile_s"] = round(time.time() - t0, 1)
                r = row["configs"][-1]
                print(f"{name} {'default' if cfg is default else 'stream'} bn={r['block_n']} w={r['num_warps']} "
                      f"pre={r['preload']} s={r['num_stages']} stream={r.get('stream', 0)}: {r['us']:.2f} us "
                      f"{r['TBps']:.3f} TB/s", flush=True)
        res["rows"].append(row)
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "stream-probe.json").write_text(json.dumps(res, indent=2))
        best = min(row["configs"], key=lambda r: r["us"])
        print(f"BEST {name}: {json.dumps(best)}", flush=True)
    res["compiled"] = compiled_report()
    (Path(args.out) / "stream-probe.json").write_text(json.dumps(res, indent=2))


def compiled_report() -> list[dict]:
    """Every compiled variant of the decode GEMV kernels in this process: registers, spills, shared memory, and
    whether a loop was software-pipelined (async copies in the TTGIR)."""
    from hwkv_cuda.kernels.dense import dense_kernel, dense_kernel_stream

    out = []
    for name, cache in [(f.__name__, c) for f in (dense_kernel, dense_kernel_stream) for c in f.device_caches.values()]:
        for key, k in cache[0].items():
            ttgir = k.asm.get("ttgir", "")
            r = dict(kernel=name, key=str(key)[-300:], num_warps=k.metadata.num_warps, num_stages=k.metadata.num_stages,
                     shared=k.metadata.shared, regs=getattr(k, "n_regs", None), spills=getattr(k, "n_spills", None),
                     async_copies=ttgir.count("async_copy"), tma=ttgir.count("async_tma"))
            print("compiled: " + json.dumps(r), flush=True)
            out.append(r)
    return out


if __name__ == "__main__":
    main()
