"""The Llama body an EAGLE draft head runs (EAGLE-1 and EAGLE-3 alike)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hwkv.model.llama import LlamaForCausalLM


def headless_llama(config: Any, backend: Any, device: torch.device, dtype: torch.dtype, max_positions: int) -> Any:
    """A draft head's Llama body without embedding or LM head: the vocabulary-sized tensors come
    from the head's bind (its own, or the target's), so none is allocated here."""
    inner = LlamaForCausalLM(config, backend.attention, device, dtype, max_positions)
    inner.model.embed_tokens = nn.Module()
    if hasattr(inner, "lm_head"):
        del inner.lm_head
    return inner
