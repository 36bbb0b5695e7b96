"""Re-export: the connector base lives beside the other interfaces (:mod:`hwkv.interfaces.connector`)."""

from hwkv.interfaces.connector import KVConnectorBase, NoOpConnector

__all__ = ["KVConnectorBase", "NoOpConnector"]
