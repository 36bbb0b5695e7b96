"""One layer of the offline workload's attention (Llama-3.2-1B: 32/8 heads of 64, blocks of 16; ``HWKV_PROBE_SHAPE``
another, e.g. ``16,4,128``: a tp=2 rank of Llama-3-8B) at the steps that
workload runs: the prefill step (32 x 512 causal), mixed steps (decodes first, then prefills, as the scheduler
orders them), the batch-256 decode; median of CUDA-graph replays, µs and causal TFLOP/s, for the default tiles and
a few ``HWKV_CUDA_ATTN_CONFIG`` variants (each row's error against the default's output).

Why: the offline run's prefill phase takes ~0.48 s against a 0.33 s roofline, and a profile over the whole pass
cannot tell the prefill steps' attention from the decodes' (issue 36).

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/attn_step_probe.py OUT.json [cuda|cpu] [scale]

``cpu`` with a ``scale`` (every size divided by it) is a dry run under ``TRITON_INTERPRET=1``."""
import json
import os
import sys
from pathlib import Path

import torch
from hwkv_cuda.attention import CudaMetadataBuilder, TritonAttentionBackend
from hwkv_cuda.tiles import OVERRIDE_ENV

from hwkv.interfaces.attention import AttentionMetadata

out_path = sys.argv[1]
dev = torch.device(sys.argv[2] if len(sys.argv) > 2 else "cuda")
sc = int(sys.argv[3]) if len(sys.argv) > 3 else 1  # divide every size (a CPU dry run under the interpreter)
h, hkv, d, bs = 32 // sc, 8 // sc, 64, 16
if os.environ.get("HWKV_PROBE_SHAPE"):  # "heads,kv_heads,head_size": e.g. 16,4,128 (a tp=2 rank of Llama-3-8B)
    h, hkv, d = (int(x) // (sc if i < 2 else 1) for i, x in enumerate(os.environ["HWKV_PROBE_SHAPE"].split(",")))
P, N = 512 // sc, 32 // sc
MIXED = ["default", "block_m=128,block_q=32", "block_m=32,block_q=8", "block_m=16,block_q=4"]
DECODE = ["default", "direct=0", "head_major=1", "num_stages=2", "num_stages=4", "block_n=64",
          "block_n=64,num_stages=4", "num_warps=2"]
if os.environ.get("HWKV_PROBE_DECODE"):  # ";"-separated variants for the decode cases (each a comma list)
    DECODE = ["default"] + [v for v in os.environ["HWKV_PROBE_DECODE"].split(";") if v and v != "default"]
B1 = ["default", "direct=0", "min_split=64", "split_target=16"]
PREFILL = ["default", "block_m=64,block_q=16"]
if os.environ.get("HWKV_PROBE_PREFILL"):  # ";"-separated variants for the prefill case and the 32 + 31 mixed step
    PREFILL = ["default"] + [v for v in os.environ["HWKV_PROBE_PREFILL"].split(";") if v and v != "default"]
# (name, query lengths, sequence lengths, variants), the offline run's largest share first; HWKV_PROBE_CASES (comma
# list of name prefixes) picks some
cases = [("decode 128 x 600", [1] * (128 // sc), [600 // sc] * (128 // sc), DECODE),  # 8B offline: 128 running
         ("decode 256 x 640", [1] * (256 // sc), [640 // sc] * (256 // sc), DECODE),
         ("decode 1 x 384", [1], [384 // sc], B1),  # the batch-1 bench: 128 + up to 256 tokens
         ("mixed 224 decodes @ 600 + 1 x 512 prefill", [1] * (224 // sc) + [P], [600 // sc] * (224 // sc) + [P], MIXED),
         ("mixed 128 decodes @ 600 + 8 x 512 prefills", [1] * (128 // sc) + [P] * (8 // sc or 1),
          [600 // sc] * (128 // sc) + [P] * (8 // sc or 1), ["default", "block_m=64,block_q=16"]),
         ("decode 256 x 544", [1] * (256 // sc), [544 // sc] * (256 // sc), DECODE),
         ("decode 256 x 768", [1] * (256 // sc), [768 // sc] * (256 // sc), DECODE),
         ("decode 64 x 4096", [1] * (64 // sc), [4096 // sc] * (64 // sc), DECODE),  # a full grid of long requests
         ("prefill 32 x 512", [P] * N, [P] * N, PREFILL),
         ("mixed 32 decodes @ 600 + 31 x 512 prefills", [1] * N + [P] * (N - 1), [600 // sc] * N + [P] * (N - 1),
          PREFILL)]
if os.environ.get("HWKV_PROBE_CASES"):
    cases = [c for c in cases if c[0].startswith(tuple(os.environ["HWKV_PROBE_CASES"].split(",")))]
rows = []
for name, ql, sl, variants in cases:
    n, w = len(ql), -(-max(sl) // bs)
    tables = torch.randperm(n * w, device=dev).to(torch.int32).view(n, w)
    md = AttentionMetadata.build(ql, sl, tables, bs, device=dev)
    q = torch.randn(sum(ql), h, d, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32, device=dev)
    out = torch.empty_like(q)
    kv = torch.randn(n * w, 2, bs, hkv, d, dtype=q.dtype, device=dev)
    impl = TritonAttentionBackend().make_impl(h, d, hkv, d**-0.5)
    ref = None
    exact = None
    if set(ql) == {1} and len(set(sl)) == 1:  # a decode of equal lengths: float32 attention over the gathered K/V
        kk = kv[tables.long()].float()  # [n, w, 2, bs, hkv, d]
        k_all = kk[:, :, 0].reshape(n, w * bs, hkv, d)[:, : sl[0]].repeat_interleave(h // hkv, 2)
        v_all = kk[:, :, 1].reshape(n, w * bs, hkv, d)[:, : sl[0]].repeat_interleave(h // hkv, 2)
        sc = torch.einsum("nhd,nlhd->nhl", q.float(), k_all) * d**-0.5
        exact = torch.einsum("nhl,nlhd->nhd", sc.softmax(-1), v_all)
        del kk, k_all, v_all, sc
    for variant in variants:
        if variant == "default":
            os.environ.pop(OVERRIDE_ENV, None)
        else:
            os.environ[OVERRIDE_ENV] = variant
        try:
            built = CudaMetadataBuilder().build(md)
            cfg, plan = built.launch(h, hkv, d, q.dtype, True, kv.dtype)

            def run(i=impl, k=kv, m=built, o=out, x=q):
                i.forward_into(o, x, k, m)

            if dev.type == "cuda":
                from hwkv_cuda.bench.attention import _time

                t = _time([run], 20)
            else:
                run()
                t = float("nan")
        except Exception as e:  # noqa: BLE001 - one variant failing must not end the probe
            print(json.dumps(dict(case=name, variant=variant, error=repr(e)[:200])), flush=True)
            continue
        if ref is None:
            ref = out.float().clone()
        err = ((out.float() - ref).norm() / ref.norm()).item()
        err_exact = ((out.float() - exact).norm() / exact.norm()).item() if exact is not None else None
        pairs = sum(a * (s - a) + a * (a + 1) / 2 for a, s in zip(ql, sl))
        row = dict(case=name, variant=variant, tokens=sum(ql), us=t * 1e6, TFLOPs=4 * h * d * pairs / t / 1e12,
                   kv_GB=sum(sl) * 2 * hkv * d * q.element_size() / 1e9, block_m=cfg.block_m, block_q=cfg.block_q,
                   block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages, splits=plan.splits,
                   head_major=cfg.head_major, prefetch=cfg.prefetch,
                   kv_TBps=sum(sl) * 2 * hkv * d * q.element_size() / t / 1e12,
                   rel_err_vs_default=err, rel_err_vs_fp32=err_exact)
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(out_path).write_text(json.dumps(rows, indent=1))
    os.environ.pop(OVERRIDE_ENV, None)
