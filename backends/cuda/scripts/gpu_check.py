"""GPU correctness checks and a tile sweep for hwkv-cuda (run on the device machine).

Correctness: bf16/fp16/fp32 vs a float64 reference on fresh random data, poisoned outputs, all four
attention states, GQA ratios incl. a non-power-of-two group, MQA, block 16/32/64, head 64/128/256,
the split-KV path (fused reduction, the default); write_kv; copy_blocks device<->device/host; CUDA-graph
replay with either split-KV reduction. The float64 reference is backends/cuda/tests/naive.py.
Usage: python backends/cuda/scripts/gpu_check.py [check] [sweep] [--out DIR]
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
# the package, the repo root (hwkv) and the tests' float64 reference (one copy, tests/naive.py)
sys.path[:0] = [os.path.join(HERE, ".."), os.path.join(HERE, "../../.."), os.path.join(HERE, "../tests")]

from hwkv_cuda.attention import CudaMetadataBuilder, TritonAttentionBackend  # noqa: E402
from naive import naive_attention as reference  # noqa: E402

from hwkv.interfaces.attention import AttentionMetadata  # noqa: E402
from hwkv.interfaces.layout import KVCacheSpec, KVLayoutKind  # noqa: E402

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def one(qlens, slens, h, hkv, d, bs, dtype, gen):
    need = [-(-s // bs) for s in slens]
    nb = sum(need) + 7
    perm = torch.randperm(nb, generator=gen).tolist()
    tables, i = [], 0
    for n in need:
        tables.append(perm[i:i + n])
        i += n
    kv = torch.randn(nb, 2, bs, hkv, d, generator=gen).to("cuda", dtype)
    q = torch.randn(sum(qlens), h, d, generator=gen).to("cuda", dtype)
    md = CudaMetadataBuilder().build(AttentionMetadata.build(qlens, slens, tables, bs, "cuda"))
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d ** -0.5)
    out = torch.full_like(q, float("nan"))
    impl.forward_into(out, q, kv, md)
    ref = reference(q, kv, qlens, slens, tables, d ** -0.5)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    splits = max(p.splits for p in md.plans.values())
    ok = bool(not out.isnan().any()) and err < TOL[dtype]
    return dict(qlens=qlens[:6], slens=slens[:6], heads=f"{h}/{hkv}", d=d, bs=bs, dtype=str(dtype)[6:],
                err=err, splits=splits, ok=ok)


BATCHES = {
    "decode_split": ([1, 1, 1, 1], [1, 17, 3000, 9000]),
    "prefill_no_cache": ([300, 77], [300, 77]),
    "prefill_on_prefix": ([64, 513, 1], [2000, 1513, 4000]),
    "mixed": ([1, 200, 1, 33, 1], [5000, 700, 64, 33, 129]),
}


def check(dtypes=(torch.bfloat16, torch.float16, torch.float32)) -> list[dict]:
    gen = torch.Generator().manual_seed(1234)
    res = [check_write_kv(gen), check_copy_blocks(), check_graph(gen, "fused"), check_graph(gen, "kernel")]
    combos = [((32, 8), 128, 16), ((32, 32), 128, 16), ((16, 1), 64, 32), ((12, 4), 256, 64), ((8, 2), 64, 16)]
    for dtype in dtypes:
        for (h, hkv), d, bs in combos:
            for name, (ql, sl) in BATCHES.items():
                r = one(ql, sl, h, hkv, d, bs, dtype, gen)
                r["state"] = name
                res.append(r)
                print(("OK  " if r["ok"] else "FAIL"), name, r["heads"], d, bs, r["dtype"], f"{r['err']:.2e}",
                      f"splits={r['splits']}", flush=True)
    return res


def check_write_kv(gen) -> dict:
    """-1 slots skipped; out-of-range slots (past the end, below -1) skipped too: the cache is a view
    between two guard blocks that must stay untouched."""
    impl = TritonAttentionBackend().make_impl(8, 128, 4, 1.0)
    big = torch.randn(66, 2, 16, 4, 128, generator=gen).to("cuda", torch.bfloat16)
    kv = big[1:-1]
    exp = big.clone()
    qkv = torch.randn(100, 16, 128, generator=gen).to("cuda", torch.bfloat16)
    key, value = qkv[:, 8:12], qkv[:, 12:]
    slots = torch.randperm(64 * 16, generator=gen)[:100].cuda()
    slots[::7] = -1
    slots[3], slots[5], slots[9] = 64 * 16, 64 * 16 + 5, -17
    impl.write_kv(key, value, kv, slots)
    for t, s in enumerate(slots.tolist()):
        if 0 <= s < 64 * 16:
            exp[1 + s // 16, 0, s % 16], exp[1 + s // 16, 1, s % 16] = key[t], value[t]
    ok = torch.equal(big, exp)
    print("OK  " if ok else "FAIL", "write_kv with -1 and out-of-range slots", flush=True)
    return dict(state="write_kv", ok=ok)


def check_copy_blocks() -> dict:
    from hwkv_cuda.device import CudaDevice

    dev = CudaDevice(0)
    spec = KVCacheSpec(num_layers=4, num_blocks=2048, block_size=16, num_kv_heads=8, head_size=128,
                       dtype=torch.bfloat16)
    gpu = dev.allocate_kv_cache(spec, KVLayoutKind.PER_LAYER)
    for t in gpu.tensors:
        t.normal_()
    host = dev.allocate_kv_cache(spec, KVLayoutKind.PER_LAYER, host=True)
    gpu2 = dev.allocate_kv_cache(spec, KVLayoutKind.PER_LAYER)
    pairs = [(i, 2047 - i) for i in range(0, 2000, 2)]
    out: dict = dict(state="copy_blocks")
    for name, src, dst, ps in (("d2h", gpu, host, pairs), ("h2d", host, gpu2, [(d, s) for s, d in pairs]),
                               ("d2d", gpu, gpu2, [(s, s + 1) for s, _ in pairs])):
        dev.copy_blocks(src, dst, ps)
        dev.synchronize()
        t0 = time.perf_counter()
        s = dev.new_stream()
        dev.copy_blocks(src, dst, ps, stream=s)
        s.synchronize()
        dt = time.perf_counter() - t0
        nbytes = len(ps) * spec.bytes_per_block
        out[f"{name}_GBps"] = round(nbytes / dt / 1e9, 1)
    ok = all(torch.equal(gpu2.tensors[i][s], gpu.tensors[i][s]) for i in range(4) for s, _ in pairs[:50])
    ok = ok and all(torch.equal(host.tensors[i][d].cuda(), gpu.tensors[i][s]) for i in range(4) for s, d in pairs[:50])
    out["ok"] = ok
    print("OK  " if ok else "FAIL", "copy_blocks", {k: v for k, v in out.items() if k.endswith("GBps")}, flush=True)
    return out


def check_graph(gen, mode: str) -> dict:
    """Capture then replay with new queries, in one split-KV reduction mode (``HWKV_CUDA_SPLIT_REDUCE``)."""
    os.environ["HWKV_CUDA_SPLIT_REDUCE"] = mode
    qlens, slens, bs = [1] * 8, [4000 + 37 * i for i in range(8)], 16
    need = [-(-s // bs) for s in slens]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(8)]
    kv = torch.randn(sum(need), 2, bs, 8, 128, generator=gen).to("cuda", torch.bfloat16)
    q = torch.randn(8, 32, 128, generator=gen).to("cuda", torch.bfloat16)
    md = CudaMetadataBuilder().build(AttentionMetadata.build(qlens, slens, tables, bs, "cuda"))
    impl = TritonAttentionBackend().make_impl(32, 128, 8, 128 ** -0.5)
    out = torch.empty_like(q)
    impl.forward_into(out, q, kv, md)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        impl.forward_into(out, q, kv, md)
    q.copy_(torch.randn(8, 32, 128, generator=gen).to("cuda", torch.bfloat16))
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    ref = reference(q, kv, qlens, slens, tables, 128 ** -0.5)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    os.environ.pop("HWKV_CUDA_SPLIT_REDUCE")
    ok = err < 1e-2
    print("OK  " if ok else "FAIL", f"cuda graph replay ({mode} reduce) err {err:.2e} "
          f"splits={max(p.splits for p in md.plans.values())}")
    return dict(state=f"graph_replay_{mode}", err=err, ok=ok)


DECODE_TILES = [f"block_n={n},num_warps={w},num_stages={st}" for n in (32, 64, 128) for w in (4, 8)
                for st in (2, 3, 4)]
SPLITS = [f"split_target={t},min_split={m}" for t in (0, 1, 2, 4, 8) for m in (128, 256, 512, 1024)]
PREFILL_TILES = [f"block_m={m},block_q={m // 4},block_n={n},num_warps={w},num_stages={st}"
                 for m, w in ((128, 8), (128, 4), (64, 4)) for n in (32, 64, 128) for st in (2, 3, 4)]
SWEEP = {  # shape: (batch, H, H_kv, q_len, prefix), configs
    "decode b64 ctx4k 32/8": ((64, 32, 8, 1, 4095), DECODE_TILES + SPLITS[:8]),
    "decode b64 ctx1k 32/8": ((64, 32, 8, 1, 1023), DECODE_TILES + SPLITS[:8]),
    "decode b256 ctx1k 32/32": ((256, 32, 32, 1, 1023), DECODE_TILES),
    "decode b1 ctx16k 32/8": ((1, 32, 8, 1, 16383), SPLITS + ["block_n=128", "block_n=32", "num_warps=8"]),
    "decode b8 ctx16k 32/8": ((8, 32, 8, 1, 16383), SPLITS + ["block_n=128", "block_n=32", "num_warps=8"]),
    "decode b1 ctx1k 32/8": ((1, 32, 8, 1, 1023), SPLITS[:12]),
    "prefill 4k on 0 32/8": ((1, 32, 8, 4096, 0), PREFILL_TILES),
    "prefill 2k on 16k 32/8": ((1, 32, 8, 2048, 16384), PREFILL_TILES),
}


def sweep() -> list[dict]:
    from hwkv_cuda.bench.attention import Case, _time

    res = []
    for name, ((b, h, hkv, ql, pre), cfgs) in SWEEP.items():
        case = Case(b, h, hkv, ql, pre, 128, 16, torch.bfloat16)
        for cfg in ["", *cfgs]:
            os.environ["HWKV_CUDA_ATTN_CONFIG"] = cfg
            try:
                t = _time(case.ours(), 10)
                r = dict(shape=name, cfg=cfg or "default", us=round(t * 1e6, 1),
                         tbps=round(case.bytes / t / 1e12, 3), tflops=round(case.flops / t / 1e12, 1))
            except Exception as e:  # noqa: BLE001
                r = dict(shape=name, cfg=cfg, error=str(e).splitlines()[0][:150])
            print(r, flush=True)
            res.append(r)
        os.environ.pop("HWKV_CUDA_ATTN_CONFIG", None)
        del case
        torch.cuda.empty_cache()
    return res


if __name__ == "__main__":
    out_dir = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else "."
    print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name(), flush=True)
    results: dict = {}
    if "check" in sys.argv or "quickcheck" in sys.argv:
        results["check"] = check() if "check" in sys.argv else check((torch.bfloat16,))
        bad = [r for r in results["check"] if not r["ok"]]
        print(f"correctness: {len(results['check']) - len(bad)}/{len(results['check'])} OK", flush=True)
    if "sweep" in sys.argv:
        results["sweep"] = sweep()
        best: dict = {}
        for r in results["sweep"]:
            if "us" in r and (r["shape"] not in best or r["us"] < best[r["shape"]]["us"]):
                best[r["shape"]] = r
        default = {r["shape"]: r for r in results["sweep"] if r.get("cfg") == "default"}
        for k, r in best.items():
            print(f"BEST {k}: {r['cfg']} {r['us']}us ({r['tbps']} TB/s, {r['tflops']} TF/s); "
                  f"default {default.get(k, {}).get('us')}us")
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
