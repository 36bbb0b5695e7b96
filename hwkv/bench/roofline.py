"""A roofline for offline generation: how fast a fixed batch *could* run on this device, from two
rates measured in the same run — device copy bandwidth ``BW`` (bytes read + written per second,
:func:`hwkv.bench.common.copy_bandwidth`) and dense matmul rate ``R`` (FLOP/s of a large GEMM in
the model's dtype, :func:`matmul_rate`).

For ``N`` requests of ``I`` prompt and ``O`` output tokens, all in one batch::

    prefill = (2·P_body·N·I + 2·P_head·N + L·4·H·d·N·I²/2) / R
    decode  = Σ_{i=1}^{O-1} max((W + N·kv·(I + i)) / BW,  (2·(P_body + P_head)·N + L·4·H·d·N·(I + i)) / R)
    roofline tok/s = N·O / (prefill + decode)

``P_body``: parameters of the decoder's linear layers; ``P_head``: the LM head's (the embedding
table when tied; prefill computes logits only for each request's last prompt token); ``L·4·H·d``:
attention FLOPs per query-key pair over all layers (QKᵀ and PV, ``H`` query heads of width ``d``;
causal prefill attends to half the square); ``W``: weight bytes a decode step reads; ``kv``: KV
bytes per token (K and V of every layer). The first output token comes from the prefill, so ``O - 1``
decode steps. Every step is taken at its own bound (no launch, host or scheduling cost, perfect
overlap of the two rates), so a real engine stays below it; issue 20 asks for >= 50%.
"""

from __future__ import annotations

from typing import Any


def matmul_rate(device: Any, dtype: Any, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of an ``n × n × n`` matmul in ``dtype`` on ``device`` (an hwkv Device), median of ``reps``."""
    import torch

    a = torch.randn(n, n, device=device.torch_device).to(dtype)
    b = torch.randn(n, n, device=device.torch_device).to(dtype)
    for _ in range(3):
        a @ b
    device.synchronize()
    s, e = device.new_event(enable_timing=True), device.new_event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        a @ b
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * n**3 / times[len(times) // 2]


def linear_params(model: Any) -> tuple[int, int]:
    """``(P_body, P_head)``: parameters of the decoder's 2-D weights (embedding excluded) and of the LM head."""
    emb = model.model.embed_tokens.weight
    head = model.lm_head_weight
    body = sum(p.numel() for p in model.parameters() if p.dim() == 2 and p is not emb and p is not head)
    return body, head.numel()


def offline_roofline(cfg: dict[str, Any], p_body: int, p_head: int, weight_bytes: int, kv_per_token: int,
                     n: int, n_in: int, n_out: int, bw: float, rate: float) -> dict[str, Any]:
    """The module formula for ``n`` requests of ``n_in`` → ``n_out`` tokens; ``cfg``: the HF config dict."""
    heads = cfg["num_attention_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    attn = cfg["num_hidden_layers"] * 4 * heads * d  # FLOPs per (query, key) pair, all layers
    prefill = (2 * p_body * n * n_in + 2 * p_head * n + attn * n * n_in * n_in / 2) / rate
    decode, bound_bw = 0.0, 0
    for i in range(1, n_out):
        ctx = n_in + i
        t_bw = (weight_bytes + n * kv_per_token * ctx) / bw
        t_mm = (2 * (p_body + p_head) * n + attn * n * ctx) / rate
        decode += max(t_bw, t_mm)
        bound_bw += t_bw >= t_mm
    total = prefill + decode
    return dict(requests=n, input_len=n_in, output_len=n_out, prefill_s=prefill, decode_s=decode,
                seconds=total, tok_per_s=n * n_out / total, decode_steps_bandwidth_bound=bound_bw,
                decode_steps=n_out - 1, p_body=p_body, p_head=p_head, weight_bytes=weight_bytes,
                kv_bytes_per_token=kv_per_token, copy_bw_TBps=bw / 1e12, matmul_TFLOPs=rate / 1e12)
