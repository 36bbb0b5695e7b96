"""The ``pool`` connector: prefix KV shared across engines through a Store (:mod:`.connector`
assembles :mod:`.scheduler` and :mod:`.worker`; :mod:`.transfer`, :mod:`.store`, :mod:`.lookup`,
:mod:`.key`)."""

from hwkv.connectors.pool.connector import PoolConnector

__all__ = ["PoolConnector"]
