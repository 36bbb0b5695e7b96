from __future__ import annotations

import json
from pathlib import Path

import torch


def add_biases(path: Path) -> Path:
    """Give a tiny Llama checkpoint q/k/v/o and MLP biases (attention_bias, mlp_bias): the
    row-parallel o_proj/down_proj biases must be added once, not once per rank."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((path / "config.json").read_text())
    cfg.update(attention_bias=True, mlp_bias=True)
    (path / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(path / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    for name in [n for n in w if n.endswith("_proj.weight")]:
        w[name.replace(".weight", ".bias")] = torch.randn(w[name].shape[0], generator=g) * 0.1
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path
