"""A backend's many-token product (``ElementwiseOps.linear``, bound by ``fuse_elementwise``): every plain
projection of the model goes to it first, ``F.linear`` runs where it returns ``None``, and a backend without it
leaves the projections alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hwkv.model import load_model
from hwkv.model.fuse import fuse_elementwise
from hwkv.model.layers import Linear
from hwkv.model.tiny import write_tiny_model


class _Linear:
    def __init__(self, answer: bool) -> None:
        self.answer, self.shapes = answer, []

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        self.shapes.append(tuple(weight.shape))
        return F.linear(x.double(), weight.double(), None if bias is None else bias.double()).to(x.dtype) \
            if self.answer else None


def test_projections_take_the_backends_linear_first(tmp_path, cpu_backend):
    path = write_tiny_model(tmp_path / "m")
    model, *_ = load_model(path, cpu_backend)
    layer = model.model.layers[0]
    x = torch.randn(6, model.config.hidden_size, dtype=model.dtype)
    want = F.linear(x, layer.self_attn.qkv_proj.weight, layer.self_attn.qkv_proj.bias)
    for answer in (True, False):
        ops = _Linear(answer)
        fuse_elementwise(model, backend="eager", kernels=ops)
        got = layer.self_attn.qkv_proj(x)
        assert ops.shapes == [tuple(layer.self_attn.qkv_proj.weight.shape)]
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        h = torch.randn(6, model.config.intermediate_size * 2, dtype=model.dtype)
        ops.shapes.clear()
        layer.mlp.down_proj(h[:, : model.config.intermediate_size])
        assert ops.shapes == [tuple(layer.mlp.down_proj.weight.shape)]
    fresh, *_ = load_model(path, cpu_backend)
    fuse_elementwise(fresh, backend="eager", kernels=object())  # no linear op: the projections keep F.linear
    assert all("forward" not in vars(m) for m in fresh.modules() if type(m) is Linear)
