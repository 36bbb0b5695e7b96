"""The LM head's logits path at the offline batch (Llama-3.2-1B: hidden 2048, vocab 128256): what a decode step
spends after the last norm, timed as CUDA-graph replays (median), µs per call.

* ``linear+float``: ``F.linear`` in bf16, then ``.float()`` (the model's ``compute_logits`` today);
* ``mm fp32 out``: ``torch.mm(x, W.t(), out_dtype=torch.float32)`` (cuBLAS writes float32 logits, no cast pass);
* each with the greedy sampler's ``argmax`` after it, and ``linear`` + ``argmax`` on the bf16 logits.

Why: the float32 copy of the logits took 97 µs of a 2.33 ms batch-256 decode step on the H200 (issue 36).
Also checks that argmax over bf16 logits equals argmax over their float32 copy (it must: the cast is exact).

    PYTHONPATH=.:backends/cuda python3 backends/cuda/scripts/logits_probe.py OUT.json
"""

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from hwkv_cuda.bench.attention import _time

out_path = sys.argv[1]
hidden, vocab, copies = 2048, 128256, 2
ws = [torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16) / hidden**0.5 for _ in range(copies)]
rows = []
for m in (256, 64, 1):
    x = torch.randn(m, hidden, device="cuda", dtype=torch.bfloat16)
    ways = {
        "linear+float": lambda w, x=x: F.linear(x, w).float(),
        "mm fp32 out": lambda w, x=x: torch.mm(x, w.t(), out_dtype=torch.float32),
        "linear+float+argmax": lambda w, x=x: F.linear(x, w).float().argmax(-1),
        "mm fp32 out+argmax": lambda w, x=x: torch.mm(x, w.t(), out_dtype=torch.float32).argmax(-1),
        "linear+argmax(bf16)": lambda w, x=x: F.linear(x, w).argmax(-1),
    }
    a, b = F.linear(x, ws[0]).float(), torch.mm(x, ws[0].t(), out_dtype=torch.float32)
    same = bool((F.linear(x, ws[0]).argmax(-1) == a.argmax(-1)).all())
    agree = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    for name, fn in ways.items():
        try:
            t = _time([lambda w=w, fn=fn: fn(w) for w in ws], 20)
        except Exception as e:  # noqa: BLE001 - one way failing must not end the probe
            print(json.dumps(dict(m=m, way=name, error=repr(e)[:200])), flush=True)
            continue
        row = dict(m=m, way=name, us=t * 1e6, bf16_argmax_equals_float=same,
                   fp32_out_vs_float_max_abs=float((a - b).abs().max()), fp32_out_argmax_agreement=agree)
        rows.append(row)
        print(json.dumps(row), flush=True)
        Path(out_path).write_text(json.dumps(rows, indent=1))

# The decode step's four GEMMs at the offline batch (1B shape) under each cuBLAS front end: the batch-256 profile
# had o_proj and down at 310-410 TFLOP/s on 64x64 tiles (one wave, K looped in one CTA), gate_up at ~700.
GEMMS = [("qkv", 3072, 2048), ("o_proj", 2048, 2048), ("gate_up", 16384, 2048), ("down", 2048, 8192)]
default_lib = torch.backends.cuda.preferred_blas_library()
for m in (256, 128):
    for name, n, k in GEMMS:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        wl = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5 for _ in range(8)]
        for lib in ("cublas", "cublaslt"):
            try:
                torch.backends.cuda.preferred_blas_library(lib)
                t = _time([lambda w=w, x=x: F.linear(x, w) for w in wl], 20)
            except Exception as e:  # noqa: BLE001
                print(json.dumps(dict(gemm=name, m=m, lib=lib, error=repr(e)[:200])), flush=True)
                continue
            finally:
                torch.backends.cuda.preferred_blas_library(default_lib)
            row = dict(gemm=name, m=m, n=n, k=k, lib=lib, us=t * 1e6, TFLOPs=2 * m * n * k / t / 1e12,
                       TBps=(n * k + m * (n + k)) * 2 / t / 1e12)
            rows.append(row)
            print(json.dumps(row), flush=True)
            Path(out_path).write_text(json.dumps(rows, indent=1))
