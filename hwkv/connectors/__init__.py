"""KV connectors: one package each (``offload``, ``pool``, ``p2p``); the base, the shared job
bookkeeping and the registry (:mod:`hwkv.connectors.base.registry`) under ``base``."""

from hwkv.connectors.base.registry import bind_connector, connector_stats, find_connector, make_connector
from hwkv.interfaces.connector import KVConnectorBase, NoOpConnector

__all__ = ["KVConnectorBase", "NoOpConnector", "bind_connector", "connector_stats", "find_connector",
           "make_connector"]
