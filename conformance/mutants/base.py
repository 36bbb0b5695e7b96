"""The mutant backend: the CPU reference backend with one piece swapped for a buggy one.

A mutant is cheap to express: a subclass of one interface piece (attention impl, metadata builder,
device, transfer wrapper, store) carrying a single realistic vendor mistake, registered with
:func:`mutant`. :class:`MutantBackend` assembles it into a full backend instance that
``conformance.run`` takes directly (no plugin distribution needed).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hwkv.interfaces import AttentionBackend, AttentionImpl, AttentionMetadataBuilder, Backend, KVLayoutKind
from hwkv.reference import CpuBackend, ReferenceAttentionImpl

AREAS = ("device", "attention", "kv_write", "transfer", "store", "communicator", "elementwise")


@dataclass(frozen=True)
class Mutant:
    name: str
    area: str  # one of AREAS
    bug: str  # the vendor mistake, one line
    build: Callable[[], Backend]
    first: tuple[str, ...]  # test-id substrings run first (the tests meant to kill it)


MUTANTS: dict[str, Mutant] = {}


def mutant(name: str, area: str, bug: str, first: tuple[str, ...] | str, **pieces: Any) -> None:
    """Register mutant ``name``: the reference backend with ``pieces`` (see :class:`MutantBackend`)."""
    if area not in AREAS:
        raise ValueError(f"mutant {name!r}: area {area!r} not in {AREAS}")
    if name in MUTANTS:
        raise ValueError(f"mutant {name!r} registered twice")
    first = (first,) if isinstance(first, str) else first
    MUTANTS[name] = Mutant(name, area, bug, lambda: MutantBackend(f"mutant-{name}", spec=f"mutant:{name}", **pieces),
                           first)


class _Attention(AttentionBackend):
    def __init__(self, name: str, impl: type[AttentionImpl], builder: type[AttentionMetadataBuilder],
                 layout: KVLayoutKind = KVLayoutKind.PER_LAYER):
        self.name, self._impl, self._builder, self.kv_layout = name, impl, builder, layout

    def make_impl(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> AttentionImpl:
        return self._impl(num_heads, head_size, num_kv_heads, scale)

    def metadata_builder(self) -> AttentionMetadataBuilder:
        return self._builder()


class MutantBackend(CpuBackend):
    """The reference backend with optional replacements: ``impl`` (an AttentionImpl class),
    ``builder`` (a metadata builder class), ``device`` (a Device class), ``transfer`` (wraps each
    Transfer endpoint ``create_transfer`` returns), ``store`` (an embedded Store class), ``caps``
    (Capabilities fields to replace, e.g. ``graph_capture=True`` for a device that captures),
    ``layout`` (the KV layout, e.g. ``CROSS_LAYER``: each layer a strided view of one tensor),
    ``elementwise`` (an ElementwiseOps class ``elementwise_ops()`` returns an instance of)."""

    def __init__(self, name: str, impl: type[AttentionImpl] | None = None,
                 builder: type[AttentionMetadataBuilder] | None = None, device: type | None = None,
                 transfer: Callable[[Any], Any] | None = None, store: type | None = None, spec: str | None = None,
                 caps: dict[str, Any] | None = None, layout: KVLayoutKind | None = None,
                 elementwise: type | None = None):
        super().__init__()
        if caps:
            self._caps = dataclasses.replace(self._caps, **caps)
        self.name = name
        self.conformance_spec = spec  # how rank processes rebuild it (conformance.ranks.build)
        if impl is not None or builder is not None or layout is not None:
            self._attention = _Attention(name, impl or ReferenceAttentionImpl, builder or AttentionMetadataBuilder,
                                         layout or KVLayoutKind.PER_LAYER)
        if device is not None:
            self._device = device()
        self._wrap_transfer, self._store = transfer, store
        self._elementwise = elementwise

    def elementwise_ops(self) -> Any:
        return self._elementwise() if self._elementwise is not None else None

    def create_transfer(self, **options: Any) -> Any:
        t = super().create_transfer(**options)
        return self._wrap_transfer(t) if self._wrap_transfer is not None else t

    def create_store(self, kind: str = "embedded", **options: Any) -> Any:
        if self._store is not None and kind == "embedded":
            return self._store(**options)
        return super().create_store(kind, **options)
