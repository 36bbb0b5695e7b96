"""The model's fused small-batch path (DecodeOps) computes what its unfused path computes: with the
torch reference ops the logits and the KV cache are bit-identical, steps above ``max_tokens`` keep
the unfused path, and the engine refuses ops a backend does not offer."""

from __future__ import annotations

import pytest
import torch

from hwkv.interfaces.decode_ops import DecodeOps
from hwkv.model import load_model
from hwkv.model.decode_ops import TorchDecodeOps
from hwkv.model.tiny import write_tiny_model


class _Counting(TorchDecodeOps):
    def __init__(self) -> None:
        self.calls = 0

    def norm_linear(self, *args):
        self.calls += 1
        return super().norm_linear(*args)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases
def test_fused_path_is_bit_identical(tmp_path, cpu_backend, paged_runner, arch):
    path = write_tiny_model(tmp_path / arch, arch=arch, tie_word_embeddings=arch == "qwen2")
    runs = []
    for ops in (None, _Counting()):
        model, *_ = load_model(path, cpu_backend)
        model.set_decode_ops(ops)
        r = paged_runner(model, cpu_backend, 3, 40)
        toks = [list(range(3, 3 + n)) for n in (12, 5, 20)]
        steps = [
            [(0, toks[0], 0, 12), (1, toks[1], 0, 5)],  # 17 tokens: unfused
            [(1, toks[1] + [9], 5, 6), (2, toks[2], 0, 6)],  # 7 tokens: fused, incl. a 6-token prefill chunk
            [(0, toks[0] + [4], 12, 13), (1, toks[1] + [9, 7], 6, 7), (2, toks[2], 6, 8)],  # fused decodes
        ]
        logits = [r.step(s) for s in steps]
        runs.append((logits, [t.clone() for t in r.kv.tensors], ops))
    (want, kv_want, _), (got, kv_got, ops) = runs
    # post-attention norm: 2 layers x 2 fused steps; lm head: every step (each has <= 8 logit rows)
    assert ops.calls == 2 * 2 + 3
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    for a, b in zip(kv_got, kv_want):
        assert torch.equal(a, b)


def test_fused_path_prefetch_hooks(tmp_path, cpu_backend, paged_runner):
    """With prefetch hooks (``set_prefetch``) the fused path asks for the next layer's qkv weight once per layer
    (beside the down projection) and joins once at the end of the forward; logits and KV are unchanged."""
    path = write_tiny_model(tmp_path / "llama", arch="llama", num_layers=3)
    toks = list(range(3, 10))
    runs, calls = [], []
    for hooks in (False, True):
        model, *_ = load_model(path, cpu_backend)
        model.set_decode_ops(TorchDecodeOps())
        if hooks:
            model.set_prefetch(lambda ts: calls.append(list(ts)), lambda: calls.append("join"))
        r = paged_runner(model, cpu_backend, 1, 40)
        logits = [r.step([(0, toks, 0, 7)]), r.step([(0, toks + [4], 7, 8)])]
        runs.append((logits, [t.clone() for t in r.kv.tensors]))
    (want, kv_want), (got, kv_got) = runs
    assert all(torch.equal(a, b) for a, b in zip(got, want)) and all(
        torch.equal(a, b) for a, b in zip(kv_got, kv_want))
    layers = model.model.layers
    one = [[layers[i].self_attn.qkv_proj.weight] for i in (1, 2)] + ["join"]
    assert len(calls) == 2 * len(one)  # both steps fused (<= 8 tokens)
    for got_call, want_call in zip(calls, one + one):
        assert got_call == "join" if want_call == "join" else got_call[0] is want_call[0]


class _Refusing(TorchDecodeOps):
    def validate(self, num_heads, num_kv_heads, head_dim, dtype, kv_dtype):
        return [f"head_dim {head_dim} not served"]


def test_set_decode_ops_gives_the_reasons(tmp_path, cpu_backend):
    model, *_ = load_model(write_tiny_model(tmp_path / "m"), cpu_backend)
    with pytest.raises(ValueError, match="_Refusing cannot serve this model: head_dim 16 not served"):
        model.set_decode_ops(_Refusing())
    assert model.decode_ops is None
    assert issubclass(TorchDecodeOps, DecodeOps)


def test_engine_decode_ops_flag(tmp_path, cpu_backend, monkeypatch):
    from hwkv import Engine

    path = write_tiny_model(tmp_path / "m")
    with pytest.raises(ValueError, match="decode_ops=True but backend 'cpu' offers none"):
        Engine(str(path), decode_ops=True)
    with pytest.raises(ValueError, match="decode_ops must be None or a bool"):
        Engine(str(path), decode_ops="yes")
    monkeypatch.setattr(type(cpu_backend), "decode_ops", lambda self: _Refusing())
    assert Engine(str(path), backend=cpu_backend).model.decode_ops is None  # None: only where they serve
    with pytest.raises(ValueError, match="head_dim 16 not served"):
        Engine(str(path), backend=cpu_backend, decode_ops=True)
    monkeypatch.setattr(type(cpu_backend), "decode_ops", lambda self: TorchDecodeOps())
    eng = Engine(str(path), backend=cpu_backend)
    assert isinstance(eng.model.decode_ops, TorchDecodeOps)
    assert Engine(str(path), backend=cpu_backend, decode_ops=False).model.decode_ops is None


def test_preferred_tokens_limits_the_fused_path(tmp_path, cpu_backend, paged_runner):
    model, *_ = load_model(write_tiny_model(tmp_path / "m"), cpu_backend)
    ops = _Counting()
    ops.preferred_tokens = 1
    assert ops.use_up_to == 1 and TorchDecodeOps().use_up_to == 8
    model.set_decode_ops(ops)
    r = paged_runner(model, cpu_backend, 2, 16)
    r.step([(0, [3, 4, 5], 0, 3)])  # 3 tokens, 1 logits row: unfused layers, fused LM head
    assert ops.calls == 1
    r.step([(0, [3, 4, 5, 6], 3, 4)])  # 1 token: fused (2 layers + LM head)
    assert ops.calls == 1 + 3
