"""Qwen3-MoE: Qwen3 attention with a top-k routed sparse MLP (no shared expert) in the layers
``decoder_sparse_step`` and ``mlp_only_layers`` select; the other layers keep a dense MLP.

The sparse MLP is a torch reference, not a fast path: every expert runs over every token and its
output is weighted by the routing weight (zero where the token is not routed to it), summed in
expert order as transformers does. That is ``num_experts / num_experts_per_tok`` times the FLOPs of
a sparse dispatch, but has no host synchronisation or data-dependent shape, so it is
graph-capturable like the rest of the forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hwkv.model.config import windowed_if_enabled
from hwkv.model.fields import ConfigFields
from hwkv.model.layers import MLP, Linear
from hwkv.model.qwen3 import QK_NORM_REFUSAL, Qwen3ForCausalLM
from hwkv.model.registry import ModelFamily, register


class SparseMoE(nn.Module):
    """``softmax(x W_gate)`` in float32 → top-k (renormalised with ``norm_topk_prob``) → the weighted
    sum of those experts' SiLU-gated MLPs. Parameter names follow HF: ``gate.weight``,
    ``experts.<e>.{gate,up,down}_proj.weight`` (gate/up fused per expert)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.top_k, self.norm_topk_prob = top_k, norm_topk_prob
        self.gate = Linear(hidden, num_experts, False, device, dtype)
        self.experts = nn.ModuleList(MLP(hidden, inter, False, device, dtype) for _ in range(num_experts))

    def routing_weights(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, num_experts]`` in ``x.dtype``: each token's top-k weights, zero elsewhere."""
        probs = F.linear(x, self.gate.weight).softmax(-1, dtype=torch.float32)
        top, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk_prob:
            top = top / top.sum(-1, keepdim=True)
        return torch.zeros_like(probs).scatter_(1, idx, top).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.routing_weights(x)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            out += expert(x) * w[:, e:e + 1]
        return out


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, layer: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
        moe = self.config.extra
        if layer not in moe["sparse_layers"]:
            return super().make_mlp(layer, device, dtype)
        return SparseMoE(self.config.hidden_size, moe["moe_intermediate_size"], moe["num_experts"],
                         moe["num_experts_per_tok"], moe["norm_topk_prob"], device, dtype)


def moe_config(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    """Validated MoE keys (transformers writes ``num_experts`` as ``num_local_experts``) → ``extra``."""
    layers = common["num_layers"]
    key = "num_experts" if f.raw("num_experts") is not None else "num_local_experts"
    n = f.integer(key, lo=0)
    top_k = f.integer("num_experts_per_tok", hi=n) if n else 0
    step = f.integer("decoder_sparse_step", 1)
    only = f.raw("mlp_only_layers", [])
    if not isinstance(only, list):
        raise f.fail("mlp_only_layers", only, f"a list of layer indices in [0, {layers - 1}]")
    only = {f.check_int("mlp_only_layers", i, 0, layers - 1) for i in only}
    sparse = tuple(i for i in range(layers) if n and i not in only and (i + 1) % step == 0)
    extra = {"num_experts": n, "num_experts_per_tok": top_k, "norm_topk_prob": f.flag("norm_topk_prob", False),
             "moe_intermediate_size": f.integer("moe_intermediate_size") if sparse else 0, "sparse_layers": sparse}
    return {**windowed_if_enabled(f, common), "extra": extra}


register(ModelFamily("qwen3_moe", ("Qwen3MoeForCausalLM",), Qwen3MoeForCausalLM, moe_config,
                     fused_decode=f"{QK_NORM_REFUSAL}, nor is the routed sparse MLP"))
