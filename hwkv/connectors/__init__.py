"""KV connectors: one package each (``offload``, ``pool``, ``p2p``); under ``base`` the registry
(:mod:`hwkv.connectors.base.registry`), the two roles (:mod:`hwkv.connectors.base.roles`: a
scheduler-side and a worker-side class, assembled by a ``SplitConnector``) and the job bookkeeping
of each role (:mod:`hwkv.connectors.base.jobs`)."""

from hwkv.connectors.base.registry import bind_connector, connector_stats, find_connector, make_connector
from hwkv.interfaces.connector import KVConnectorBase, NoOpConnector

__all__ = ["KVConnectorBase", "NoOpConnector", "bind_connector", "connector_stats", "find_connector",
           "make_connector"]
