"""Backend discovery: entry points → pluggy hooks → :class:`BackendSpec` records → Backend classes.

Policy:
* every entry point of group ``hwkv.backends`` is loaded in its own ``try``: a plugin that fails to
  import is listed with its error and never breaks ``import hwkv`` or the other plugins. "Fails"
  is any exception, ``SystemExit`` (a plugin calling ``sys.exit()``) and other ``BaseException`` subclasses
  included; only ``KeyboardInterrupt`` propagates. The same holds for a backend's factory import,
  its ``availability()`` and its construction;
* factories (``"pkg.mod:Class"``) are imported only when a backend's availability is checked or the
  backend is requested;
* a spec whose API major version differs from :data:`API_VERSION` is listed but refused; a newer
  minor version warns;
* two specs with the same backend name are a conflict: both are listed as unusable, naming both
  distributions, and neither is picked silently;
* ``HWKV_PLUGINS`` (allow-list) and ``HWKV_DISABLED_PLUGINS`` (block-list) hold comma-separated
  entry-point or distribution names;
* ``HWKV_PLUGIN_MODULES`` names plugin modules to register without an installed distribution (a
  source checkout on ``PYTHONPATH``, e.g. ``hwkv_cuda.plugin``), each as if it had an entry point.
Discovery runs once and is cached; :func:`reset` forgets it (tests, changed environment).
"""

from __future__ import annotations

import importlib
import os
import threading
import warnings
from dataclasses import asdict, dataclass
from importlib.metadata import entry_points
from typing import Any

import pluggy

from hwkv import __version__
from hwkv.interfaces.backend import API_VERSION, Backend, BackendSpec, BackendUnavailable
from hwkv.plugins import hookspecs
from hwkv.plugins.hookspecs import ENTRY_POINT_GROUP, PROJECT

BUILTIN_PLUGIN = "hwkv.reference.plugin"
BUILTIN_CONNECTORS = "hwkv.connectors.plugin"  # the built-in KV connectors' plugin, registered first


class BackendConflict(BackendUnavailable):
    """Two installed distributions provide a backend of the same name."""


class PluginApiWarning(UserWarning):
    """A plugin targets a newer minor version of the hwkv backend API than this hwkv implements."""


@dataclass
class BackendInfo:
    """One row of ``hwkv backends``: a backend, or a plugin that produced none (``spec is None``)."""

    name: str
    dist: str
    version: str
    available: bool
    reason: str
    capabilities: str = ""
    spec: BackendSpec | None = None
    plugin: str = ""  # entry-point name

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["spec"] = asdict(self.spec) if self.spec else None
        return d


@dataclass
class _Entry:
    info: BackendInfo
    refused: str = ""  # set when the backend can never load (plugin error, API major, conflict, disabled)
    cls: type[Backend] | None = None
    instance: Backend | None = None
    conflict: bool = False


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(".", "-")


def _env_names(var: str) -> set[str] | None:
    raw = os.environ.get(var)
    if raw is None or not raw.strip():
        return None
    return {_norm(n) for n in raw.split(",") if n.strip()}


def _parse_version(v: str) -> tuple[int, int]:
    parts = str(v).split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(v)
    return int(parts[0]), int(parts[1])


def _import_factory(factory: str) -> Any:
    mod, sep, attr = factory.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"factory {factory!r} must be 'package.module:Class'")
    obj: Any = importlib.import_module(mod)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _err(e: BaseException) -> str:
    if isinstance(e, KeyboardInterrupt):  # the user's Ctrl-C is never a plugin's failure
        raise e
    if isinstance(e, SystemExit):
        return f"SystemExit({e.code!r}) (the plugin called sys.exit())"
    return f"{type(e).__name__}: {e}"


class _Registry:
    def __init__(self) -> None:
        self.pm = pluggy.PluginManager(PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.entries: list[_Entry] = []
        self.pm.register(importlib.import_module(BUILTIN_CONNECTORS), name="hwkv:connectors")
        self._discover()

    # -- discovery -----------------------------------------------------------------------------
    def _plugin_sources(self) -> list[tuple[str, str, str, Any]]:
        """(entry-point name, dist, version, loader) for every plugin, built-in included."""
        eps = list(entry_points(group=ENTRY_POINT_GROUP))
        out: list[tuple[str, str, str, Any]] = []
        for ep in eps:
            dist = getattr(ep, "dist", None)
            out.append((ep.name, dist.name if dist else "?", dist.version if dist else "?", ep.load))
        if not any(ep.value.split(":")[0].strip() == BUILTIN_PLUGIN for ep in eps):
            # Running from a source tree that was never pip-installed: register the reference
            # plugin anyway, through the same hook.

            out.append(("cpu", "hwkv", __version__, lambda: importlib.import_module(BUILTIN_PLUGIN)))
        known = {ep.value.split(":")[0].strip() for ep in eps} | {BUILTIN_PLUGIN}
        for mod in (m.strip() for m in os.environ.get("HWKV_PLUGIN_MODULES", "").split(",")):
            if mod and mod not in known:
                known.add(mod)
                out.append((mod, mod.split(".")[0], "source", lambda mod=mod: importlib.import_module(mod)))
        return out

    def _discover(self) -> None:
        allow, block = _env_names("HWKV_PLUGINS"), _env_names("HWKV_DISABLED_PLUGINS")
        for ep_name, dist, version, load in self._plugin_sources():
            ids = {_norm(ep_name), _norm(dist)}
            row = BackendInfo(name=ep_name, dist=dist, version=version, available=False, reason="", plugin=ep_name)
            if block is not None and ids & block:
                self._refuse(row, f"disabled by HWKV_DISABLED_PLUGINS={os.environ['HWKV_DISABLED_PLUGINS']}")
                continue
            if allow is not None and not ids & allow:
                self._refuse(row, f"disabled: not in HWKV_PLUGINS={os.environ['HWKV_PLUGINS']}")
                continue
            module = None
            try:
                module = load()
                self.pm.register(module, name=f"{dist}:{ep_name}")
                impls = [i for i in self.pm.hook.hwkv_backends.get_hookimpls() if i.plugin is module]
                specs: list[Any] = []
                for impl in impls:
                    specs.extend(impl.function() or [])
            except BaseException as e:  # a broken plugin must never break hwkv (_err re-raises Ctrl-C)
                self._refuse(row, f"plugin {ep_name!r} failed to load: {_err(e)}")
                if module is not None and self.pm.is_registered(module):
                    self.pm.unregister(module)  # none of its hooks may run later
                continue
            if not impls:
                self._refuse(row, f"plugin {ep_name!r} implements no hwkv_backends hook")
            for spec in specs:
                self._add_spec(spec, ep_name, dist, version)
        self._mark_conflicts()
        self.entries.sort(key=lambda e: (e.info.name, e.info.dist))

    def _refuse(self, row: BackendInfo, reason: str, spec: BackendSpec | None = None) -> None:
        row.reason, row.spec = reason, spec
        self.entries.append(_Entry(row, refused=reason))

    def _add_spec(self, spec: Any, ep_name: str, dist: str, version: str) -> None:
        row = BackendInfo(name=getattr(spec, "name", ep_name) or ep_name, dist=dist, version=version,
                          available=False, reason="", plugin=ep_name)
        if not isinstance(spec, BackendSpec):
            return self._refuse(row, f"plugin {ep_name!r} returned {spec!r}, expected a BackendSpec")
        row.spec = spec
        try:
            major, minor = _parse_version(spec.api_version)
        except ValueError:
            return self._refuse(row, f"api_version {spec.api_version!r} is not 'MAJOR.MINOR'", spec)
        ours = _parse_version(API_VERSION)
        if major != ours[0]:
            return self._refuse(
                row,
                f"written for hwkv backend API {spec.api_version}, but this hwkv implements API {API_VERSION}"
                f" (major versions must match); install a {dist} release for API {ours[0]}.x",
                spec,
            )
        if minor > ours[1]:
            warnings.warn(
                f"backend {spec.name!r} from {dist} {version} targets hwkv backend API {spec.api_version}, "
                f"newer than this hwkv's API {API_VERSION}; features it expects may be missing",
                PluginApiWarning,
                stacklevel=2,
            )
        self.entries.append(_Entry(row))

    def _mark_conflicts(self) -> None:
        by_name: dict[str, list[_Entry]] = {}
        for e in self.entries:
            if e.info.spec is not None and not e.refused:  # a refused (e.g. wrong-major) plugin claims no name
                by_name.setdefault(e.info.name, []).append(e)
        for name, group in by_name.items():
            if len(group) < 2:
                continue
            who = ", ".join(f"{e.info.dist} {e.info.version} (entry point {e.info.plugin!r})" for e in group)
            reason = (f"backend name {name!r} is provided by {len(group)} distributions: {who}; uninstall one "
                      "or choose with HWKV_PLUGINS / HWKV_DISABLED_PLUGINS")
            for e in group:
                e.refused = e.info.reason = reason
                e.conflict, e.info.available = True, False

    # -- lazy checks ---------------------------------------------------------------------------
    def check(self, e: _Entry) -> None:
        # A positive result is final; a negative one is re-checked on every call (availability() is
        # cheap) so a driver or emulator that appears later in the process is picked up.
        if e.refused or e.info.available:
            return
        assert e.info.spec is not None
        try:
            cls = _import_factory(e.info.spec.factory)
        except BaseException as ex:
            e.info.reason = f"cannot import factory {e.info.spec.factory!r}: {_err(ex)}"
            return
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            e.info.reason = f"factory {e.info.spec.factory!r} is not a hwkv.interfaces.Backend subclass"
            return
        try:
            ok, why = cls.availability()
        except BaseException as ex:
            e.info.reason = f"availability check raised {_err(ex)}"
            return
        e.cls, e.info.available = cls, bool(ok)
        e.info.reason = "" if ok else (str(why) or "unavailable (the backend gave no reason)")

    def instance(self, e: _Entry) -> Backend:
        self.check(e)
        if not e.info.available:
            raise (BackendConflict if e.conflict else BackendUnavailable)(
                f"backend {e.info.name!r} ({e.info.dist} {e.info.version}) is unavailable: {e.info.reason}"
            )
        if e.instance is None:
            assert e.cls is not None
            try:
                e.instance = e.cls()
            except BaseException as ex:  # SystemExit from a vendor runtime must not end the caller
                if isinstance(ex, (KeyboardInterrupt, Exception)):
                    raise
                raise BackendUnavailable(f"backend {e.info.name!r} ({e.info.dist} {e.info.version}): "
                                         f"constructing it raised {_err(ex)}") from None
        return e.instance

    def capabilities(self, e: _Entry) -> None:
        self.check(e)
        if not e.info.available or e.info.capabilities:
            return
        try:
            e.info.capabilities = self.instance(e).capabilities.summary()
        except BaseException as ex:  # constructing an "available" backend can still fail on odd hosts
            e.info.available, e.info.reason = False, f"constructing the backend raised {_err(ex)}"

    def find(self, name: str) -> _Entry | None:
        hits = [e for e in self.entries if e.info.name == name]
        with_spec = [e for e in hits if e.info.spec is not None]
        return (with_spec or hits or [None])[0]


_lock = threading.RLock()
_registry: _Registry | None = None


def _get() -> _Registry:
    global _registry
    with _lock:
        if _registry is None:
            _registry = _Registry()
        return _registry


def reset() -> None:
    """Forget discovery results, availability checks and backend instances."""
    global _registry
    with _lock:
        _registry = None


def list_backends() -> list[BackendInfo]:
    """Every discovered backend and every plugin that failed, with availability and capabilities.

    Checks availability (importing factories) and builds available backends to read capabilities.
    """
    reg = _get()
    with _lock:
        for e in reg.entries:
            if e.info.spec is not None:
                reg.capabilities(e)
        return [BackendInfo(**{**e.info.__dict__}) for e in reg.entries]


def available_backends() -> list[str]:
    """Names of backends that can run here (imports factories, constructs nothing)."""
    reg = _get()
    with _lock:
        for e in reg.entries:
            if e.info.spec is not None:
                reg.check(e)
        return sorted(e.info.name for e in reg.entries if e.info.available)


def list_benches() -> list[hookspecs.BenchSpec]:
    """Benchmarks the loaded plugins provide (``hwkv_benches`` hook), sorted by name; a plugin whose
    hook raises contributes none (as a broken plugin never breaks discovery)."""
    reg = _get()
    specs: list[hookspecs.BenchSpec] = []
    with _lock:
        for impl in reg.pm.hook.hwkv_benches.get_hookimpls():
            try:
                specs.extend(impl.function() or [])
            except Exception as e:
                warnings.warn(f"plugin {impl.plugin_name!r}: hwkv_benches failed: {_err(e)}", stacklevel=2)
    return sorted(specs, key=lambda s: s.name)


def list_connectors() -> list[tuple[hookspecs.ConnectorSpec, str]]:
    """``(spec, plugin name)`` of every KV connector the loaded plugins register (``hwkv_connectors``
    hook), sorted by name; a plugin whose hook raises or returns something else contributes none,
    with a warning. The first plugin to claim a name keeps it (the built-in plugin loads first)."""
    reg = _get()
    out: dict[str, tuple[hookspecs.ConnectorSpec, str]] = {}
    with _lock:
        for impl in reversed(reg.pm.hook.hwkv_connectors.get_hookimpls()):  # registration order
            try:
                specs = list(impl.function() or [])
            except Exception as e:
                warnings.warn(f"plugin {impl.plugin_name!r}: hwkv_connectors failed: {_err(e)}", stacklevel=2)
                continue
            for spec in specs:
                if not isinstance(spec, hookspecs.ConnectorSpec):
                    warnings.warn(f"plugin {impl.plugin_name!r}: hwkv_connectors returned {spec!r}, expected a "
                                  "ConnectorSpec", stacklevel=2)
                elif spec.name in out:
                    warnings.warn(f"plugin {impl.plugin_name!r}: KV connector {spec.name!r} is already provided "
                                  f"by {out[spec.name][1]!r}; ignored", stacklevel=2)
                else:
                    out[spec.name] = (spec, impl.plugin_name)
    return [out[k] for k in sorted(out)]


def get_backend(name: str) -> Backend:
    """The backend instance called ``name`` (one per discovery; :func:`reset` drops it).

    Raises ``ValueError`` for an unknown name and :class:`BackendUnavailable` (or its subclass
    :class:`BackendConflict`) with the reason and the fix for a known one that cannot run.
    """
    reg = _get()
    with _lock:
        e = reg.find(name)
        if e is None:
            avail = ", ".join(available_backends()) or "none"
            raise ValueError(f"unknown backend {name!r}; available: {avail}")
        return reg.instance(e)
