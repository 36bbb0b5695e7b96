"""pluggy hook specifications of the ``hwkv`` project.

A plugin is a module named by an entry point of group ``hwkv.backends``. It implements hooks with
the :data:`hookimpl` marker and returns typed records (conda style), never instances: factories are
``"package.module:Class"`` strings that hwkv imports only when the backend is used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pluggy

from hwkv.interfaces.backend import BackendSpec

PROJECT = "hwkv"
ENTRY_POINT_GROUP = "hwkv.backends"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@dataclass(frozen=True)
class StoreSpec:
    """A Store implementation a plugin provides (reserved: not consumed yet)."""

    name: str
    api_version: str
    factory: str
    description: str = ""


@dataclass(frozen=True)
class ConnectorSpec:
    """A KV connector a plugin provides, chosen by ``Engine(kv_connector=name, kv_connector_config={...})``.

    ``factory`` (``"package.module:Class"``, a :class:`~hwkv.interfaces.connector.KVConnectorBase`
    subclass) is imported only when the connector is chosen and called with the config as keyword
    arguments. ``config`` documents those keys (``key -> "type, default: meaning"``); a config key it
    does not list is refused before the factory runs (an empty ``config``: the factory takes none)."""

    name: str
    api_version: str
    factory: str
    description: str = ""
    config: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchSpec:
    """A benchmark a plugin provides as ``hwkv bench <name>``: ``module`` exposes
    ``add_arguments(parser)`` and ``run(args) -> int`` and is imported only when chosen."""

    name: str
    module: str
    description: str = ""


@hookspec
def hwkv_backends() -> list[BackendSpec]:  # type: ignore[empty-body]
    """The hardware backends this plugin provides."""


@hookspec
def hwkv_stores() -> list[StoreSpec]:  # type: ignore[empty-body]
    """The KV stores this plugin provides (reserved)."""


@hookspec
def hwkv_connectors() -> list[ConnectorSpec]:  # type: ignore[empty-body]
    """The KV connectors this plugin provides (``hwkv connectors`` lists them)."""


@hookspec
def hwkv_benches() -> list[BenchSpec]:  # type: ignore[empty-body]
    """Backend-specific benchmarks this plugin provides (``hwkv bench <name>``)."""
