"""KV-cache layout: shapes, per-layer views and block byte segments.

Every KV tensor is block-major (dim 0 = block id) and contiguous, so one block of one tensor is one
contiguous byte range. Three layouts exist:

* ``PER_LAYER``   one tensor per layer, ``[num_blocks, 2, block_size, H_kv, D]`` (K and V together)
* ``SEPARATE_KV`` two tensors per layer, K and V each ``[num_blocks, block_size, H_kv, D]``
                  (vllm-ascend style); tensors ordered K0, V0, K1, V1, ...
* ``CROSS_LAYER`` one tensor for all layers, ``[num_blocks, L, 2, block_size, H_kv, D]``

Transfers, stores and offload touch KV only through :meth:`KVCache.segments`, which derives byte
ranges from the tensors alone, so they work for any layout.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from hwkv.interfaces.kv_quant import is_quantized, kv_dtype_name


class KVLayoutKind(str, enum.Enum):
    PER_LAYER = "per_layer"
    SEPARATE_KV = "separate_kv"
    CROSS_LAYER = "cross_layer"


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of a paged KV cache, independent of layout and device."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"KVCacheSpec.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_block(self) -> int:
        """Bytes of K and V of one block over all layers."""
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_size * self.elem_size

    def tensor_shapes(self, layout: KVLayoutKind) -> list[tuple[int, ...]]:
        tok = (self.block_size, self.num_kv_heads, self.head_size)
        if layout is KVLayoutKind.PER_LAYER:
            return [(self.num_blocks, 2, *tok)] * self.num_layers
        if layout is KVLayoutKind.SEPARATE_KV:
            return [(self.num_blocks, *tok)] * (2 * self.num_layers)
        if layout is KVLayoutKind.CROSS_LAYER:
            return [(self.num_blocks, self.num_layers, 2, *tok)]
        raise ValueError(f"unknown KV layout {layout!r}")


class Segment(NamedTuple):
    """A contiguous byte range of one KV tensor: ``tensor`` index, byte ``offset``, ``nbytes``."""

    tensor: int
    offset: int
    nbytes: int


def group_concurrent_contiguous(
    src: list[int], dst: list[int] | None = None
) -> list[tuple[int, int, int]]:
    """Merge runs where both ``src`` and ``dst`` ids are consecutive (as vLLM's KV
    connectors do, so one copy or transfer moves a whole run).

    Returns ``(src_start, dst_start, length)`` runs. With ``dst`` omitted, ``dst == src``.
    """
    if dst is None:
        dst = src
    if len(src) != len(dst):
        raise ValueError(f"src and dst block lists differ in length: {len(src)} vs {len(dst)}")
    if len(src) > 64:  # a long list (a whole prompt's blocks): vectorised
        import numpy as np

        sa, da = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        starts = np.flatnonzero(np.concatenate(([True], (np.diff(sa) != 1) | (np.diff(da) != 1))))
        lens = np.diff(np.append(starts, len(sa)))
        return list(zip(sa[starts].tolist(), da[starts].tolist(), lens.tolist()))
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


class KVCache:
    """The KV tensors of one model on one device, plus the layout that gives them meaning.

    Attention impls receive ``layer(i)``: a ``[num_blocks, 2, bs, H_kv, D]`` tensor (or view, for
    cross-layer) for PER_LAYER / CROSS_LAYER, a ``(K, V)`` tuple for SEPARATE_KV.

    A quantised cache (``spec.dtype`` float8, :mod:`hwkv.interfaces.kv_quant`) carries ``scales``:
    float32 ``[num_layers, 2, H_kv]`` dequantisation scales (K, V per layer and KV head) on the cache's
    device, 1.0 until set; ``None`` otherwise. They belong to the bytes: whoever copies blocks to
    another cache (offload, pool, P/D) must see equal scales on both sides (:meth:`format_key`).
    """

    def __init__(self, spec: KVCacheSpec, layout: KVLayoutKind, tensors: list[torch.Tensor],
                 scales: torch.Tensor | None = None):
        shapes = spec.tensor_shapes(layout)
        if [tuple(t.shape) for t in tensors] != shapes:
            got = [tuple(t.shape) for t in tensors]
            raise ValueError(f"KV tensors {got} do not match layout {layout.value} {shapes}")
        for t in tensors:
            if not t.is_contiguous() or t.dtype != spec.dtype:
                raise ValueError("KV tensors must be contiguous and of the spec's dtype")
        self.spec, self.layout, self.tensors = spec, layout, tensors
        if scales is None and is_quantized(spec.dtype):
            scales = torch.ones((spec.num_layers, 2, spec.num_kv_heads), dtype=torch.float32,
                                device=tensors[0].device)
        self.scales = scales

    def layer_scales(self, i: int) -> torch.Tensor | None:
        """Layer ``i``'s ``[2, H_kv]`` K/V dequantisation scales (a view), or ``None`` (not quantised)."""
        return None if self.scales is None else self.scales[i]

    def set_scales(self, scales: torch.Tensor) -> None:
        """Copy ``[num_layers, 2, H_kv]`` scales in place (views handed to attention stay valid)."""
        if self.scales is None:
            raise ValueError(f"a {self.spec.dtype} KV cache has no scales (only quantised caches do)")
        if tuple(scales.shape) != tuple(self.scales.shape):
            raise ValueError(f"scales shape {list(scales.shape)} != {list(self.scales.shape)} (layers, K/V, KV heads)")
        self.scales.copy_(scales)

    def format_key(self) -> str:
        """What the bytes of a block mean beyond its shape: the storage dtype and, when quantised, a
        digest of the scales. Two caches may exchange blocks only when their keys are equal (pool
        keys and P/D handshakes include it): ``"bfloat16"``, or ``"fp8_e4m3-vt-s<16 hex of the scales' sha256>"``
        (``vt``: V pages stored ``[H_kv, D, block_size]``, :mod:`hwkv.interfaces.kv_quant`; a cache of the earlier
        token-major fp8 pages had no ``vt`` and never matches)."""
        name = kv_dtype_name(self.spec.dtype)
        if self.scales is None:
            return name
        import hashlib

        digest = hashlib.sha256(self.scales.detach().cpu().contiguous().numpy().tobytes()).hexdigest()[:16]
        return f"{name}-vt-s{digest}"  # no ':' or '@' (pool keys use them as separators)

    @classmethod
    def allocate(
        cls, spec: KVCacheSpec, layout: KVLayoutKind, device: torch.device | str = "cpu", pin_memory: bool = False
    ) -> KVCache:
        pin = pin_memory and torch.device(device).type == "cpu"
        ts = [torch.zeros(s, dtype=spec.dtype, device=device, pin_memory=pin) for s in spec.tensor_shapes(layout)]
        return cls(spec, layout, ts)

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    def layer(self, i: int) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if not 0 <= i < self.spec.num_layers:
            raise IndexError(f"layer {i} out of range [0, {self.spec.num_layers})")
        if self.layout is KVLayoutKind.PER_LAYER:
            return self.tensors[i]
        if self.layout is KVLayoutKind.SEPARATE_KV:
            return self.tensors[2 * i], self.tensors[2 * i + 1]
        return self.tensors[0][:, i]

    def layer_cache(self, i: int) -> KVCache | None:
        """Layer ``i`` alone as a one-layer cache sharing these tensors (a layer-by-layer copy), or
        ``None`` for CROSS_LAYER, where a layer of a block is not one contiguous range."""
        self.layer(i)  # range check
        if self.layout is KVLayoutKind.CROSS_LAYER:
            return None
        per = len(self.tensors) // self.spec.num_layers
        scales = None if self.scales is None else self.scales[i:i + 1]
        return KVCache(replace(self.spec, num_layers=1), self.layout, self.tensors[per * i:per * (i + 1)], scales)

    def block_nbytes(self, tensor: int) -> int:
        t = self.tensors[tensor]
        return math.prod(t.shape[1:]) * t.element_size()

    def segments(self, block_ids: list[int]) -> list[Segment]:
        """Byte segments covering exactly ``block_ids`` in every tensor, consecutive ids merged."""
        self._check_ids(block_ids)
        runs = group_concurrent_contiguous(list(block_ids))
        out: list[Segment] = []
        for ti in range(len(self.tensors)):
            nb = self.block_nbytes(ti)
            out.extend(Segment(ti, s * nb, n * nb) for s, _, n in runs)
        return out

    def _check_ids(self, block_ids: list[int], side: str = "") -> None:
        for b in block_ids:
            if not 0 <= b < self.spec.num_blocks:
                raise IndexError(f"{side}block id {b} out of range [0, {self.spec.num_blocks})")

    def addresses(self, block_ids: list[int]) -> list[tuple[int, int]]:
        """``(pointer, nbytes)`` of each segment, for transfer engines and stores."""
        return [(self.tensors[s.tensor].data_ptr() + s.offset, s.nbytes) for s in self.segments(block_ids)]

    def paired_addresses(self, dst: KVCache, src_ids: list[int], dst_ids: list[int]
                         ) -> tuple[list[int], list[int], list[int]]:
        """``(src_ptrs, dst_ptrs, lengths)`` moving block ``src_ids[i]`` of this cache to ``dst_ids[i]``
        of ``dst`` in every tensor, merging runs consecutive on both sides: the arguments of
        ``Transfer.write`` / ``read``. Both caches must have the same per-block tensor sizes."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destination blocks")
        if len(self.tensors) != len(dst.tensors):
            raise ValueError(f"{len(self.tensors)} KV tensors here but {len(dst.tensors)} at the destination")
        sizes = [self.block_nbytes(i) for i in range(len(self.tensors))]
        if sizes != (theirs := [dst.block_nbytes(i) for i in range(len(dst.tensors))]):
            raise ValueError(f"block sizes differ: {sizes} bytes per tensor here, {theirs} at the destination")
        self._check_ids(src_ids, "source ")
        dst._check_ids(dst_ids, "destination ")
        runs = group_concurrent_contiguous(list(src_ids), list(dst_ids))
        src_ptrs, dst_ptrs, lengths = [], [], []
        for ts, td, nb in zip(self.tensors, dst.tensors, sizes):
            for s, d, n in runs:
                src_ptrs.append(ts.data_ptr() + s * nb)
                dst_ptrs.append(td.data_ptr() + d * nb)
                lengths.append(n * nb)
        return src_ptrs, dst_ptrs, lengths

    def block_bytes(self, block_id: int) -> list[torch.Tensor]:
        """Raw uint8 views of one block in each tensor (tests, hashing, debugging)."""
        return [t[block_id].reshape(-1).view(torch.uint8) for t in self.tensors]
