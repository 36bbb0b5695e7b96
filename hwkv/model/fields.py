"""Typed, range-checked reads of ``config.json`` values.

A malformed number must fail at load time with a message naming the file, the field, the value and
what is allowed — not as a ``ZeroDivisionError`` deep in the forward, and never silently truncated
(``64.5`` heads). JSON gives ``true`` where an int is expected as a ``bool``, a subclass of ``int``:
bools are refused for every number.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

_MISSING = object()


class ModelLoadError(ValueError):
    """A model directory cannot be loaded; the message names the file and what is expected."""


class ConfigFields:
    """Reads ``data`` (a config dict or a nested dict such as ``rope_scaling``) for ``source``.

    ``prefix`` names the nested dict in messages (``rope_scaling.factor``). Every reader raises
    :class:`ModelLoadError` ``"<source>: <field> = <value> is not allowed (allowed: <range>)"``.
    """

    def __init__(self, data: Mapping[str, Any], source: str, prefix: str = ""):
        self.data, self.source, self.prefix = data, source, prefix

    def fail(self, key: str, value: Any, allowed: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {self.prefix}{key} = {value!r} is not allowed (allowed: {allowed})")

    def error(self, message: str) -> ModelLoadError:
        return ModelLoadError(f"{self.source}: {message}")

    def raw(self, key: str, default: Any = None) -> Any:
        """The value, with JSON ``null`` read as absent."""
        v = self.data.get(key)
        return default if v is None else v

    def _get(self, key: str, required: bool) -> Any:
        v = self.data.get(key)
        if v is None and required:
            raise self.error(f"required key {self.prefix + key!r} is missing")
        return v

    def integer(self, key: str, default: Any = _MISSING, lo: int | None = 1, hi: int | None = None) -> Any:
        """An integer in ``[lo, hi]``; integral floats (``64.0``) are accepted, ``64.5`` and bools are
        not. ``default`` (returned unchecked) when absent; required when no default is given."""
        v = self._get(key, default is _MISSING)
        return default if v is None else self.check_int(key, v, lo, hi)

    def check_int(self, key: str, v: Any, lo: int | None = 1, hi: int | None = None) -> int:
        allowed = _int_range(lo, hi)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise self.fail(key, v, allowed)
        if isinstance(v, float):
            if not v.is_integer():
                raise self.fail(key, v, allowed)
            v = int(v)
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise self.fail(key, v, allowed)
        return v

    def number(self, key: str, default: Any = _MISSING, gt: float | None = None, ge: float | None = None) -> Any:
        """A finite number ``> gt`` (or ``>= ge``); bools are refused. ``default`` when absent."""
        v = self._get(key, default is _MISSING)
        if v is None:
            return default
        bound = f" > {gt:g}" if gt is not None else f" >= {ge:g}" if ge is not None else ""
        allowed = f"a finite number{bound}"
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise self.fail(key, v, allowed)
        if (gt is not None and v <= gt) or (ge is not None and v < ge):
            raise self.fail(key, v, allowed)
        return float(v)

    def flag(self, key: str, default: bool = False) -> bool:
        v = self._get(key, False)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise self.fail(key, v, "true or false")
        return v

    def string(self, key: str, default: Any = _MISSING) -> Any:
        v = self._get(key, default is _MISSING)
        if v is None:
            return default
        if not isinstance(v, str):
            raise self.fail(key, v, "a string")
        return v

    def token_ids(self, key: str) -> list[int]:
        """``null``, an id or a list of ids (each an integer >= 0)."""
        v = self.data.get(key)
        if v is None:
            return []
        items = v if isinstance(v, list) else [v]
        for item in items:
            if isinstance(item, bool) or not isinstance(item, int) or item < 0:
                raise self.fail(key, v, "null, an integer >= 0 or a list of them")
        return list(items)

    def nested(self, key: str, value: Mapping[str, Any]) -> ConfigFields:
        return ConfigFields(value, self.source, f"{self.prefix}{key}.")


def _int_range(lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"an integer in [{lo}, {hi}]"
    if lo is not None:
        return f"an integer >= {lo}"
    return f"an integer <= {hi}" if hi is not None else "an integer"
