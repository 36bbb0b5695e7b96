"""The interfaces: what a hardware backend implements (Device, Attention, Transfer, Store,
Communicator, DecodeOps, ElementwiseOps, declared in Capabilities and the plugin record), the KV layout every one of
them shares, and the KV connector interface. The core depends only on these; they import no
implementation (tests/test_layering.py)."""

from hwkv.interfaces.attention import AttentionBackend, AttentionImpl, AttentionMetadata, AttentionMetadataBuilder
from hwkv.interfaces.backend import API_VERSION, Backend, BackendSpec, BackendUnavailable, NotSupported
from hwkv.interfaces.capabilities import Capabilities
from hwkv.interfaces.connector import KVConnectorBase, NoOpConnector
from hwkv.interfaces.device import Device, Event, Stream
from hwkv.interfaces.layout import KVCache, KVCacheSpec, KVLayoutKind, Segment, group_concurrent_contiguous
from hwkv.interfaces.store import (
    Buffers,
    ItemResult,
    KeyNotFound,
    SizeMismatch,
    Store,
    StoreError,
    StoreFull,
    StoreTimeout,
    StoreUnavailable,
)
from hwkv.interfaces.transfer import Transfer, TransferError, TransferTimeout

__all__ = [
    "API_VERSION", "AttentionBackend", "AttentionImpl", "AttentionMetadata", "AttentionMetadataBuilder",
    "Backend", "BackendSpec", "BackendUnavailable", "Buffers", "Capabilities", "Device", "Event",
    "ItemResult", "KVCache", "KVCacheSpec", "KVConnectorBase", "KVLayoutKind", "KeyNotFound",
    "NoOpConnector", "NotSupported", "Segment", "SizeMismatch", "Store", "StoreError", "StoreFull",
    "StoreTimeout", "StoreUnavailable", "Stream", "Transfer", "TransferError", "TransferTimeout",
    "group_concurrent_contiguous",
]
