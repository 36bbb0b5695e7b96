"""A/B of the split-KV reductions on decode shapes that split (GQA 32/8, head 128, bf16, block 16):
the fused last-split merge (``HWKV_CUDA_SPLIT_REDUCE=fused``, default) against the two-kernel
reduction (``=kernel``), with torch SDPA (default backend, contiguous KV) for reference. Same harness
as ``hwkv bench attention``: scattered 16-token pages, inputs rotated so nothing sits in L2, every
implementation timed as CUDA-graph replays, median of the replays; TB/s over KV + Q + O bytes.

Variants: ``kernel``; ``fused`` (its own plan: the merge cap may give fewer splits); ``fused-nocap``
(``merge_cap=0``: the kernel path's split count, so the reduction alone differs; skipped where the
plans agree); plus one fused variant per ``--configs`` entry (``HWKV_CUDA_ATTN_CONFIG`` strings,
``;``-separated). Each variant's output on the first input is checked against the float64 reference
before it is timed. Run on the device machine, from the repo root::

    export PYTHONPATH=.:backends/cuda
    python3 backends/cuda/scripts/reduce_ab.py --out /tmp/hwkv-out [--configs "merge_cap=4;merge_regs=64"]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE.parents[2]), str(HERE.parent / "tests")]

from hwkv_cuda.attention import CudaMetadataBuilder, TritonAttentionBackend  # noqa: E402
from hwkv_cuda.bench.attention import Case, _time  # noqa: E402
from naive import naive_attention  # noqa: E402

SHAPES = [(1, 8192), (1, 16384), (1, 4096), (1, 1024), (8, 4096), (8, 16384)]  # (batch, context), headline first
H, HKV, D, BS = 32, 8, 128, 16


def _variants(configs: str) -> list[tuple[str, str, str]]:
    """(name, HWKV_CUDA_SPLIT_REDUCE, HWKV_CUDA_ATTN_CONFIG)."""
    out = [("kernel", "kernel", ""), ("fused", "fused", ""), ("fused-nocap", "fused", "merge_cap=0")]
    return out + [(f"fused[{c}]", "fused", c) for c in filter(None, (c.strip() for c in configs.split(";")))]


def _set_env(mode: str, cfg: str) -> None:
    os.environ["HWKV_CUDA_SPLIT_REDUCE"] = mode
    os.environ["HWKV_CUDA_ATTN_CONFIG"] = cfg


def _check(case: Case, ref: torch.Tensor) -> tuple[int, float]:
    """Split count and relative error of one eager forward on the first rotated input."""
    impl = TritonAttentionBackend().make_impl(H, D, HKV, D ** -0.5)
    md = CudaMetadataBuilder().build(case.md[0])
    out = torch.full_like(case.q[0], float("nan"))
    impl.forward_into(out, case.q[0], case.kv, md)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    return max(p.splits for p in md.plans.values()), err


def measure(batch: int, ctx: int, variants: list[tuple[str, str, str]], replays: int) -> list[dict]:
    case = Case(batch, H, HKV, 1, ctx - 1, D, BS, torch.bfloat16)
    c0 = case.md[0]
    ref = naive_attention(case.q[0], case.kv, [1] * batch, [ctx] * batch, c0.block_tables, D ** -0.5)
    rows, plans = [], {}
    for name, mode, cfg in variants:
        _set_env(mode, cfg)
        row: dict = dict(batch=batch, ctx=ctx, impl=name, reduce=mode, config=cfg or "default")
        try:
            splits, err = _check(case, ref)
            row.update(splits=splits, err=float(f"{err:.3g}"), ok=err < 1e-2)
            if name == "fused-nocap" and plans.get("fused") == splits:
                row["skipped"] = "same split count as fused"
            else:
                plans[name] = splits
                t = _time(case.ours(), replays)
                row.update(us=round(t * 1e6, 2), tbps=round(case.bytes / t / 1e12, 3))
        except Exception as e:  # noqa: BLE001 - one variant failing must not hide the others
            row.update(ok=False, error=f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
        rows.append(row)
    os.environ.pop("HWKV_CUDA_ATTN_CONFIG", None)
    os.environ.pop("HWKV_CUDA_SPLIT_REDUCE", None)
    try:
        t = _time(case.sdpa(), replays)
        rows.append(dict(batch=batch, ctx=ctx, impl="sdpa", us=round(t * 1e6, 2),
                         tbps=round(case.bytes / t / 1e12, 3)))
    except Exception as e:  # noqa: BLE001
        rows.append(dict(batch=batch, ctx=ctx, impl="sdpa", error=f"{type(e).__name__}: {e}"[:200]))
    del case
    torch.cuda.empty_cache()
    return rows


def _line(rows: list[dict]) -> str:
    b, ctx = rows[0]["batch"], rows[0]["ctx"]
    us = {r["impl"]: r["us"] for r in rows if "us" in r}
    parts = []
    for r in rows:
        if "us" in r:
            s = f"{r['impl']} {r['us']:.1f}us {r['tbps']:.2f}TB/s"
            if "splits" in r:
                s += f" S={r['splits']} err={r['err']:.1e}"
            parts.append(s)
        else:
            parts.append(f"{r['impl']} {r.get('skipped') or r.get('error')}")
    ratio = ""
    if "fused" in us and "kernel" in us:
        ratio = f" | fused/kernel {us['fused'] / us['kernel']:.3f}"
    if "fused" in us and "sdpa" in us:
        ratio += f", sdpa/fused {us['sdpa'] / us['fused']:.3f}"
    return f"b{b} ctx{ctx}: " + "; ".join(parts) + ratio


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="directory for reduce_ab.json")
    p.add_argument("--configs", default="", help="extra fused variants: ';'-separated HWKV_CUDA_ATTN_CONFIG strings")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--budget-s", type=float, default=80.0, help="skip the remaining shapes after this long")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("reduce_ab needs a CUDA GPU", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    start = time.monotonic()
    dev = torch.cuda.get_device_name()
    print(f"{dev}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    variants = _variants(args.configs)
    results: list[dict] = []
    for b, ctx in SHAPES:
        if time.monotonic() - start > args.budget_s:
            results.append(dict(batch=b, ctx=ctx, impl="all", skipped=f"time budget {args.budget_s}s spent"))
            print(f"b{b} ctx{ctx}: skipped (time budget)", flush=True)
            continue
        rows = measure(b, ctx, variants, args.replays)
        results.extend(rows)
        print(_line(rows), flush=True)
    meta = dict(device=dev, torch=torch.__version__, triton=triton.__version__, heads=f"{H}/{HKV}", head_size=D,
                block_size=BS, dtype="bfloat16", command=" ".join(sys.argv),
                date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                wall_s=round(time.monotonic() - start, 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "reduce_ab.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    bad = [r for r in results if r.get("ok") is False]
    print(f"wrote {out / 'reduce_ab.json'} in {meta['wall_s']} s; {len(bad)} variant(s) failed the check", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
