"""The ``p2p`` connector: prefill/decode disaggregation (:mod:`.connector`, :mod:`.producer`,
:mod:`.consumer`, :mod:`.push`, :mod:`.transport`, :mod:`.channel`, :mod:`.protocol`)."""

from hwkv.connectors.p2p.connector import P2PConnector

__all__ = ["P2PConnector"]
