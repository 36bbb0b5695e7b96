"""`hwkv bench attention`: the CUDA backend's paged attention vs torch SDPA and FlexAttention, same run.

Decode (batch x context x heads) and prefill chunks on a cached prefix. Ours reads a paged KV cache
with scattered blocks; SDPA (default backend) and FlexAttention (``flex``: compiled, block mask) read
equivalent contiguous KV; ``flex-paged`` is FlexAttention reading our paged cache in place
(:mod:`hwkv_cuda.bench.flex_paged`). Inputs rotate over several copies so no shape is timed out of L2; each
implementation is timed as CUDA-graph replays (eager loop where capture fails). Reported: median
time, achieved TB/s over the bytes that must move (KV + Q + O), % of the device-to-device copy
bandwidth measured in this run, and causal TFLOP/s for prefill.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

from hwkv.bench import results_dir

PEERS = ("sdpa", "flex", "flex-paged")
ROTATE_BYTES = 256 << 20  # rotate inputs until at least this much is touched per graph replay


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--heads", default="32/8,32/32", help="comma list of H/H_kv")
    p.add_argument("--batches", default="1,8,64,256", help='comma list; "" runs no decode')
    p.add_argument("--contexts", default="1024,4096,8192,16384")
    p.add_argument("--prefill", default="512:0,512:4096,512:16384,2048:0,2048:4096,2048:16384,4096:0,4096:4096,"
                   "4096:16384", help="comma list of chunk:prefix (batch 1)")
    p.add_argument("--peers", default=",".join(PEERS), help=f"comma list from {', '.join(PEERS)}")
    p.add_argument("--flex-budget-s", type=float, default=240.0, help="stop compiling FlexAttention after this")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--out", default=None, help="JSON path (default <results_dir>/attention-<device>-<date>.json)")


def _ints(csv: str) -> list[int]:
    """``"1,8,"`` -> ``[1, 8]``; an empty list skips that kind of shape."""
    return [int(x) for x in csv.split(",") if x.strip()]


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + bytes written per second."""
    import torch

    a = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * nbytes / _time([lambda: b.copy_(a)], replays=20, graph=False)


def _time(fns: list, replays: int, graph: bool = True) -> float:
    """Median seconds per call over replays of all ``fns`` (one per rotated input set)."""
    import torch

    for f in fns:
        f()
    torch.cuda.synchronize()
    run = lambda: [f() for f in fns]
    if graph:
        try:
            g = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                run()
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(g):
                run()
            run = g.replay
        except Exception:  # noqa: BLE001 - peers that cannot be captured are timed eagerly
            torch.cuda.synchronize()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / len(fns))
    return sorted(times)[len(times) // 2]


class Case:
    """One shape: paged inputs for ours and contiguous inputs for the peers, ``rot`` copies each."""

    def __init__(self, batch, heads, kv_heads, q_len, prefix, head_size, block_size, dtype):
        import torch

        from hwkv.interfaces.attention import AttentionMetadata

        self.b, self.h, self.hkv, self.q_len, self.prefix, self.d = batch, heads, kv_heads, q_len, prefix, head_size
        self.seq = prefix + q_len
        es = torch.empty((), dtype=dtype).element_size()
        self.kv_bytes = batch * self.seq * kv_heads * head_size * 2 * es
        self.bytes = self.kv_bytes + 2 * batch * q_len * heads * head_size * es
        self.flops = 4 * batch * heads * head_size * sum(prefix + i + 1 for i in range(q_len))
        self.rot = max(1, min(64, math.ceil(ROTATE_BYTES / self.kv_bytes)))
        per_seq = -(-self.seq // block_size)
        nb = self.rot * batch * per_seq
        self.kv = torch.randn(nb, 2, block_size, kv_heads, head_size, dtype=dtype, device="cuda")
        perm = torch.randperm(nb, device="cuda").to(torch.int32).view(self.rot, batch, per_seq)
        self.md = [AttentionMetadata.build([q_len] * batch, [self.seq] * batch, perm[r], block_size, "cuda")
                   for r in range(self.rot)]
        self.q = [torch.randn(batch * q_len, heads, head_size, dtype=dtype, device="cuda") for _ in range(self.rot)]
        self.out = torch.empty_like(self.q[0])

    def ours(self) -> list:
        from hwkv_cuda.attention import CudaMetadataBuilder, TritonAttentionBackend

        impl = TritonAttentionBackend().make_impl(self.h, self.d, self.hkv, self.d ** -0.5)
        mds = [CudaMetadataBuilder().build(m) for m in self.md]
        return [lambda r=r: impl.forward_into(self.out, self.q[r], self.kv, mds[r]) for r in range(self.rot)]

    def contiguous(self):
        import torch

        shp = lambda n: (self.b, n, self.seq, self.d)
        k = [torch.randn(shp(self.hkv), dtype=self.kv.dtype, device="cuda") for _ in range(self.rot)]
        v = [torch.randn(shp(self.hkv), dtype=self.kv.dtype, device="cuda") for _ in range(self.rot)]
        q = [x.view(self.b, self.q_len, self.h, self.d).transpose(1, 2) for x in self.q]
        return q, k, v

    def sdpa(self) -> list:
        import torch.nn.functional as F
        from torch.nn.attention.bias import causal_lower_right

        q, k, v = self.contiguous()
        kw: dict[str, Any] = {}
        if self.q_len > 1 and self.prefix == 0:
            kw["is_causal"] = True
        elif self.q_len > 1:
            kw["attn_mask"] = causal_lower_right(self.q_len, self.seq)
        gqa = self.h != self.hkv
        return [lambda r=r: F.scaled_dot_product_attention(q[r], k[r], v[r], enable_gqa=gqa, **kw)
                for r in range(self.rot)]

    def flex(self) -> list:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v = self.contiguous()
        off = self.prefix
        mask = None
        if self.q_len > 1:
            mask = create_block_mask(lambda b, h, qi, ki: qi + off >= ki, None, None, self.q_len, self.seq, "cuda")
        fn = _compiled_flex(flex_attention)
        gqa = self.h != self.hkv
        return [lambda r=r: fn(q[r], k[r], v[r], block_mask=mask, enable_gqa=gqa) for r in range(self.rot)]

    def flex_paged(self) -> list:
        """FlexAttention on our paged cache (hwkv_cuda.bench.flex_paged). One input set: its mask_mod is
        specialised to one block table, so at shapes under ROTATE_BYTES its KV may sit in L2 (in its favour)."""
        from torch.nn.attention.flex_attention import flex_attention

        from hwkv_cuda.bench.flex_paged import paged_flex_args

        a = paged_flex_args(self.kv, self.md[0].block_tables, self.q_len, self.seq)
        fn = _compiled_flex(flex_attention)
        q = self.q[0].view(self.b, self.q_len, self.h, self.d).transpose(1, 2)
        return [lambda: fn(q, a["k"], a["v"], block_mask=a["block_mask"], enable_gqa=self.h != self.hkv,
                           kernel_options=a["kernel_options"])]


_FLEX = None


def _compiled_flex(flex_attention):
    global _FLEX
    if _FLEX is None:
        import torch

        torch._dynamo.config.cache_size_limit = 512
        torch._dynamo.config.accumulated_cache_size_limit = 4096
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def _measure(case: Case, peers: list[str], args, copy_bw: float, flex_deadline: float) -> list[dict]:
    import torch

    rows = []
    impls = [("hwkv-cuda", case.ours), *[(p, getattr(case, p.replace("-", "_"))) for p in peers]]
    for name, make in impls:
        row: dict[str, Any] = dict(impl=name)
        if name.startswith("flex") and time.monotonic() > flex_deadline:
            row["error"] = "skipped: FlexAttention compile budget spent (--flex-budget-s)"
        else:
            try:
                t = _time(make(), args.replays)
                row.update(time_us=round(t * 1e6, 2), tbps=round(case.bytes / t / 1e12, 3),
                           pct_copy=round(100 * case.bytes / t / copy_bw, 1))
                if case.q_len > 1:
                    row["tflops"] = round(case.flops / t / 1e12, 1)
            except Exception as e:  # noqa: BLE001 - a peer that does not run is recorded, not fatal
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def run(args: argparse.Namespace) -> int:
    import torch

    peers = [p for p in args.peers.split(",") if p]
    if unknown := [p for p in peers if p not in PEERS]:
        print(f"unknown --peers {', '.join(unknown)}: choose from {', '.join(PEERS)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("hwkv bench attention needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(0)
    heads = [tuple(int(x) for x in hs.split("/")) for hs in args.heads.split(",")]
    copy_bw = copy_bandwidth()
    dev = torch.cuda.get_device_name()
    print(f"{dev}: device-to-device copy {copy_bw / 1e12:.3f} TB/s (read+write)", flush=True)
    flex_deadline = time.monotonic() + args.flex_budget_s
    shapes = [("decode", b, h, hkv, 1, ctx - 1) for h, hkv in heads
              for b in _ints(args.batches) for ctx in _ints(args.contexts)]
    shapes += [("prefill", 1, h, hkv, int(c), int(p)) for h, hkv in heads
               for c, p in (x.split(":") for x in args.prefill.split(",") if x)]
    results = []
    free = torch.cuda.mem_get_info()[0]
    for kind, b, h, hkv, q_len, prefix in shapes:
        key = dict(kind=kind, batch=b, heads=h, kv_heads=hkv, q_len=q_len, prefix=prefix, ctx=prefix + q_len)
        es = torch.empty((), dtype=dtype).element_size()
        kv_bytes = b * (prefix + q_len) * hkv * args.head_size * 2 * es
        if 2.2 * kv_bytes > 0.9 * free:
            results.append({**key, "rows": [], "skipped": f"KV {kv_bytes / 1e9:.1f} GB twice (paged + contiguous "
                                                         f"peer copy) exceeds free memory {free / 1e9:.0f} GB"})
            print(f"{kind} b{b} {h}/{hkv} ctx{prefix + q_len}: skipped (memory)", flush=True)
            continue
        case = Case(b, h, hkv, q_len, prefix, args.head_size, args.block_size, dtype)
        rows = _measure(case, peers, args, copy_bw, flex_deadline)
        del case
        torch.cuda.empty_cache()
        results.append({**key, "rows": rows})
        print(_line(results[-1]), flush=True)
    meta = dict(device=dev, date=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                command="hwkv bench attention " + " ".join(sys.argv[3:] if sys.argv[1:3] == ["bench", "attention"]
                                                            else sys.argv[1:]),
                torch=torch.__version__, triton=_triton_version(), dtype=args.dtype, head_size=args.head_size,
                block_size=args.block_size, copy_tbps=round(copy_bw / 1e12, 3))
    out = Path(args.out or results_dir() / f"attention-{dev.replace(' ', '_')}-{dt.date.today()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(meta=meta, results=results), indent=1))
    out.with_suffix(".md").write_text(to_markdown(meta, results))
    print(to_markdown(meta, results))
    return 0


def _triton_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("triton")  # metadata only: the bench reports it without importing triton
    except PackageNotFoundError:
        return "none"


def _line(r: dict) -> str:
    cells = []
    for row in r["rows"]:
        if "error" in row:
            cells.append(f"{row['impl']}: {row['error'][:60]}")
        else:
            extra = f" {row['tflops']} TF/s" if "tflops" in row else ""
            cells.append(f"{row['impl']} {row['time_us']}us {row['tbps']}TB/s ({row['pct_copy']}%){extra}")
    return f"{r['kind']} b{r['batch']} {r['heads']}/{r['kv_heads']} q{r['q_len']} ctx{r['ctx']}: " + " | ".join(cells)


def to_markdown(meta: dict, results: list[dict]) -> str:
    lines = [f"# Attention bench: {meta['device']}", "",
             f"- date: {meta['date']}", f"- command: `{meta['command']}`",
             f"- torch {meta['torch']}, triton {meta['triton']}, {meta['dtype']}, head {meta['head_size']}, "
             f"block {meta['block_size']}",
             f"- device-to-device copy bandwidth (read+write), this run: {meta['copy_tbps']} TB/s", "",
             "| kind | batch | H/H_kv | q | ctx | impl | µs | TB/s | % copy | TFLOP/s | vs SDPA | vs flex "
             "| vs flex-paged |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        head = f"| {r['kind']} | {r['batch']} | {r['heads']}/{r['kv_heads']} | {r['q_len']} | {r['ctx']} "
        if r.get("skipped"):
            lines.append(head + f"| — | {r['skipped']} | | | | | | |")
            continue
        t = {row["impl"]: row.get("time_us") for row in r["rows"]}
        for row in r["rows"]:
            if "error" in row:
                lines.append(head + f"| {row['impl']} | {row['error']} | | | | | | |")
                continue
            ours = row["impl"] == "hwkv-cuda"
            vs = [f"{t[p] / row['time_us']:.2f}x" if ours and t.get(p) else "" for p in ("sdpa", "flex", "flex-paged")]
            lines.append(head + f"| {row['impl']} | {row['time_us']} | {row['tbps']} | {row['pct_copy']} | "
                         f"{row.get('tflops', '')} | {' | '.join(vs)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="hwkv bench attention")
    add_arguments(ap)
    sys.exit(run(ap.parse_args()))
