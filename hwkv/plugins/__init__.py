"""Plugin discovery (pluggy, entry-point group ``hwkv.backends``) and backend lookup."""

from hwkv.interfaces.backend import BackendUnavailable
from hwkv.plugins.hookspecs import ENTRY_POINT_GROUP, BenchSpec, ConnectorSpec, StoreSpec, hookimpl, hookspec
from hwkv.plugins.manager import (
    BackendConflict,
    BackendInfo,
    PluginApiWarning,
    available_backends,
    get_backend,
    list_backends,
    list_benches,
    list_connectors,
    reset,
)

__all__ = [
    "ENTRY_POINT_GROUP", "BackendConflict", "BackendInfo", "BackendUnavailable", "BenchSpec", "ConnectorSpec",
    "PluginApiWarning", "StoreSpec", "available_backends", "get_backend", "hookimpl", "hookspec",
    "list_backends", "list_benches", "list_connectors", "reset",
]
