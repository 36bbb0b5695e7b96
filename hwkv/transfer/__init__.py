"""Transfer implementations (see :mod:`hwkv.interfaces.transfer`). Vendor libraries are imported
only when an endpoint is created."""

from __future__ import annotations

from typing import Any

from hwkv.interfaces.capabilities import NotSupported
from hwkv.interfaces.transfer import Transfer
from hwkv.transfer.mooncake import MooncakeTransfer


def standard_transfer(backend: Any, **options: Any) -> Transfer:
    """What ``Backend.create_transfer`` returns unless a backend builds its own: Mooncake
    TransferEngine with the first declared protocol, or for ``cma`` (same-host host memory) a
    :class:`~hwkv.transfer.direct.DirectTransfer` without Mooncake."""
    caps = backend.capabilities
    if not caps.transfer_protocols:
        raise NotSupported(f"backend {backend.name!r} declares no transfer protocol: {caps.transfer_reason}")
    options.setdefault("protocol", caps.transfer_protocols[0])
    if options["protocol"] == "cma":
        from hwkv.transfer.direct import DirectTransfer, HostMover

        options.pop("protocol")
        return DirectTransfer(HostMover(), **options)
    return MooncakeTransfer(**options)


__all__ = ["MooncakeTransfer", "standard_transfer"]
