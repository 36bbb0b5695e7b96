"""Store implementations (see :mod:`hwkv.interfaces.store`) and their factory."""

from __future__ import annotations

import inspect
from typing import Any

from hwkv.interfaces.capabilities import NotSupported
from hwkv.interfaces.store import Store

KINDS = ("embedded", "mooncake")


def create_store(kind: str = "embedded", **options: Any) -> Store:
    """``create_store("embedded", capacity_bytes=...)`` or ``create_store("mooncake", master=...,
    metadata_server=..., protocol=..., global_segment_size=..., ...)``; options are the store
    class's constructor arguments. Unknown kinds or options raise ``ValueError``."""
    if kind == "embedded":
        from hwkv.stores.embedded import EmbeddedStore as cls
    elif kind == "mooncake":
        from hwkv.stores.mooncake import MooncakeStore as cls
    else:
        raise ValueError(f"kind={kind!r} is not a store kind (allowed: {', '.join(KINDS)})")
    allowed = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for store kind {kind!r} (allowed: {', '.join(allowed)})")
    return cls(**options)


def standard_store(backend: Any, kind: str = "embedded", **options: Any) -> Store:
    """What ``Backend.create_store`` returns unless a backend builds its own: :func:`create_store`,
    a Mooncake store on the backend's first declared protocol that Mooncake has (never ``cma`` /
    ``cuda_ipc``, which are hwkv's own same-host transports)."""
    if kind == "mooncake":
        from hwkv.transfer.mooncake_wheel import PROTOCOLS

        caps = backend.capabilities
        usable = [p for p in caps.transfer_protocols if p in PROTOCOLS]  # not the same-host direct ones
        if not usable:
            why = caps.transfer_reason or f"declared: {list(caps.transfer_protocols)}, none of them Mooncake's"
            raise NotSupported(f"backend {backend.name!r} declares no Mooncake transfer protocol: {why}")
        options.setdefault("protocol", usable[0])
    return create_store(kind, **options)


__all__ = ["KINDS", "create_store", "standard_store"]
