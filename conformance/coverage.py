"""Argument coverage: which values every interface argument took across a run.

The suite's tests see the backend under test through :func:`recording`, a thin proxy that notes a
summary of each argument of each interface call (``AttentionImpl.forward(scale=...)`` and so on)
before passing it through unchanged. The report's coverage table lists them; an argument that only
ever takes one value is a bug class the suite cannot see (an ignored ``scale``, an assumed stride).
"""

from __future__ import annotations

import enum
import functools
import inspect
import math
from typing import Any

import torch

from hwkv.interfaces import KVCache, KVCacheSpec

SHOWN = 12  # values listed per argument in the table; the count covers them all

# interface -> recorded methods; "attr: Interface" entries wrap what an attribute or call returns
INTERFACES: dict[str, tuple[str, ...]] = {
    "Backend": ("create_transfer", "create_store", "decode_ops", "elementwise_ops"),
    "Device": ("allocate_kv_cache", "copy_blocks", "memory_info", "pinned_empty", "host_empty", "to_device",
               "to_host_async"),
    "AttentionBackend": ("make_impl", "metadata_builder"),
    "AttentionMetadataBuilder": ("build",),
    "AttentionImpl": ("write_kv", "forward"),
    "Transfer": ("register", "unregister", "submit_write", "submit_read", "write", "read", "poll", "wait"),
    "Store": ("put", "get", "exists", "remove"),
    "ElementwiseOps": ("rms_norm", "add_rms_norm", "rope", "silu_mul"),
}
WRAPS: dict[tuple[str, str], str] = {  # (interface, attribute or method) -> interface of the result
    ("Backend", "device"): "Device",
    ("Backend", "attention"): "AttentionBackend",
    ("Backend", "create_transfer"): "Transfer",
    ("Backend", "create_store"): "Store",
    ("Backend", "elementwise_ops"): "ElementwiseOps",
    ("AttentionBackend", "make_impl"): "AttentionImpl",
    ("AttentionBackend", "metadata_builder"): "AttentionMetadataBuilder",
}


def _bucket(n: int) -> str:
    if n <= 8:
        return str(n)
    lo = 1 << (n.bit_length() - 1)
    return f"{lo}..{2 * lo - 1}"


def _nbytes(n: int) -> str:
    for unit, size in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def summarize(name: str, value: Any) -> str:
    """A short, value-class description of one argument (what makes two calls differ for a kernel)."""
    if isinstance(value, enum.Enum):  # KVLayoutKind
        return str(value.value)
    if isinstance(value, KVCacheSpec):
        return (f"L{value.num_layers} blocks {_bucket(value.num_blocks)} bs{value.block_size} kvh{value.num_kv_heads} "
                f"hd{value.head_size} {str(value.dtype).removeprefix('torch.')}")
    if isinstance(value, torch.Tensor):
        dims = ",".join([_bucket(value.shape[0]), *map(str, value.shape[1:])]) if value.dim() else ""
        layout = "contiguous" if value.is_contiguous() else "strided"
        return f"{str(value.dtype).removeprefix('torch.')}[{dims}] {layout}"
    if isinstance(value, KVCache):
        s = value.spec
        where = "host" if value.device.type == "cpu" else "device"
        return (f"{value.layout.value} {where} bs{s.block_size} hd{s.head_size} "
                f"{str(s.dtype).removeprefix('torch.')} blocks {_bucket(s.num_blocks)}")
    if isinstance(value, tuple) and len(value) == 2 and all(isinstance(t, torch.Tensor) for t in value):
        return "(K, V) " + summarize(name, value[0])
    if hasattr(value, "num_reqs") and hasattr(value, "max_seq_len"):  # AttentionMetadata
        kinds = "+".join(k for k, n in (("prefill", value.num_prefills), ("decode", value.num_decodes)) if n)
        return f"{_bucket(value.num_reqs)} reqs {kinds} max_seq {_bucket(value.max_seq_len)}"
    if isinstance(value, (list, tuple)):
        if name == "lengths" and value and all(isinstance(x, int) for x in value):
            return f"{_bucket(len(value))} segments, max {_nbytes(max(value))}"
        if name == "buffers" and value:
            segs = [n for b in value for _, n in b]
            return f"{_bucket(len(value))} values, {_bucket(len(segs))} segments"
        if name == "keys":
            return f"{_bucket(len(value))} keys" + (", duplicates" if len(set(value)) < len(value) else "")
        if "ptrs" in name and value and all(isinstance(x, int) for x in value):
            return f"{_bucket(len(value))} addresses"
        return f"len {_bucket(len(value))}"
    if isinstance(value, int) and "ptr" in name:  # an address: only its alignment matters to a kernel
        return f"{min(value & -value, 4096)}-byte aligned" if value else "null"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else f"{value:.4g}"
    if isinstance(value, (bool, int, str)) or value is None:
        return repr(value)
    return type(value).__name__


class Coverage:
    def __init__(self) -> None:
        self.values: dict[tuple[str, str], set[str]] = {}

    def note(self, method: str, args: dict[str, Any]) -> None:
        for name, value in args.items():
            self.values.setdefault((method, name), set()).add(summarize(name, value))

    def state(self) -> list[list[Any]]:
        """Every noted value (JSON-able), for :meth:`merge` in another process."""
        return [[m, a, sorted(v)] for (m, a), v in sorted(self.values.items())]

    def merge(self, state: list[list[Any]]) -> None:
        for m, a, vals in state:
            self.values.setdefault((m, a), set()).update(vals)

    def table(self) -> list[dict[str, Any]]:
        return [{"method": m, "arg": a, "distinct": len(v), "values": sorted(v)[:SHOWN]}
                for (m, a), v in sorted(self.values.items())]


class _Recorder:
    """Passes every attribute through; the interface's methods note their arguments first."""

    def __init__(self, target: Any, interface: str, cov: Coverage):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_iface", interface)
        object.__setattr__(self, "_cov", cov)
        object.__setattr__(self, "_wrapped", {})

    def __getattr__(self, name: str) -> Any:
        target, iface, cov = self._target, self._iface, self._cov
        attr = getattr(target, name)
        wrap = WRAPS.get((iface, name))
        if name not in INTERFACES.get(iface, ()):
            if wrap is None:
                return attr
            if name not in self._wrapped:  # stable identity: backend.device is backend.device
                self._wrapped[name] = _Recorder(attr, wrap, cov)
            return self._wrapped[name]
        sig = inspect.signature(attr)
        method = f"{iface}.{name}"

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(*args, **kwargs)
                bound.apply_defaults()
                args_ = dict(bound.arguments)
                for p in sig.parameters.values():  # **options: each option is an argument of its own
                    if p.kind is p.VAR_KEYWORD:
                        args_.update(args_.pop(p.name, {}))
                cov.note(method, args_)
            except TypeError:  # let the real method raise its own error
                pass
            out = attr(*args, **kwargs)
            return _Recorder(out, wrap, cov) if wrap is not None and out is not None else out

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __repr__(self) -> str:
        return f"recording({self._target!r})"


def recording(backend: Any, cov: Coverage) -> Any:
    """``backend`` as the suite's tests see it: every interface call's arguments noted in ``cov``."""
    return _Recorder(backend, "Backend", cov)
