"""Graph capture emulated on the host, for tests of graph-using code on machines without a GPU/NPU.

:class:`RecordedGraph` records every aten op ``fn`` dispatches during capture (a
``TorchDispatchMode``) with the tensors it read and wrote; :meth:`RecordedGraph.replay` re-runs the
ops in order on those same tensors, copying each result into the tensor the capture produced. So a
replay, like a real one, sees the *current contents* of the captured inputs and rewrites the same
output tensors, and anything the capture froze (host values, shapes, Python branches) stays
frozen. A scalar read during capture (``.item()``, ``int(t)``, ``bool(t)``) raises, as it breaks a
real capture (``.tolist()`` of a host tensor reads memory without an op and cannot be seen).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from hwkv.interfaces.attention import AttentionBackend, AttentionImpl
from hwkv.reference.attention import split_kv
from hwkv.reference.backend import CpuBackend
from hwkv.reference.device import CpuDevice

T = TypeVar("T")
_SYNC_OPS = {torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default, torch.ops.aten.equal.default,
             torch.ops.aten.is_nonzero.default}


class GraphCaptureError(RuntimeError):
    """``fn`` did something a real graph capture forbids (a host synchronisation)."""


class RecordedGraph(TorchDispatchMode):
    """One captured op sequence; ``replay()`` re-runs it (see module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[Any, tuple, dict, list[torch.Tensor]]] = []
        self.replays = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _SYNC_OPS:
            raise GraphCaptureError(f"host synchronisation ({func}) inside a graph capture")
        out = func(*args, **kwargs)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.ops.append((func, args, kwargs, outs))
        return out

    def replay(self) -> None:
        with torch.inference_mode():
            for func, args, kwargs, outs in self.ops:
                new = [t for t in tree_flatten(func(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
                for old, fresh in zip(outs, new):
                    if fresh is not old and fresh.data_ptr() != old.data_ptr():
                        old.copy_(fresh)
        self.replays += 1


def capture(fn: Callable[[], T]) -> tuple[RecordedGraph, T]:
    """Run ``fn`` once, recording it; ``(graph, fn's result)``."""
    g = RecordedGraph()
    with g:
        out = fn()
    return g, out


class RecordingCpuDevice(CpuDevice):
    """The host device with emulated graphs (:func:`capture`): lets the engine's graph path run in CI."""

    def __init__(self, index: int = 0):
        super().__init__(index)
        self.captured: list[RecordedGraph] = []

    def graph_pool(self) -> Any:
        return object()

    def capture_graph(self, fn: Callable[[], T], pool: Any, stream: Any) -> tuple[RecordedGraph, T]:
        g, out = capture(fn)
        self.captured.append(g)
        return g, out


class StaticAttentionImpl(AttentionImpl):
    """Paged attention whose work depends only on tensor *shapes* and device-tensor contents (no host
    reads), so it survives capture: a static-shape reference for graph tests (float32 math), with the
    window, soft-cap and sinks the CPU backend declares (``AttentionImpl``)."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slot_mapping: torch.Tensor) -> None:
        k_cache, v_cache = split_kv(layer_kv)
        bs, n = k_cache.shape[1], slot_mapping.numel()
        # padded rows (slot -1) rewrite row 0's slot with row 0's value: no branch, no host read
        keep = (slot_mapping >= 0)[:, None, None]
        slots = torch.where(slot_mapping >= 0, slot_mapping, slot_mapping[0].clamp(min=0))
        blk, off = slots // bs, slots % bs
        k_cache[blk, off] = torch.where(keep, key[:n], key[:1]).to(k_cache.dtype)
        v_cache[blk, off] = torch.where(keep, value[:n], value[:1]).to(v_cache.dtype)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv: Any,
                md: Any) -> torch.Tensor:
        k_cache, v_cache = split_kv(layer_kv)
        t, bs = query.shape[0], k_cache.shape[1]
        tok = torch.arange(t, device=query.device)
        req = torch.searchsorted(md.query_start_loc[1:], tok.to(md.query_start_loc.dtype), right=True)
        pos = md.seq_lens[req] - (md.query_start_loc[req + 1] - tok)
        blocks = md.block_tables[req].long()  # [T, max_blocks]
        rep = self.num_heads // self.num_kv_heads
        k = k_cache[blocks].flatten(1, 2).float().repeat_interleave(rep, dim=2)  # [T, S, H, D]
        v = v_cache[blocks].flatten(1, 2).float().repeat_interleave(rep, dim=2)
        scores = torch.einsum("thd,tshd->ths", query.float(), k) * self.scale
        if self.softcap is not None:
            scores = self.softcap * torch.tanh(scores / self.softcap)
        s = torch.arange(blocks.shape[1] * bs, device=query.device)
        hidden = s[None, :] > pos[:, None]
        if self.window is not None:  # a query at p sees keys in (p - window, p]
            hidden = hidden | (s[None, :] <= pos[:, None] - self.window)
        scores = scores.masked_fill(hidden.unsqueeze(1), float("-inf"))
        if self.sinks is not None:  # one more logit per head in the denominator only
            sink = self.sinks.float().to(scores.device)[None, :, None].expand(t, -1, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]
        else:
            probs = scores.softmax(-1)
        return torch.einsum("ths,tshd->thd", probs, v).to(query.dtype)


class StaticAttentionBackend(AttentionBackend):
    name = "static"

    def make_impl(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> StaticAttentionImpl:
        return StaticAttentionImpl(num_heads, head_size, num_kv_heads, scale)


class GraphCpuBackend(CpuBackend):
    """The reference backend with emulated graphs and :class:`StaticAttentionBackend`: declares
    ``graph_capture``, so an Engine on it takes the graph decode path (and async scheduling)."""

    name = "cpu-graphs"

    def __init__(self) -> None:
        super().__init__()
        self._caps = dataclasses.replace(self._caps, graph_capture=True, transfer_protocols=())
        self._device = RecordingCpuDevice()
        self._attention = StaticAttentionBackend()
