"""Same-run A/B of one decode layer over the same K/V values (issue #36): the bf16 cache and the fp8 cache at their
default tiles (the unified kernel) against the transposed fp8 kernel (HWKV_CUDA_FP8T=1) at each of ``--variants``
(``HWKV_CUDA_FP8T_CONFIG`` values, ``;``-separated). Median of CUDA-graph replays; KV bytes read per second against
the copy bandwidth of the same run; each fp8t row's error against the unified kernel's output over the same codes and
against float32 attention over the dequantised cache. One JSON row per line; ``--out`` writes them all.

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/fp8t_ab.py --batch 32 --context 32768 --out ab.json
"""
import argparse
import json
import os
import time

import torch
from hwkv_cuda import attention_fp8t as fp8t
from hwkv_cuda.attention import CudaMetadataBuilder, TritonAttentionBackend
from hwkv_cuda.bench.attention import _time, copy_bandwidth
from hwkv_cuda.bench.kv_dtype_decode import v_transposed

from hwkv.interfaces.attention import AttentionMetadata
from hwkv.interfaces.kv_quant import FP8_E4M3, v_token_view

ap = argparse.ArgumentParser()
ap.add_argument("--batch", default="32")
ap.add_argument("--context", default="32768")
ap.add_argument("--heads", default="32/8")
ap.add_argument("--head-size", type=int, default=64)
ap.add_argument("--block-size", type=int, default=16)
ap.add_argument("--variants", default="default")
ap.add_argument("--replays", type=int, default=20)
ap.add_argument("--out", default=None)
ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # "cpu": a dry run under the interpreter
a = ap.parse_args()
h, hkv = (int(x) for x in a.heads.split("/"))
d, bs = a.head_size, a.block_size
dev = torch.device(a.device)
bw = copy_bandwidth() if dev.type == "cuda" else 1e12
meta = dict(device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
            heads=a.heads, head_size=d, block_size=bs, copy_bw_TBps=bw / 1e12, date=time.strftime("%Y-%m-%d %H:%M UTC"))
print(json.dumps(meta), flush=True)
rows = []


def save():
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(meta, rows=rows), f, indent=2)


for b in (int(x) for x in a.batch.split(",")):
    for ctx in (int(x) for x in a.context.split(",")):
        nblk = -(-ctx // bs)
        tables = torch.randperm(b * nblk, device=dev)[: b * nblk].to(torch.int32).view(b, nblk)
        md = AttentionMetadata.build([1] * b, [ctx] * b, tables, bs, device=dev)
        dt = torch.bfloat16 if dev.type == "cuda" else torch.float16  # (the interpreter's bf16 dots are wrong)
        q = torch.randn(b, h, d, dtype=dt, device=dev)
        base = torch.randn(b * nblk, 2, bs, hkv, d, dtype=dt, device=dev)
        fp8 = v_transposed((base * 8).to(FP8_E4M3))  # the bf16 values times 8, read with scales 1/8
        scales = torch.full((2, hkv), 0.125, device=dev)
        # float32 attention over the dequantised fp8 cache, a few requests (the exact answer for every fp8 row)
        nref = min(b, 4)
        kk = fp8[tables[:nref].long()]  # [n, w, 2, bs, hkv, d] codes
        k_all = kk[:, :, 0].float().reshape(nref, nblk * bs, hkv, d)[:, :ctx] * 0.125
        v_all = torch.stack([v_token_view(kk[i, :, 1]) for i in range(nref)]).float().reshape(nref, nblk * bs, hkv, d)
        v_all = v_all[:, :ctx] * 0.125
        k_all, v_all = k_all.repeat_interleave(h // hkv, 2), v_all.repeat_interleave(h // hkv, 2)
        s = torch.einsum("nhd,nlhd->nhl", q[:nref].float(), k_all) * d**-0.5
        exact = torch.einsum("nhl,nlhd->nhd", s.softmax(-1), v_all)
        del kk, k_all, v_all, s
        out = torch.empty_like(q)
        unified = None
        cases = [("bf16", "unified", base), ("fp8", "unified", fp8)] + [("fp8", "fp8t:" + v, fp8)
                                                                        for v in a.variants.split(";")]
        for kv_name, variant, kv in cases:
            if variant.startswith("fp8t:"):
                os.environ[fp8t.ENV] = "1"
                v = variant[5:]
                if v == "default":
                    os.environ.pop(fp8t.CONFIG_ENV, None)
                else:
                    os.environ[fp8t.CONFIG_ENV] = v
            else:
                os.environ.pop(fp8t.ENV, None)
            try:
                impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
                impl.kv_scales = scales
                built = CudaMetadataBuilder().build(md)
                run = lambda i=impl, k=kv, m=built, o=out, x=q: i.forward_into(o, x, k, m)  # noqa: E731
                if dev.type == "cuda":
                    t = _time([run], a.replays)
                else:
                    t0 = time.perf_counter()
                    run()
                    t = time.perf_counter() - t0
            except Exception as e:  # noqa: BLE001 - one failing variant must not end the sweep
                print(json.dumps(dict(kv=kv_name, variant=variant, batch=b, context=ctx, error=repr(e)[:400])),
                      flush=True)
                continue
            kv_bytes = b * ctx * hkv * d * 2 * kv.element_size()
            o = out.float()
            row = dict(kv=kv_name, variant=variant, batch=b, context=ctx, us=t * 1e6, TBps=kv_bytes / t / 1e12,
                       fraction_of_copy_bw=kv_bytes / t / bw,
                       splits=fp8t.splits_for(built, hkv, fp8t.config()["block_n"], fp8t.config()["split_target"],
                                              fp8t.config()["min_split"], fp8t.config()["splits"])
                       if variant.startswith("fp8t:") else None)
            if kv_name == "fp8":
                row["rel_err_vs_exact"] = ((o[:nref] - exact).norm() / exact.norm()).item()
                if unified is None:
                    unified = o.clone()
                row["rel_err_vs_fp8_unified"] = ((o - unified).norm() / unified.norm()).item()
            rows.append(row)
            print(json.dumps(row), flush=True)
            save()
        os.environ.pop(fp8t.ENV, None)
        us = {r["variant"]: r["us"] for r in rows if r["batch"] == b and r["context"] == ctx and r["kv"] == "fp8"}
        bf = [r["us"] for r in rows if r["batch"] == b and r["context"] == ctx and r["kv"] == "bf16"]
        good = {k: v for k, v in us.items() if k.startswith("fp8t:") and all(
            r["rel_err_vs_fp8_unified"] < 1e-2 for r in rows if r["variant"] == k and r["batch"] == b)}
        if good and bf and "unified" in us:
            best = min(good, key=good.get)
            summary = dict(shape=f"{b}x{ctx}", best=best, best_us=good[best], fp8_unified_us=us["unified"],
                           bf16_us=bf[0], speedup_vs_fp8_unified=us["unified"] / good[best],
                           speedup_vs_bf16=bf[0] / good[best], fp8_unified_vs_bf16=bf[0] / us["unified"])
            meta.setdefault("summary", []).append(summary)
            print(json.dumps(summary), flush=True)
        del base, fp8
save()
