"""The ``offload`` connector: a host tier of KV blocks (:mod:`.connector` assembles :mod:`.scheduler`
and :mod:`.worker`; the tier: :mod:`.tier`)."""

from hwkv.connectors.offload.connector import OffloadConnector

__all__ = ["OffloadConnector"]
