"""A backend's float32-out LM head (``ElementwiseOps.logits``, bound by ``fuse_elementwise``): the model's
``compute_logits`` returns its result for forwards above the decode ops' size, falls back to ``F.linear`` + cast
where it returns ``None``, and a backend without it leaves the model's path alone."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hwkv.model import load_model
from hwkv.model.fuse import fuse_elementwise
from hwkv.model.tiny import write_tiny_model


class _Logits:
    def __init__(self, answer: bool) -> None:
        self.answer, self.calls = answer, 0

    def logits(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        self.calls += 1
        return (x.double() @ weight.double().t()).float() if self.answer else None


def test_compute_logits_takes_the_backends_float32_head(tmp_path, cpu_backend):
    path = write_tiny_model(tmp_path / "m")
    model, *_ = load_model(path, cpu_backend)
    hidden = torch.randn(5, model.config.hidden_size, dtype=model.dtype)
    want = F.linear(model.model.norm(hidden), model.lm_head_weight).float()
    assert model.logits_op is None
    for answer in (True, False):
        ops = _Logits(answer)
        fuse_elementwise(model, backend="eager", kernels=ops)
        got = model.compute_logits(hidden)
        assert ops.calls == 1 and got.dtype == torch.float32 and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    model.logits_op = None
    fuse_elementwise(model, backend="eager", kernels=object())  # no logits op: nothing bound
    assert model.logits_op is None
