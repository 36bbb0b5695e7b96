"""Fixtures of the Ascend backend tests: the torch_npu emulator installed through ``sys.modules``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_HERE = Path(__file__).resolve().parent


def load_emulator():
    """The emulator module, loaded by path under a unique name (sibling test dirs share basenames)."""
    name = "hwkv_ascend_tests_npu_emulator"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, _HERE / "npu_emulator.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def _reset_plugins() -> None:
    try:
        from hwkv.plugins import reset
    except ImportError:
        return
    reset()  # the registry caches availability and instances


@pytest.fixture
def emulator():
    return load_emulator()


@pytest.fixture
def npu(monkeypatch, emulator):
    """Install an emulated A2 ``torch_npu``; removed (and plugin caches reset) afterwards."""
    mod = emulator.make_module()
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    _reset_plugins()
    yield mod
    monkeypatch.delitem(sys.modules, "torch_npu", raising=False)
    _reset_plugins()


@pytest.fixture
def no_npu(monkeypatch):
    """Make sure ``torch_npu`` is not importable, whatever the machine has."""
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # import then raises ImportError
    _reset_plugins()
    yield
    _reset_plugins()
