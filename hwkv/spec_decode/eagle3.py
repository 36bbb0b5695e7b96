"""EAGLE-3 head (method ``eagle3``; SafeAILab EAGLE-3 / vLLM ``Eagle3LlamaForCausalLM`` checkpoints).

Differences from EAGLE-1 (:mod:`hwkv.spec_decode.eagle`): the target state is the concatenation of
the residual stream entering three target layers (``eagle_aux_hidden_state_layer_ids`` in the
head's config, else vLLM's default ``(2, L // 2, L - 3)``), fused to ``H`` by ``fc [H, 3H]``; the
layer attends over ``concat(input_layernorm(embed(x)), hidden_norm(h))`` (q/k/v take ``2H``); the
residual is ``h`` (normed first with ``norm_before_residual``); a final ``norm`` precedes the head's
own ``lm_head [draft_vocab, H]``, whose ids map to the target's by ``d2t`` (``target = id + d2t[id]``).
Drafts after the first feed back the head's own pre-norm state. Names: ``midlayer.*`` (or
``layers.0.*``), ``midlayer.hidden_norm``, ``fc``, ``norm``, ``lm_head``, ``d2t`` (``t2d`` unused),
optional ``embed_tokens`` (absent: the target's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hwkv.model.config import ModelConfig
from hwkv.model.layers import Linear, RMSNorm
from hwkv.model.loader import ModelLoadError
from hwkv.spec_decode.head_body import headless_llama


class Eagle3Head(nn.Module):
    def __init__(self, config: Any, backend: Any, device: torch.device, dtype: torch.dtype, max_positions: int,
                 fc_in: int, aux_layers: list[int], norm_before_residual: bool):
        super().__init__()

        self.inner = headless_llama(config, backend, device, dtype, max_positions)
        h = config.hidden_size
        attn = self.inner.model.layers[0].self_attn
        old = attn.qkv_proj
        attn.qkv_proj = Linear(2 * h, old.weight.shape[0], old.bias is not None, device, dtype)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps, device, dtype)
        self.fc = Linear(fc_in, h, False, device, dtype)
        self.aux_layers, self.norm_before_residual = aux_layers, norm_before_residual
        self.embed: torch.Tensor | None = None
        self.lm_head: torch.Tensor | None = None
        self.d2t: torch.Tensor | None = None
        self._aux: dict[int, torch.Tensor] = {}

    @property
    def config(self) -> Any:
        return self.inner.config

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, kv_cache: Any,
                attn_metadata: Any, slot_mapping: torch.Tensor) -> torch.Tensor:
        layer, dt = self.inner.model.layers[0], self.fc.weight.dtype
        if hidden.shape[-1] != self.config.hidden_size:  # the target's fused states (first draft)
            hidden = self.fc(hidden.to(dt))
        e = layer.input_layernorm(F.embedding(input_ids, self.embed))
        if self.norm_before_residual:
            hidden = self.hidden_norm(hidden)
            hn = hidden
        else:
            hn = self.hidden_norm(hidden)
        out = layer.self_attn(torch.cat([e, hn], -1), positions, self.inner.rotary_emb, kv_cache.layer(0),
                              attn_metadata, slot_mapping)
        a, x = layer.post_attention_layernorm(out, hidden)
        return x + layer.mlp(a)

    def logits(self, g: torch.Tensor) -> torch.Tensor:
        return F.linear(self.inner.model.norm(g), self.lm_head).float()

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids if self.d2t is None else ids + self.d2t[ids]

    # -- the target's states ------------------------------------------------------------------------
    def hook(self, target: Any) -> None:
        """Capture the residual stream entering each aux layer of ``target`` on every forward."""
        layers = target.model.layers
        for idx in sorted(set(self.aux_layers)):
            def grab(_m: Any, args: tuple, out: Any, idx: int = idx) -> None:
                self._aux[idx] = out[1] if isinstance(out, tuple) else args[0]  # layer 0: the embeddings
            layers[idx].input_layernorm.register_forward_hook(grab)

    def target_states(self, target: Any, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([self._aux[i] for i in self.aux_layers], -1)


def load_eagle3_head(path: str, raw: dict[str, Any], tensors: dict[str, torch.Tensor], backend: Any,
                     target: Any) -> tuple[Eagle3Head, dict[str, torch.Tensor]]:
    raw = dict(raw, architectures=["LlamaForCausalLM"])
    config = ModelConfig.from_dict(raw, source=str(Path(path) / "config.json"))
    L = target.config.num_layers
    aux = list(raw.get("eagle_aux_hidden_state_layer_ids") or (2, L // 2, L - 3))
    if not all(isinstance(i, int) and 0 <= i < L for i in aux):
        raise ValueError(f"EAGLE-3 head {path}: aux hidden-state layers {aux} are not layers of the {L}-layer target "
                         "(allowed: eagle_aux_hidden_state_layer_ids in [0, num_layers))")
    tensors = {(("layers.0." + k.removeprefix("midlayer.")) if k.startswith("midlayer.") else k): v
               for k, v in tensors.items()}
    fc = tensors.pop("fc.weight")
    want = len(aux) * target.config.hidden_size
    if fc.shape[1] != want:
        raise ValueError(f"EAGLE-3 head {path}: fc.weight takes {fc.shape[1]} features, the target's {len(aux)} aux "
                         f"states have {want}")
    head = Eagle3Head(config, backend, backend.device.torch_device, target.dtype, target.config.max_model_len,
                      fc.shape[1], aux, bool(raw.get("norm_before_residual", False)))
    slots = head.inner.weight_slots()
    own: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        head.fc.weight.copy_(fc)
        for name, t in tensors.items():
            if name in ("embed_tokens.weight", "lm_head.weight", "d2t"):
                own[name] = t
            elif name == "t2d":
                continue
            elif name == "layers.0.hidden_norm.weight":
                head.hidden_norm.weight.copy_(t)
            elif "model." + name in slots and tuple(slots["model." + name].shape) == tuple(t.shape):
                slots["model." + name].copy_(t)
            else:
                raise ModelLoadError(f"EAGLE-3 head {path}: unexpected tensor {name!r} {tuple(t.shape)}")
    missing = [n for n in slots if n.removeprefix("model.") not in tensors]
    if missing or "layers.0.hidden_norm.weight" not in tensors:
        lacks = (missing or ["midlayer.hidden_norm.weight"])[:4]
        raise ModelLoadError(f"EAGLE-3 head {path}: checkpoint lacks {lacks}")
    head.hook(target)
    return head.eval(), own


def is_eagle3(path: str, tensors: dict[str, torch.Tensor]) -> bool:
    raw = json.loads((Path(path) / "config.json").read_text())
    archs = " ".join(raw.get("architectures") or [])
    return "Eagle3" in archs or any(k.startswith("midlayer.") for k in tensors) or "d2t" in tensors
