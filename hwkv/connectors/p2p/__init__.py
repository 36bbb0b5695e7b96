"""The ``p2p`` connector: prefill/decode disaggregation (:mod:`.connector` assembles
:mod:`.scheduler` and :mod:`.worker` over :mod:`.state`; the worker's parts :mod:`.transport`,
:mod:`.consumer`, :mod:`.producer`, :mod:`.push`; :mod:`.channel`, :mod:`.protocol`)."""

from hwkv.connectors.p2p.connector import P2PConnector

__all__ = ["P2PConnector"]
