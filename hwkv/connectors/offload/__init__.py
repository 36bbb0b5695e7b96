"""The ``offload`` connector: a host tier of KV blocks (:mod:`.connector`, :mod:`.worker`, :mod:`.tier`)."""

from hwkv.connectors.offload.connector import OffloadConnector

__all__ = ["OffloadConnector"]
