"""Elementwise-op mutants: a kernel-shaped ElementwiseOps (correct as written: :class:`VendorElementwise`,
float32 math inside, one rounding where the model's torch ops round) with one step overridden by a mistake
a vendor porting vLLM's or its own kernels makes."""

from __future__ import annotations

import torch

from conformance.mutants.base import mutant

NORM = ("test_elementwise.py::test_rms_norm[float16-add_rms_norm-5x4099", "test_elementwise.py::test_rms_norm[")
ROPE = ("test_elementwise.py::test_rope[",)
SILU = ("test_elementwise.py::test_silu_mul[",)


class VendorElementwise:
    """What a kernel computes, step by step; each ``_step`` is what a mutant overrides."""

    # -- RMSNorm -----------------------------------------------------------------------------------
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._norm(self._rows(x), weight, eps)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        h = self._residual_sum(x, self._rows(residual))
        return self._norm(h, weight, eps), h

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        return x  # a kernel reads row r at x.data_ptr() + r * x.stride(0)

    def _residual_sum(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return x + residual  # a new tensor, one rounding in the dtype

    def _norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        h = x.float()
        return weight * (h * self._inv_rms(h, x.dtype, eps)).to(x.dtype)

    def _inv_rms(self, h: torch.Tensor, dtype: torch.dtype, eps: float) -> torch.Tensor:
        return torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)

    # -- SiLU·mul ----------------------------------------------------------------------------------
    def silu_mul(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
        gate, up = self._halves(gate_up, inter)
        g = gate.float()
        return (g * torch.sigmoid(g)).to(gate.dtype) * up

    def _halves(self, gate_up: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
        return gate_up[:, :inter], gate_up[:, inter:]

    # -- linear (the optional many-token product) ------------------------------------------------------
    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        y = x.float() @ weight.float().t()  # float32 accumulation, one rounding to the activation dtype
        return (y if bias is None else y + bias.float()).to(x.dtype)

    # -- RoPE --------------------------------------------------------------------------------------
    def rope(self, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor, q: torch.Tensor,
             k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, s = self._angles(cos, positions), self._angles(sin, positions)
        return self._rotate(self._heads(q), c, s), self._rotate(self._heads(k), c, s)

    def _angles(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return table[positions].unsqueeze(1)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def _rotate(self, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)  # neox: the first half pairs with the second
        return x * c + torch.cat((-x2, x1), dim=-1) * s  # each product and the sum round, as torch's


def _ops(name: str, **steps) -> type[VendorElementwise]:
    return type(f"Elementwise_{name}", (VendorElementwise,), steps)


def _contiguous_rows(self, x: torch.Tensor) -> torch.Tensor:
    """Row r read at r * width (the row stride assumed equal to the width)."""
    return torch.as_strided(x, x.shape, (x.shape[1], 1))


def _in_place_sum(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    residual.add_(x)  # vLLM's fused_add_rms_norm: the sum overwrites the residual
    return residual


def _eps_outside(self, h: torch.Tensor, dtype: torch.dtype, eps: float) -> torch.Tensor:
    return torch.rsqrt(h.pow(2).mean(-1, keepdim=True)) + eps


def _squares_in_dtype(self, h: torch.Tensor, dtype: torch.dtype, eps: float) -> torch.Tensor:
    return torch.rsqrt(h.to(dtype).pow(2).float().mean(-1, keepdim=True) + eps)  # fp16: x^2 overflows past 256


def _gptj(self, x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (GPT-J style: 2i with 2i+1) with the neox cache."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    c, s = c[..., : x.shape[-1] // 2], s[..., : x.shape[-1] // 2]
    return torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), -1).flatten(-2)


def _token_index(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return table[: positions.shape[0]].unsqueeze(1)  # the token's index in the batch, not its position


def _int16_positions(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    return table[positions.to(torch.int16).long() % table.shape[0]].unsqueeze(1)  # narrowed: wraps past 2^15


def _rope_in_place(self, cos, sin, positions, q, k):
    c, s = self._angles(cos, positions), self._angles(sin, positions)
    q.copy_(self._rotate(q, c, s))  # vLLM's rotary_embedding rotates q and k in place
    k.copy_(self._rotate(k, c, s))
    return q, k


def _heads_packed(self, x: torch.Tensor) -> torch.Tensor:
    """Heads read at h * D from the row start with a packed row stride (H * D): the qkv view's stride ignored."""
    t, h, d = x.shape
    return torch.as_strided(x, x.shape, (h * d, d, 1))


def _rope_strided_out(self, cos, sin, positions, q, k):
    c, s = self._angles(cos, positions), self._angles(sin, positions)
    return tuple(self._rotate(x, c, s).transpose(0, 1).contiguous().transpose(0, 1) for x in (q, k))


def _swapped(self, gate_up: torch.Tensor, inter: int) -> tuple[torch.Tensor, torch.Tensor]:
    return gate_up[:, inter:], gate_up[:, :inter]  # silu(up) * gate


def _mean_over_block(self, h: torch.Tensor, dtype: torch.dtype, eps: float) -> torch.Tensor:
    """The sum of squares divided by the padded block width (the next power of two), not the row width."""
    block = 1 << (h.shape[-1] - 1).bit_length()
    return torch.rsqrt(h.pow(2).sum(-1, keepdim=True) / block + eps)


def _silu_tail_unwritten(self, gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """Columns written in whole blocks of 64 only: the tail of a width that is no multiple of 64 stays unset."""
    out = VendorElementwise.silu_mul(self, gate_up, inter)
    cut = inter // 64 * 64
    out[:, cut:] = 0.0 if cut else out[:, cut:]
    return out


A = "elementwise"
mutant("ew-rms-assumes-contiguous-rows", A, "RMSNorm reads row r at r * width: the hidden state's row stride "
       "(a view of a wider tensor) ignored", NORM, elementwise=_ops("rows", _rows=_contiguous_rows))
mutant("ew-add-rms-in-place", A, "add_rms_norm writes x + residual over the residual (vLLM's fused_add_rms_norm "
       "semantics) instead of a new tensor", NORM, elementwise=_ops("inplace", _residual_sum=_in_place_sum))
mutant("ew-rms-eps-outside-root", A, "RMSNorm adds eps after the rsqrt, not inside it (zero and tiny rows)", NORM,
       elementwise=_ops("eps", _inv_rms=_eps_outside))
mutant("ew-rms-squares-in-dtype", A, "RMSNorm squares in the input dtype: float16 x^2 overflows on massive "
       "activations (|x| > 256)", NORM, elementwise=_ops("sq", _inv_rms=_squares_in_dtype))
mutant("ew-rms-mean-over-block", A, "RMSNorm divides the sum of squares by the padded block width (next power of "
       "two), not the row width", NORM, elementwise=_ops("block", _inv_rms=_mean_over_block))
mutant("ew-rope-gptj-pairs", A, "RoPE rotates interleaved pairs (GPT-J) with a neox cos/sin cache", ROPE,
       elementwise=_ops("gptj", _rotate=_gptj))
mutant("ew-rope-token-index", A, "RoPE takes the angle row of the token's batch index, not its position", ROPE,
       elementwise=_ops("tokidx", _angles=_token_index))
mutant("ew-rope-int16-positions", A, "RoPE narrows positions to int16 (wrong past 32,767 tokens)", ROPE,
       elementwise=_ops("i16", _angles=_int16_positions))
mutant("ew-rope-in-place", A, "RoPE rotates q and k in place in the fused qkv output (vLLM's rotary_embedding) "
       "and returns them", ROPE, elementwise=_ops("ropeinplace", rope=_rope_in_place))
mutant("ew-rope-packed-heads", A, "RoPE reads q/k with a packed row stride (H x D), ignoring the fused qkv "
       "view's stride", ROPE, elementwise=_ops("packed", _heads=_heads_packed))
mutant("ew-rope-strided-result", A, "RoPE returns head-major [T, H, D] views (not contiguous)", ROPE,
       elementwise=_ops("strided", rope=_rope_strided_out))
mutant("ew-silu-swapped-halves", A, "SiLU·mul gates the wrong half: silu(up) * gate", SILU,
       elementwise=_ops("swap", _halves=_swapped))
mutant("ew-silu-tail-unwritten", A, "SiLU·mul writes whole blocks of 64 columns only: the tail of a width that is "
       "no multiple of 64 left unset", SILU, elementwise=_ops("tail", silu_mul=_silu_tail_unwritten))


# -- under graph capture (emulated graphs: a replay re-runs the recorded device ops) ---------------
def _host_positions(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Positions read on the host (a ``.tolist()`` for the launch): a captured graph keeps the capture's."""
    return table[torch.tensor(positions.tolist(), device=table.device)].unsqueeze(1)


def graph_pieces(ops: type[VendorElementwise] = VendorElementwise) -> dict:
    """A device with emulated graphs (``graph_capture`` declared) and these elementwise ops."""
    from conformance.mutants.runtime import LazyGraphDevice, StaticAttentionImpl

    return dict(impl=StaticAttentionImpl, device=LazyGraphDevice, caps={"graph_capture": True}, elementwise=ops)


mutant("ew-rope-host-positions", A, "RoPE reads the positions on the host (.tolist()) to launch: a captured graph "
       "replays the capture's positions", ("test_elementwise_in_graph",),
       **graph_pieces(_ops("hostpos", _angles=_host_positions)))
