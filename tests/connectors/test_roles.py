"""Connectors are split by role (docs/architecture.md, "Connectors"): a scheduler-side class and a
worker-side class that own their state, assembled by a :class:`SplitConnector` that only forwards.
Checked on every class defined under ``hwkv/connectors``."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import hwkv.connectors
from hwkv.connectors.base.roles import ConnectorScheduler, ConnectorWorker, SplitConnector
from hwkv.interfaces.connector import KVConnectorBase


def _classes() -> list[type]:
    out = []
    for info in pkgutil.walk_packages(hwkv.connectors.__path__, "hwkv.connectors."):
        mod = importlib.import_module(info.name)
        out += [c for _, c in inspect.getmembers(mod, inspect.isclass) if c.__module__ == mod.__name__]
    return out


def _name(c: type) -> str:
    return f"{c.__module__}.{c.__qualname__}"


def test_no_class_is_both_sides():
    both = [_name(c) for c in _classes() if issubclass(c, ConnectorScheduler) and issubclass(c, ConnectorWorker)]
    assert not both
    mixed = [_name(c) for c in _classes() if issubclass(c, KVConnectorBase)
             and issubclass(c, (ConnectorScheduler, ConnectorWorker))]
    assert not mixed  # a connector holds its sides, it is neither


def test_every_connector_is_split():
    loose = {_name(c) for c in _classes() if issubclass(c, KVConnectorBase) and not issubclass(c, SplitConnector)}
    assert not loose


def test_the_forwarding_connector_owns_no_side_state():
    """SplitConnector's hooks only forward: it sets no attribute of its own."""
    src = inspect.getsource(SplitConnector)
    assert "self.scheduler." in src and "self.worker." in src
    assert not [line for line in src.splitlines() if line.strip().startswith("self.") and " = " in line]


@pytest.mark.parametrize("name, config", [("offload", {"cpu_bytes": 1 << 20}), ("pool", {"store": "embedded"}),
                                          ("p2p", {"role": "producer"})])
def test_built_in_connectors_hold_one_side_of_each(name, config):
    from hwkv.connectors import make_connector

    conn = make_connector(name, config)
    try:
        assert isinstance(conn, SplitConnector)
        assert isinstance(conn.scheduler, ConnectorScheduler) and not isinstance(conn.scheduler, ConnectorWorker)
        assert isinstance(conn.worker, ConnectorWorker) and not isinstance(conn.worker, ConnectorScheduler)
        shared = set(vars(conn.scheduler)) & set(vars(conn.worker)) - {"tp_rank", "tp_size"}
        # a name on both sides would be state held twice; what they share is a typed object handed to each
        assert not shared - {"geometry", "config", "state"}
        for key in shared:
            assert getattr(conn.scheduler, key) is getattr(conn.worker, key)  # one object, not two copies
    finally:
        conn.shutdown()


def test_p2p_worker_parts_set_only_declared_state():
    """The p2p worker's logic is spread over mixins by topic; every attribute they assign is declared
    in ``P2PWorker.__init__`` (one place says what a worker holds)."""
    import ast
    from pathlib import Path

    from hwkv.connectors.p2p import consumer, producer, push, transport, worker
    from hwkv.connectors.p2p.state import DriverState, P2PConfig

    w = worker.P2PWorker(P2PConfig("producer"), DriverState())
    try:
        declared = set(vars(w))
        assigned = set()
        for mod in (transport, consumer, producer, push, worker):
            tree = ast.parse(Path(mod.__file__).read_text())
            for node in ast.walk(tree):
                targets = node.targets if isinstance(node, ast.Assign) else \
                    [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
                for t in targets:
                    for e in ast.walk(t):
                        if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                            assigned.add(e.attr)
        assert assigned - declared == set()
    finally:
        w.shutdown()
