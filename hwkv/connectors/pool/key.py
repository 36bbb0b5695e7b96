"""PoolKey: the store key of one chunk of KV in the global pool, and the model identity it carries.

A key names everything that decides the chunk's bytes, so KV can never load into a different model,
layout, dtype or shard::

    hwkv1@<model_id>@<layout>:<dtype>:L<layers>H<kv_heads>D<head_size>B<block_size>x<chunk_blocks>
         @tp<rank>/<size>@pp<rank>@[<group>@]<chunk hash hex>          (one string, no line break)

* ``model_id`` — ``<name>-<fingerprint>``: the model directory's name and 12 hex digits of sha256
  over its ``config.json`` and a sample of its weight bytes (so two fine-tunes of one architecture
  never share), or a user-chosen id (``model_id`` config) that several hosts agree on.
* the chunk hash is the prefix-cache chain hash of the chunk's last block: it covers every token of
  the prefix up to there and the request's ``cache_salt``, so tenants with different salts never
  share entries, and equal keys mean equal prefixes.
* ``group`` — with KV-cache groups (a hybrid model, docs/hybrid-models.md) each group's chunks are
  keyed apart: ``g<index>-full`` or ``g<index>-w<window>``, and ``L`` counts that group's layers
  (absent without groups, so those keys are unchanged).
* the value is the chunk's blocks in every KV tensor, tensor-major then block order (what
  ``KVCache.segments`` of the chunk's block ids concatenates to, whatever the physical ids).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path

_SAMPLES, _SAMPLE_BYTES = 16, 4096  # weight bytes read per file for the fingerprint: cheap, and every
# fine-tune changes them (a full hash of tens of GB would delay start-up by minutes)
_SAFE = re.compile(r"[^A-Za-z0-9._-]+")


def model_fingerprint(model: str | Path) -> str:
    """12 hex digits of sha256 over ``config.json`` (canonical JSON) and, per weight file
    (``*.safetensors`` / ``*.bin`` / ``*.gguf``, sorted; or the GGUF file ``model`` is), its name,
    size and ``_SAMPLES`` evenly spaced ``_SAMPLE_BYTES``-byte samples. Equal on every host that has the same files."""
    path = Path(model)
    h = hashlib.sha256(b"hwkv-model-v1\0")
    cfg = path / "config.json"
    if cfg.is_file():
        h.update(json.dumps(json.loads(cfg.read_text()), sort_keys=True).encode())
    files = [path] if path.is_file() else sorted(  # a GGUF checkpoint is one file
        p for p in path.glob("*") if p.suffix in (".safetensors", ".bin", ".gguf") and p.is_file())
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with f.open("rb") as fh:
            for i in range(_SAMPLES):
                fh.seek(size * i // _SAMPLES)
                h.update(fh.read(_SAMPLE_BYTES))
    if not cfg.is_file() and not files:
        h.update(str(model).encode())  # not a local directory: the name is all there is
    return h.hexdigest()[:12]


def default_model_id(model: str | Path) -> str:
    """``<directory name>-<fingerprint>`` (characters outside ``[A-Za-z0-9._-]`` become ``_``)."""
    name = _SAFE.sub("_", Path(str(model).rstrip("/")).name or "model")
    return f"{name}-{model_fingerprint(model)}"


@dataclass(frozen=True)
class PoolKey:
    """Everything but the chunk hash is fixed per engine and shard: build one ``PoolKey`` prefix and
    call :meth:`key` per chunk."""

    model_id: str
    layout: str  # KVLayoutKind value
    dtype: str  # e.g. "bfloat16"
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    chunk_blocks: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    group: str = ""  # KV-cache groups: the group's tag (``g<i>-full`` / ``g<i>-w<window>``); "" without

    def __post_init__(self) -> None:
        if not self.model_id or "@" in self.model_id:
            raise ValueError(f"model_id={self.model_id!r} is invalid (need a non-empty str without '@')")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank={self.tp_rank} is invalid for tp_size={self.tp_size} (need 0 <= rank < size)")
        if self.pp_rank < 0:
            raise ValueError(f"pp_rank={self.pp_rank} is invalid (need >= 0)")

    @property
    def prefix(self) -> str:
        return (f"hwkv1@{self.model_id}@{self.layout}:{self.dtype}:L{self.num_layers}H{self.num_kv_heads}"
                f"D{self.head_size}B{self.block_size}x{self.chunk_blocks}@tp{self.tp_rank}/{self.tp_size}"
                f"@pp{self.pp_rank}@" + (f"{self.group}@" if self.group else ""))

    def key(self, chunk_hash: bytes) -> str:
        return self.prefix + chunk_hash.hex()

    def keys(self, chunk_hashes: list[bytes]) -> list[str]:
        p = self.prefix
        return [p + h.hex() for h in chunk_hashes]
