"""Llama-family decoder (Llama 2/3, Qwen2/2.5, Mistral) over a flattened varlen token batch; the
base that other families (Qwen3, Qwen3-MoE) extend through three hooks: ``attention_class``,
``make_mlp`` and ``Attention.project``.

Dense layers are torch ops — or, for forwards of a few tokens, the backend's fused
:class:`DecodeOps` (``set_decode_ops``); attention goes through the backend's :class:`AttentionImpl`
(per layer: ``write_kv`` then ``forward``). q/k/v and gate/up projections are fused into one matmul each; the
loader slices HF's separate tensors into them. The forward has no host synchronisation.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hwkv.interfaces.attention import AttentionBackend, AttentionImpl, layer_metadata
from hwkv.interfaces.decode_ops import DecodeOps
from hwkv.interfaces.layout import KVCache, KVCacheSpec
from hwkv.model.config import ModelConfig, windowed_if_enabled
from hwkv.model.fields import ConfigFields
from hwkv.model.layers import MLP, Linear, RMSNorm, add_rms_norm, param, rms_norm, silu_mul
from hwkv.model.registry import ModelFamily, family_of, register
from hwkv.model.rope import RotaryEmbedding
from hwkv.parallel.sharding import TPShard, local_config, vocab_range

# the building blocks live in hwkv.model.layers; re-exported for code importing them from here
__all__ = ["MLP", "Attention", "DecoderLayer", "LlamaForCausalLM", "Linear", "RMSNorm", "add_rms_norm", "rms_norm",
           "silu_mul"]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, impl: AttentionImpl, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias, device, dtype)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, cfg.o_bias, device, dtype)
        self.impl = impl

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``q [T, H, D], k [T, H_kv, D], v [T, H_kv, D]`` before RoPE (a family hook: Qwen3 norms q/k)."""
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim),
                v.reshape(t, self.num_kv_heads, self.head_dim))

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding, layer_kv: object,
        metadata: object, slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        q, k, v = self.project(x)
        q, k = rope(positions, q, k)
        self.impl.write_kv(k, v, layer_kv, slot_mapping)
        out = self.impl.forward(q, k, v, layer_kv, metadata)
        return self.o_proj(out.reshape(x.shape[0], self.q_size))


class QKNormAttention(Attention):
    """Attention with a per-head RMSNorm on q and k (over ``head_dim``, per head and token) before RoPE:
    Qwen3 (``RMSNorm``) and Gemma 3 (``norm_class = GemmaRMSNorm``, scaling by ``1 + w``)."""

    norm_class: Any = RMSNorm

    def __init__(self, cfg: ModelConfig, impl: AttentionImpl, device: torch.device, dtype: torch.dtype):
        super().__init__(cfg, impl, device, dtype)
        self.q_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps, device, dtype)
        self.k_norm = self.norm_class(cfg.head_dim, cfg.rms_norm_eps, device, dtype)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, attn: nn.Module, mlp: nn.Module, device: torch.device, dtype: torch.dtype):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.self_attn = attn
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, device, dtype)
        self.mlp = mlp


class LlamaForCausalLM(nn.Module):
    """Parameter names follow HF (``model.layers.0.self_attn.qkv_proj.weight`` is the fused q/k/v).

    Family hooks for subclasses: ``attention_class`` (built as ``cls(config, impl, device, dtype)``)
    and ``make_mlp(layer_index, device, dtype)``.
    """

    attention_class: type[Attention] = Attention

    def __init__(
        self, config: ModelConfig, attention: AttentionBackend, device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32, max_positions: int | None = None, tp: TPShard | None = None,
    ):
        super().__init__()
        device = torch.device(device)
        # tensor parallel: layers are built from the per-rank config (heads and widths divided);
        # full_config keeps the checkpoint's (hwkv.parallel.sharding)
        self.full_config, self.tp = config, tp
        if tp is not None:
            config = local_config(config, tp.size)
        self.config, self.dtype, self.device = config, dtype, device
        # one impl per layer (as vLLM): per-layer state such as fp8 KV scales lives in it
        impls = [attention.make_impl(config.num_heads, config.head_dim, config.num_kv_heads, config.head_dim**-0.5)
                 for _ in range(config.num_layers)]
        for i, impl in enumerate(impls):  # per-layer attention parameters (hwkv.interfaces.attention)
            impl.window = config.window_of(i)
        self.model = nn.Module()
        self.model.embed_tokens = nn.Module()
        vocab_rows = config.vocab_size if tp is None else vocab_range(config.vocab_size, tp.rank, tp.size)[2]
        self.model.embed_tokens.weight = param((vocab_rows, config.hidden_size), device, dtype)
        if tp is not None:  # the last shard's padding rows are never loaded
            self.model.embed_tokens.weight.zero_()
        self.model.layers = nn.ModuleList(
            DecoderLayer(config, self.attention_class(config, impls[i], device, dtype), self.make_mlp(i, device, dtype),
                         device, dtype)
            for i in range(config.num_layers)
        )
        self.model.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device, dtype)
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, vocab_rows, False, device, dtype)
            if tp is not None:
                self.lm_head.weight.zero_()
        self.rotary_emb = RotaryEmbedding(config, max_positions or config.max_model_len, device, dtype)
        self.set_prefetch()
        self.layer_hooks: Any = None  # set_layer_hooks
        self.decode_ops: DecodeOps | None = None  # fused ops for forwards of few tokens (set_decode_ops)
        # a backend's float32-out LM head (ElementwiseOps.logits, set by fuse_elementwise); None: linear + cast
        self.logits_op: Any = None
        self.kv_cache_dtype: torch.dtype | None = None  # KV storage dtype (fp8 KV); None: the model's dtype
        self.checkpoint_kv_scales: torch.Tensor | None = None  # [layers, 2, H_kv] fp8 KV scales the checkpoint has

    def make_mlp(self, layer: int, device: torch.device, dtype: torch.dtype) -> nn.Module:
        """The feed-forward block of decoder layer ``layer`` (called during ``__init__``)."""
        cfg = self.config
        return MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias, device, dtype)

    @property
    def attention_features(self) -> tuple[str, ...]:
        """Per-layer attention parameters this model needs of the backend (checked at Engine construction)."""
        return self.config.attention_features

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def kv_cache_spec(self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> KVCacheSpec:
        return self.config.kv_cache_spec(num_blocks, block_size, dtype or self.kv_cache_dtype or self.dtype)

    def bind_kv_cache(self, kv_cache: KVCache) -> None:
        """Hand each layer's attention its KV scales (``KVCache.layer_scales``; ``None`` unless quantised)."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.impl.kv_scales = kv_cache.layer_scales(i)

    def param_bytes(self) -> int:
        """Bytes of all parameters (a tied embedding counted once)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def forward_hidden(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, attn_metadata: object,
        slot_mapping: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden]`` before the last norm. Callers that build the metadata through
        a backend's builder pass ``slot_mapping`` (the model runner does); when it is omitted the metadata must
        carry one (the reference backend's does, CUDA's does not) or a ``TypeError`` says so."""
        if slot_mapping is None:
            slot_mapping = getattr(attn_metadata, "slot_mapping", None)
            if slot_mapping is None:
                raise TypeError(
                    f"forward_hidden needs slot_mapping: {type(attn_metadata).__name__} does not carry one; "
                    "pass the step's slot mapping (one KV slot per token, -1 for padding)"
                )
        ops = self.decode_ops
        if ops is not None and input_ids.shape[0] <= ops.use_up_to:
            return self._forward_fused(ops, input_ids, positions, kv_cache, attn_metadata, slot_mapping)
        # h is the residual stream; each sublayer's output is added to it inside the next norm
        layers, pf = self.model.layers, self._prefetch
        halves = self._overlap_halves(input_ids.shape[0])
        if halves and pf is None:
            return self._forward_halves(input_ids, positions, kv_cache, attn_metadata, slot_mapping, halves)
        if pf is not None:
            pf([layers[0].self_attn.qkv_proj.weight])
        h = self._embed(input_ids)
        add_norm = self._add_norm
        out = None
        for i, layer in enumerate(layers):
            if out is None:
                x = layer.input_layernorm(h)
            else:
                x, h = add_norm(layer.input_layernorm, out, h)
            if pf is not None:  # o_proj comes into cache beside qkv, RoPE and attention
                pf([layer.self_attn.o_proj.weight])
            if (hk := self.layer_hooks) is not None:
                hk.wait_for_layer_load(i)
            md, sm = layer_metadata(attn_metadata, slot_mapping, i)  # KV-cache groups: the layer's group's
            out = layer.self_attn(x, positions, self.rotary_emb, kv_cache.layer(i), md, sm)
            if hk is not None:
                hk.save_kv_layer(i, kv_cache.layer(i), attn_metadata)
            x, h = add_norm(layer.post_attention_layernorm, out, h)
            if pf is not None and i + 1 < len(layers):  # the next qkv beside this MLP
                pf([layers[i + 1].self_attn.qkv_proj.weight])
            out = layer.mlp(x)
        if pf is not None:
            self._join_prefetch()
        if out is not None and self.tp is not None:
            out = self.tp.comm.all_reduce(out)
        return h if out is None else h + out

    def _forward_halves(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                        attn_metadata: object, slot_mapping: torch.Tensor,
                        halves: list[tuple[int, int]]) -> torch.Tensor:
        """The plain forward at tp > 1 in two row halves, each all-reduce beside the other half's work
        (``Communicator.all_reduce_start``): the o_proj of half 1 runs while half 0's o_proj output
        crosses the link, each half's MLP while the other half's attention output does, the next
        layer's norm and qkv projection of half 0 while half 1's MLP output does. Only attention itself
        (RoPE, KV write, the kernel) takes the whole batch. The same arithmetic per row as the plain
        forward (projections and norms are row-wise)."""
        comm, rope, t = self.tp.comm, self.rotary_emb, input_ids.shape[0]
        h = self._embed(input_ids)
        # the residual stream per half (each site's fused norm returns a half's new h: no copy into a whole one)
        hs = [h[lo:hi] for lo, hi in halves]
        pend: list = []  # per half: the wait of its MLP all-reduce (+ the next input norm) of the layer before
        layers = self.model.layers
        for i, layer in enumerate(layers):
            a = layer.self_attn
            if (hk := self.layer_hooks) is not None:
                hk.wait_for_layer_load(i)
            if pend:
                parts = []
                for j, wait in enumerate(pend):
                    xh, hs[j] = wait()
                    parts.append(a.project(xh))
                q, k, v = (torch.cat(p) for p in zip(*parts))
            else:
                q, k, v = a.project(layer.input_layernorm(h))
            md, sm = layer_metadata(attn_metadata, slot_mapping, i)  # KV-cache groups: the layer's group's
            q, k = rope(positions, q, k)
            a.impl.write_kv(k, v, kv_cache.layer(i), sm)
            out = a.impl.forward(q, k, v, kv_cache.layer(i), md).reshape(t, a.q_size)
            if hk is not None:
                hk.save_kv_layer(i, kv_cache.layer(i), attn_metadata)
            started = [_start_add_norm(comm, a.o_proj(out[lo:hi]), hs[j], layer.post_attention_layernorm)
                       for j, (lo, hi) in enumerate(halves)]
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            pend = []
            for j, wait in enumerate(started):
                xh, hs[j] = wait()
                out_mlp = layer.mlp(xh)
                if nxt is None:  # the last layer: the plain sum (the final norm is compute_logits')
                    pend.append(comm.all_reduce_start(out_mlp))
                else:
                    pend.append(_start_add_norm(comm, out_mlp, hs[j], nxt))
        return torch.cat([hs[j] + wait() for j, wait in enumerate(pend)])

    def _overlap_halves(self, tokens: int) -> list[tuple[int, int]]:
        """Row halves of a forward of ``tokens`` whose all-reduces overlap the other half's MLP
        (``Communicator.overlap_tokens``), or ``[]``."""
        n = self.tp.comm.overlap_tokens if self.tp is not None else 0
        if not n or tokens < max(n, 2) or any(type(layer.self_attn).forward is not Attention.forward
                                              for layer in self.model.layers):
            return []
        mid = tokens // 2
        return [(0, mid), (mid, tokens)]

    def _add_norm(self, norm: nn.Module, out: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``norm(out, h)``: the sublayer output joins the residual stream, normalised. Tensor
        parallel: ``out`` is a row-parallel partial, summed over the ranks first — in one kernel
        with the add and the norm where the communicator fuses them."""
        if self.tp is None:
            return norm(out, h)
        comm = self.tp.comm
        fused = comm.all_reduce_add_rms_norm(out, h, norm.weight, norm.eps)
        return fused if fused is not None else norm(comm.all_reduce(out), h)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        w, tp = self.model.embed_tokens.weight, self.tp
        if tp is None:
            return F.embedding(input_ids, w)
        # vocab-parallel: each rank looks up the ids in its rows (zeros elsewhere), summed over ranks
        start = tp.rank * w.shape[0]
        local = input_ids - start
        inside = (local >= 0) & (local < w.shape[0])
        h = F.embedding(local.clamp(0, w.shape[0] - 1), w) * inside.unsqueeze(-1).to(w.dtype)
        return tp.comm.all_reduce(h)

    def _forward_fused(self, ops: DecodeOps, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache,
                       attn_metadata: object, slot_mapping: torch.Tensor) -> torch.Tensor:
        # five ops per layer; each residual add rides in the epilogue of the projection before it.
        # Tensor-parallel: a projection's partial output is summed over the ranks first, so the add
        # rides in the all-reduce instead (comm.all_reduce_add: one fused kernel where the backend
        # has one) and the projection adds a zero residual (the ops' inputs are never written).
        t, cfg, rope = input_ids.shape[0], self.config, self.rotary_emb
        h = self._embed(input_ids)
        ar_add = self.tp.comm.all_reduce_add if self.tp is not None else None
        # or the backend runs that all-reduce inside the projections: s is the last row-parallel output,
        # summed over the ranks (and added to h) by the op that takes it
        red = ops.rank_sum(self.tp.comm) if self.tp is not None else None
        s = None
        zero = torch.zeros_like(h) if ar_add is not None and red is None else None
        # weight prefetch hints (set_prefetch): the next layer's qkv comes into cache beside this layer's down
        # projection, whose one wave of programs leaves the bandwidth to spare that the qkv GEMV's short ramp does not
        layers, pf = self.model.layers, self._prefetch if self.tp is None else None
        for i, layer in enumerate(layers):
            a, mlp, layer_kv = layer.self_attn, layer.mlp, kv_cache.layer(i)
            if (hk := self.layer_hooks) is not None:
                hk.wait_for_layer_load(i)
            md, sm = layer_metadata(attn_metadata, slot_mapping, i)  # KV-cache groups: the layer's group's
            args = (layer.input_layernorm.weight, cfg.rms_norm_eps, a.qkv_proj.weight, a.qkv_proj.bias, rope.cos,
                    rope.sin, positions, a.impl, layer_kv, sm, a.num_heads, a.num_kv_heads, a.head_dim)
            if s is None:
                qkv = ops.qkv(h, *args)
            else:
                qkv, h = red.qkv(s, h, *args)
            q, k, v = qkv.split([a.q_size, a.kv_size, a.kv_size], dim=-1)
            out = a.impl.forward(q.view(t, a.num_heads, a.head_dim), k.view(t, a.num_kv_heads, a.head_dim),
                                 v.view(t, a.num_kv_heads, a.head_dim), layer_kv, md)
            if hk is not None:  # qkv wrote this layer's KV
                hk.save_kv_layer(i, layer_kv, attn_metadata)
            norm = (layer.post_attention_layernorm.weight, cfg.rms_norm_eps, mlp.gate_up_proj.weight,
                    mlp.gate_up_proj.bias)
            if red is not None:
                s = red.linear(out.reshape(t, a.q_size), a.o_proj.weight, a.o_proj.bias)
                x, h = red.norm_linear(s, h, *norm)
                s = red.silu_linear(x, mlp.down_proj.weight, mlp.down_proj.bias)
                continue
            if ar_add is None:
                h = ops.linear(out.reshape(t, a.q_size), a.o_proj.weight, a.o_proj.bias, h)
            else:
                h = ar_add(ops.linear(out.reshape(t, a.q_size), a.o_proj.weight, a.o_proj.bias, zero), h)
            x = ops.norm_linear(h, *norm)
            if pf is not None and i + 1 < len(layers):
                pf([layers[i + 1].self_attn.qkv_proj.weight])
            if ar_add is None:
                h = ops.silu_linear(x, mlp.down_proj.weight, mlp.down_proj.bias, h)
            else:
                h = ar_add(ops.silu_linear(x, mlp.down_proj.weight, mlp.down_proj.bias, zero), h)
        if pf is not None:
            self._join_prefetch()
        return h if s is None else red.sum(s, h)

    def set_decode_ops(self, ops: DecodeOps | None, kv_dtype: torch.dtype | None = None) -> None:
        """Use ``ops`` (a backend's :class:`DecodeOps`) for every forward of at most ``ops.use_up_to``
        tokens; ``None``: off. ``kv_dtype``: the KV cache's (default: the model dtype). Raises
        ``ValueError`` with the reasons when they cannot serve this model."""
        if ops is not None:
            cfg = self.config
            refusal = family_of(cfg.architecture).fused_decode
            if refusal is not None:
                raise ValueError(f"decode ops {type(ops).__name__} cannot serve {cfg.architecture}: {refusal}")
            reasons = ops.validate(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, self.dtype, kv_dtype or self.dtype)
            if reasons:
                raise ValueError(f"decode ops {type(ops).__name__} cannot serve this model: {'; '.join(reasons)}")
        self.decode_ops = ops

    def set_layer_hooks(self, hooks: Any = None) -> None:
        """Per-layer KV-connector hooks: ``hooks.wait_for_layer_load(i)`` before layer ``i``'s
        attention, ``hooks.save_kv_layer(i, layer_kv, attn_metadata)`` once its KV is written, in
        every forward path (plain and decode ops; graphs record them). ``None``: off."""
        self.layer_hooks = hooks

    def set_prefetch(self, prefetch: Any = None, join: Any = None) -> None:
        """Weight-prefetch hooks (``Device.prefetch`` / ``join_prefetch``): the forward asks for each
        small projection's weights one phase before it reads them. ``None``: off."""
        self._prefetch, self._join_prefetch = prefetch, join

    def compute_logits(self, hidden: torch.Tensor, logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits ``[R, vocab]`` of the rows ``logits_indices`` (all rows when ``None``)."""
        if logits_indices is not None:
            hidden = hidden.index_select(0, logits_indices)
        ops, norm = self.decode_ops, self.model.norm
        if ops is not None and hidden.shape[0] <= ops.use_up_to:
            if self.tp is None:  # float32 straight from the projection where the backend writes it so
                return ops.norm_logits(hidden, norm.weight, norm.eps, self.lm_head_weight)
            logits = ops.norm_linear(hidden, norm.weight, norm.eps, self.lm_head_weight, None)
        else:
            x = norm(hidden)
            if self.logits_op is not None and self.tp is None:
                out = self.logits_op(x, self.lm_head_weight)
                if out is not None:  # float32 already: the cast pass below was ~4% of a batch-256 decode step
                    return out
            logits = F.linear(x, self.lm_head_weight)
        if self.tp is not None:  # vocab-parallel: every rank's rows, in rank order, padding cut
            logits = self.tp.comm.all_gather(logits, dim=-1)[:, : self.config.vocab_size]
        return logits.float()

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: KVCache, attn_metadata: object,
        logits_indices: torch.Tensor | None = None, slot_mapping: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` long (requests concatenated in ``attn_metadata``
        order) → float32 logits ``[R, vocab]`` for ``logits_indices [R]`` only."""
        hidden = self.forward_hidden(input_ids, positions, kv_cache, attn_metadata, slot_mapping)
        return self.compute_logits(hidden, logits_indices)

    def weight_slots(self) -> dict[str, torch.Tensor]:
        """Every HF tensor name a complete checkpoint provides → the (view of the) parameter it fills.

        Separate HF ``q/k/v_proj`` and ``gate/up_proj`` tensors land in row slices of the fused ones.
        """
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        slots: dict[str, torch.Tensor] = {}
        for name, p in self.named_parameters():
            part = name.split(".")[-2]
            if part == "qkv_proj":
                parts = (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv))
            elif part == "gate_up_proj":  # halves of each MLP's own width (MoE experts are narrower)
                inter = p.shape[0] // 2
                parts = (("gate_proj", 0, inter), ("up_proj", inter, inter))
            elif self.tp is not None and name in ("model.embed_tokens.weight", "lm_head.weight"):
                start, end, _ = vocab_range(cfg.vocab_size, self.tp.rank, self.tp.size)
                slots[name] = p.narrow(0, 0, end - start)  # the padding rows stay zero
                continue
            else:
                slots[name] = p
                continue
            for hf, start, size in parts:
                slots[name.replace(part, hf)] = p.narrow(0, start, size)
        return slots

    KV_SCALE_NAMES = {"self_attn.k_scale": 0, "self_attn.v_scale": 1, "self_attn.k_proj.output_scale": 0,
                      "self_attn.v_proj.output_scale": 1}

    def _kv_scale(self, name: str, tensor: torch.Tensor) -> bool:
        """Keep a checkpoint's fp8 KV scale (``model.layers.<i>.<KV_SCALE_NAMES>``); False: not one."""
        parts = name.split(".")
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or ".".join(parts[3:]) not in self.KV_SCALE_NAMES:
            return False
        cfg = self.full_config  # the checkpoint's KV heads: a tensor-parallel rank keeps its own (engine.build)
        layer, which = int(parts[2]), self.KV_SCALE_NAMES[".".join(parts[3:])]
        if not 0 <= layer < cfg.num_layers or tensor.numel() not in (1, cfg.num_kv_heads):
            raise ValueError(f"KV scale {name!r} has {tensor.numel()} values for layer {layer}; allowed: 1 or "
                             f"{cfg.num_kv_heads} (per KV head) for layers 0..{cfg.num_layers - 1}")
        if self.checkpoint_kv_scales is None:
            self.checkpoint_kv_scales = torch.ones((cfg.num_layers, 2, cfg.num_kv_heads), dtype=torch.float32)
        self.checkpoint_kv_scales[layer, which] = tensor.detach().float().reshape(-1).cpu()
        return True

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named tensors into the parameters (converting dtype); returns the names consumed.

        Raises ``KeyError(name)`` for a tensor this model has no slot for and ``ValueError`` for a
        shape mismatch. ``rotary_emb.inv_freq`` buffers of old checkpoints and the stored copy of a
        tied ``lm_head.weight`` are skipped. fp8 KV scales (``self_attn.k_scale`` / ``v_scale``, or
        ``k_proj`` / ``v_proj.output_scale``: vLLM's and llm-compressor's names; one value per layer
        or one per KV head) go to ``checkpoint_kv_scales`` ``[layers, 2, H_kv]``, used when the
        engine runs an fp8 KV cache without explicit ``kv_cache_scales``.
        """
        slots = self.weight_slots()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name.endswith("rotary_emb.inv_freq") or (self.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            if self._kv_scale(name, tensor):
                continue
            if name not in slots:
                raise KeyError(name)
            dst = slots[name]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor)
            loaded.add(name)
        return loaded


def _llama_config(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    # Mistral attends through sliding_window in every layer; Llama has no window (a stray key is ignored, as HF)
    return {} if common["architecture"] == "MistralForCausalLM" else {"sliding_window": None}


def _start_add_norm(comm: Any, t: torch.Tensor, residual: torch.Tensor, norm: nn.Module) -> Any:
    """``wait()`` of ``norm(sum of t over the ranks, residual)`` started now: the communicator's fused form where
    it offers one, else its started sum and the norm at the wait."""
    fused = comm.all_reduce_add_rms_norm_start(t, residual, norm.weight, norm.eps)
    if fused is not None:
        return fused
    wait = comm.all_reduce_start(t)
    return lambda: norm(wait(), residual)


register(ModelFamily("llama", ("LlamaForCausalLM", "MistralForCausalLM"), LlamaForCausalLM, _llama_config))


def _qwen2_config(f: ConfigFields, common: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": True, "o_bias": False, **windowed_if_enabled(f, common)}  # q/k/v always biased


register(ModelFamily("qwen2", ("Qwen2ForCausalLM",), LlamaForCausalLM, _qwen2_config))
