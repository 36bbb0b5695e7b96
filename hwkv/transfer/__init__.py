"""Transfer implementations (see :mod:`hwkv.interfaces.transfer`). Vendor libraries are imported
only when an endpoint is created."""

from hwkv.transfer.mooncake import MooncakeTransfer

__all__ = ["MooncakeTransfer"]
