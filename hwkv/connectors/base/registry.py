"""KV connectors by name: the ``hwkv_connectors`` plugin hook's registry, construction, stats.

Built-ins (``noop``, ``offload``, ``p2p``, ``pool``) register through :mod:`hwkv.connectors.plugin` like any third-party
connector; ``"package.module:Class"`` names a connector class that no plugin registers.
"""

from __future__ import annotations

import importlib
from typing import Any

from hwkv.interfaces.connector import KVConnectorBase, NoOpConnector

__all__ = ["KVConnectorBase", "NoOpConnector", "bind_connector", "connector_stats", "find_connector",
           "make_connector"]


def find_connector(name: str) -> Any:
    """The registered :class:`~hwkv.plugins.ConnectorSpec` called ``name``, or ``None``."""
    from hwkv.plugins import list_connectors

    return next((spec for spec, _ in list_connectors() if spec.name == name), None)


def _import(factory: str, what: str) -> type:
    mod, sep, attr = factory.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"{what}: factory {factory!r} is not 'package.module:Class'")
    try:
        cls = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"{what}: cannot import {factory} ({type(e).__name__}: {e})") from None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase)):
        raise ValueError(f"{what}: {factory} is not a hwkv KVConnectorBase subclass")
    return cls


def make_connector(connector: Any, config: dict[str, Any] | None = None) -> KVConnectorBase | None:
    """The one resolution of ``Engine(kv_connector=..., kv_connector_config=...)`` (the engine and every
    tensor-parallel worker call it): ``None`` or the no-op connector → ``None``, the one value of "no
    connector" (nothing to call); a registered name or a ``"package.module:Class"`` is constructed
    with ``config`` as keyword arguments. Test hook: an instance is used as given (no config), so a
    test can hand in a connector that fails or gates on purpose; it cannot run tensor-parallel or in
    ``hwkv serve`` (their processes build connectors from the name). Bad input raises ``ValueError``
    naming what is allowed."""
    if config is not None and not isinstance(config, dict):
        raise ValueError(f"kv_connector_config must be a dict, got {type(config).__name__}")
    if connector is None:
        if config:
            raise ValueError("kv_connector_config is given but kv_connector is not (allowed: set both)")
        return None
    if isinstance(connector, KVConnectorBase):
        if config:
            raise ValueError("kv_connector_config applies to a connector given by name, not to an instance "
                             "(configure the instance itself)")
        return None if type(connector) is NoOpConnector else connector
    if not isinstance(connector, str):
        raise ValueError(f"kv_connector must be a name, 'package.module:Class' or a KVConnectorBase, "
                         f"got {type(connector).__name__}")
    spec = find_connector(connector)
    config = dict(config or {})
    if spec is None:
        if ":" not in connector:
            from hwkv.plugins import list_connectors

            names = ", ".join(s.name for s, _ in list_connectors()) or "none"
            raise ValueError(f"kv_connector {connector!r} is unknown (allowed: {names}, or "
                             "'package.module:Class' of a KVConnectorBase subclass)")
        cls = _import(connector, f"kv_connector {connector!r}")
    else:
        unknown = sorted(set(config) - set(spec.config))
        if unknown:
            allowed = ", ".join(sorted(spec.config)) or "none"
            raise ValueError(f"kv_connector {spec.name!r}: unknown config key(s) {', '.join(unknown)} "
                             f"(allowed: {allowed})")
        cls = _import(spec.factory, f"kv_connector {spec.name!r}")
    if cls is NoOpConnector:
        return None
    try:
        return cls(**config)
    except TypeError as e:  # a missing or unexpected keyword
        raise ValueError(f"kv_connector {connector!r}: bad config {config!r} ({e})") from None


def bind_connector(conn: KVConnectorBase, backend: Any, model: str, model_config: Any, tp_rank: int = 0,
                   tp_size: int = 1) -> None:
    """What the connector learns of its engine once the model is loaded, in the order its interface
    promises (the engine and every tensor-parallel worker call this): its rank, the model, the backend."""
    if tp_size > 1:
        conn.bind_tp(tp_rank, tp_size)
    conn.bind_model(model, model_config)
    conn.bind_backend(backend)


def connector_stats(scheduler: Any) -> dict[str, Any]:
    """``engine.stats()["kv_connector"]``: the connector's own counters under the common ones, which
    the scheduler keeps (it alone knows which loads were confirmed)."""
    conn = scheduler.connector
    out: dict[str, Any] = {"name": conn.name, "loaded_bytes": 0, "stored_bytes": 0}
    out.update(conn.stats())
    out["external_hit_tokens"] = scheduler.num_external_hit_tokens
    out["load_failures"] = scheduler.num_load_failures
    out["load_kept_tokens"] = scheduler.num_load_kept_tokens
    return out
