"""Plugin discovery through real entry points: test dists are written as .dist-info into a tmp dir
on sys.path, next to copies of the modules in tests/plugins/."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hwkv
from hwkv import plugins
from hwkv.interfaces import API_VERSION, BackendUnavailable
from hwkv.plugins import BackendConflict, PluginApiWarning, manager
from hwkv.reference import CpuBackend

PLUGIN_SRC = Path(__file__).parent / "plugins"


def write_dist(site: Path, dist: str, eps: dict[str, str], version: str = "1.0.0") -> None:
    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("[hwkv.backends]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """``install(dist, {ep: target}, version)`` makes a plugin dist visible to importlib.metadata."""
    root = tmp_path / "site"
    root.mkdir()
    for f in PLUGIN_SRC.glob("hwkv_tp_*.py"):
        shutil.copy(f, root / f.name)
    monkeypatch.delenv("HWKV_PLUGINS", raising=False)
    monkeypatch.delenv("HWKV_DISABLED_PLUGINS", raising=False)
    monkeypatch.syspath_prepend(str(root))

    def install(dist: str, eps: dict[str, str], version: str = "1.0.0") -> None:
        write_dist(root, dist, eps, version)
        import importlib

        importlib.invalidate_caches()
        plugins.reset()

    install.root = root
    plugins.reset()
    yield install
    for mod in [m for m in sys.modules if m.startswith("hwkv_tp_")]:
        del sys.modules[mod]
    plugins.reset()


def rows(name: str | None = None) -> list[plugins.BackendInfo]:
    return [r for r in plugins.list_backends() if name is None or r.name == name]


def test_builtin_cpu_backend_registers_through_the_hook(site):
    (cpu,) = rows("cpu")
    assert (cpu.dist, cpu.version, cpu.available, cpu.reason) == ("hwkv", hwkv.__version__, True, "")
    assert cpu.spec.factory == "hwkv.reference.backend:CpuBackend" and cpu.spec.api_version == API_VERSION
    assert "float32" in cpu.capabilities and "per_layer" in cpu.capabilities
    b = plugins.get_backend("cpu")
    assert isinstance(b, CpuBackend) and plugins.get_backend("cpu") is b  # one instance per discovery
    assert hwkv.get_backend is plugins.get_backend and "cpu" in hwkv.available_backends()
    json.dumps([r.to_dict() for r in plugins.list_backends()])


def test_builtin_registered_even_without_installed_entry_point(site, monkeypatch):
    monkeypatch.setattr(manager, "entry_points", lambda group: [])  # running from an uninstalled checkout
    plugins.reset()
    assert plugins.available_backends() == ["cpu"] and rows("cpu")[0].dist == "hwkv"


def test_source_tree_plugin_named_in_env_registers_without_a_dist(site, monkeypatch):
    """HWKV_PLUGIN_MODULES registers an uninstalled plugin module (a checkout on PYTHONPATH); its
    benches join ``hwkv bench``; a module already loaded through an entry point is not loaded twice."""
    from hwkv import cli

    monkeypatch.setenv("HWKV_PLUGIN_MODULES", " hwkv_tp_toy ,hwkv.reference.plugin")
    plugins.reset()
    (toy,) = rows("tp-toy")
    assert toy.available and toy.dist == "hwkv_tp_toy" and toy.version == "source"
    assert len(rows("cpu")) == 1
    assert [b.module for b in plugins.list_benches() if b.name == "tp-toy-bench"] == ["hwkv_tp_toy_bench"]
    assert cli.main(["bench", "tp-toy-bench", "--n", "2"]) == 42
    monkeypatch.delenv("HWKV_PLUGIN_MODULES")
    plugins.reset()
    assert not rows("tp-toy") and "tp-toy-bench" not in [b.name for b in plugins.list_benches()]
    assert cli.main(["bench", "tp-toy-bench"]) == 2


def test_broken_plugin_is_reported_and_breaks_nothing(site):
    site("hwkv-tp-broken", {"tpbroken": "hwkv_tp_broken"})
    site("hwkv-tp-toy", {"tptoy": "hwkv_tp_toy"})
    (row,) = rows("tpbroken")
    assert row.dist == "hwkv-tp-broken" and not row.available and row.spec is None
    assert "failed to load" in row.reason and "libfake_driver.so" in row.reason
    assert {"cpu", "tp-toy"} <= set(plugins.available_backends())
    with pytest.raises(BackendUnavailable, match="libfake_driver.so"):
        plugins.get_backend("tpbroken")
    # A fresh interpreter: `import hwkv` and discovery survive the broken plugin.
    env = {**os.environ, "PYTHONPATH": f"{site.root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = "import hwkv; print(sorted((r.name, r.available) for r in hwkv.list_backends()))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "('tpbroken', False)" in out.stdout and "('cpu', True)" in out.stdout


def test_factories_are_imported_lazily(site):
    site("hwkv-tp-toy", {"tptoy": "hwkv_tp_toy"}, version="2.3.4")
    plugins.get_backend("cpu")  # discovery loads plugin modules, but only the requested factory
    assert "hwkv_tp_toy" in sys.modules and "hwkv_tp_toy_impl" not in sys.modules
    toy = plugins.get_backend("tp-toy")
    assert type(toy).__name__ == "ToyBackend" and "hwkv_tp_toy_impl" in sys.modules
    (row,) = rows("tp-toy")
    assert (row.dist, row.version, row.available, row.plugin) == ("hwkv-tp-toy", "2.3.4", True, "tptoy")


def test_unavailable_backends_carry_their_reason(site):
    site("hwkv-tp-toy", {"tptoy": "hwkv_tp_toy"})
    reasons = {r.name: r.reason for r in rows() if r.name.startswith("tp-toy")}
    assert reasons["tp-toy"] == ""
    assert reasons["tp-toy-down"] == "needs the toy driver: pip install toy-driver"
    assert reasons["tp-toy-raises"] == "availability check raised RuntimeError: probe exploded"
    assert "cannot import factory 'hwkv_tp_does_not_exist:Backend'" in reasons["tp-toy-missing"]
    assert "not a hwkv.interfaces.Backend subclass" in reasons["tp-toy-notbackend"]
    assert "tp-toy" in plugins.available_backends() and "tp-toy-down" not in plugins.available_backends()
    with pytest.raises(BackendUnavailable, match="tp-toy-down.*needs the toy driver"):
        plugins.get_backend("tp-toy-down")
    with pytest.raises(BackendUnavailable, match="probe exploded"):
        plugins.get_backend("tp-toy-raises")
    # A negative availability is re-checked (not cached): a driver or emulator installed later counts.
    sys.modules["hwkv_tp_toy_impl"].DRIVER["installed"] = True
    assert "tp-toy-down" in plugins.available_backends()
    assert isinstance(plugins.get_backend("tp-toy-down"), CpuBackend)


def test_unknown_backend_is_a_value_error(site):
    avail = ", ".join(plugins.available_backends())
    assert "cpu" in avail
    with pytest.raises(ValueError, match=f"^unknown backend 'nope'; available: {avail}$"):
        plugins.get_backend("nope")


def test_api_major_mismatch_refused_and_newer_minor_warns(site):
    site("hwkv-tp-versions", {"tpversions": "hwkv_tp_versions"})
    site("hwkv-tp-toy", {"tptoy": "hwkv_tp_toy"})  # impl module for the factories
    with pytest.warns(PluginApiWarning, match="tp-newminor") as caught:
        listing = plugins.list_backends()
    assert len(caught) == 1  # only the newer minor warns; the same minor does not
    by = {r.name: r for r in listing}
    major = int(API_VERSION.split(".")[0])
    nm = by["tp-nextmajor"]
    assert not nm.available and f"API {major + 1}.0" in nm.reason and f"API {API_VERSION}" in nm.reason
    assert by["tp-newminor"].available
    assert not by["tp-badversion"].available and "'one'" in by["tp-badversion"].reason
    with pytest.raises(BackendUnavailable, match=f"{major + 1}.0"):
        plugins.get_backend("tp-nextmajor")
    assert isinstance(plugins.get_backend("tp-newminor"), CpuBackend)


def test_allow_list(site, monkeypatch):
    site("hwkv-tp-toy", {"tptoy": "hwkv_tp_toy"})
    site("hwkv-tp-broken", {"tpbroken": "hwkv_tp_broken"})
    monkeypatch.setenv("HWKV_PLUGINS", "cpu")
    plugins.reset()
    assert plugins.available_backends() == ["cpu"]
    assert "hwkv_tp_toy" not in sys.modules and "hwkv_tp_broken" not in sys.modules  # never imported
    assert "not in HWKV_PLUGINS=cpu" in rows("tptoy")[0].reason
    with pytest.raises(BackendUnavailable, match="HWKV_PLUGINS"):
        plugins.get_backend("tptoy")
    monkeypatch.setenv("HWKV_PLUGINS", " hwkv_tp_toy , cpu")  # distribution names match too, normalised
    plugins.reset()
    assert set(plugins.available_backends()) == {"cpu", "tp-toy"}


def test_block_list(site, monkeypatch):
    site("hwkv-tp-toy", {"tptoy": "hwkv_tp_toy"})
    site("hwkv-tp-broken", {"tpbroken": "hwkv_tp_broken"})
    monkeypatch.setenv("HWKV_DISABLED_PLUGINS", "tptoy,tpbroken")
    plugins.reset()
    assert "cpu" in plugins.available_backends() and "tp-toy" not in plugins.available_backends()
    assert "hwkv_tp_toy" not in sys.modules and "hwkv_tp_broken" not in sys.modules
    assert rows("tpbroken")[0].reason == "disabled by HWKV_DISABLED_PLUGINS=tptoy,tpbroken"
    monkeypatch.setenv("HWKV_DISABLED_PLUGINS", "cpu")
    plugins.reset()
    with pytest.raises(BackendUnavailable, match="disabled by HWKV_DISABLED_PLUGINS"):
        plugins.get_backend("cpu")


def test_duplicate_backend_names_are_a_reported_conflict(site, monkeypatch):
    site("hwkv-tp-dup-a", {"tpdupa": "hwkv_tp_dup_a"})
    site("hwkv-tp-dup-b", {"tpdupb": "hwkv_tp_dup_b"}, version="0.2")
    dups = rows("tp-dup")
    assert len(dups) == 2 and {r.dist for r in dups} == {"hwkv-tp-dup-a", "hwkv-tp-dup-b"}
    for r in dups:
        assert not r.available and "hwkv-tp-dup-a 1.0.0" in r.reason and "hwkv-tp-dup-b 0.2" in r.reason
    assert "tp-dup" not in plugins.available_backends()
    with pytest.raises(BackendConflict, match="hwkv-tp-dup-a.*hwkv-tp-dup-b"):
        plugins.get_backend("tp-dup")
    monkeypatch.setenv("HWKV_DISABLED_PLUGINS", "hwkv-tp-dup-b")  # the fix the message suggests
    plugins.reset()
    (r,) = rows("tp-dup")
    assert r.available and r.dist == "hwkv-tp-dup-a" and r.spec.description == "first of two"


def test_misbehaving_plugins_are_reported(site):
    site("hwkv-tp-odd", {"tpnohook": "hwkv_tp_odd:NoHook", "tpbadret": "hwkv_tp_odd:BadReturn"})
    by = {r.name: r for r in rows()}
    assert "implements no hwkv_backends hook" in by["tpnohook"].reason
    assert "expected a BackendSpec" in by["tpbadret"].reason
    assert not {"tpnohook", "tpbadret", "tp-store", "tp-conn"} & set(plugins.available_backends())


_EXITING = {
    # entry-point module bodies, written as temporary plugins
    "hwkv_tp_exit": "import sys\nsys.exit(3)\n",
    "hwkv_tp_bare_exit": "import sys\nsys.exit()\n",
    "hwkv_tp_baseexc": "class VendorAbort(BaseException):\n    pass\n\nraise VendorAbort('runtime not initialised')\n",
    # a well-formed plugin whose factory module and backend misbehave later
    "hwkv_tp_late": (
        "from hwkv.interfaces import API_VERSION, BackendSpec\nfrom hwkv.plugins import hookimpl\n\n"
        "@hookimpl\ndef hwkv_backends():\n"
        "    return [BackendSpec('tp-late-import', API_VERSION, 'hwkv_tp_late_exit:B'),\n"
        "            BackendSpec('tp-late-avail', API_VERSION, 'hwkv_tp_late_impl:ExitsInAvailability')]\n"
    ),
    "hwkv_tp_late_exit": "raise SystemExit('no device')\n",
    "hwkv_tp_late_impl": (
        "from hwkv.reference import CpuBackend\n\n"
        "class ExitsInAvailability(CpuBackend):\n"
        "    @classmethod\n    def availability(cls):\n        raise SystemExit(7)\n"
    ),
    "hwkv_tp_ctrl_c": "raise KeyboardInterrupt\n",
}


def _install_exiting(site, names: list[str]) -> None:
    for mod, body in _EXITING.items():
        (site.root / f"{mod}.py").write_text(body)
    site("hwkv-tp-exiting", {n: f"hwkv_tp_{n}" for n in names})


def test_plugins_that_exit_or_raise_base_exceptions_are_isolated(site):
    _install_exiting(site, ["exit", "bare_exit", "baseexc", "late"])
    by = {r.name: r for r in rows()}
    assert "failed to load: SystemExit(3) (the plugin called sys.exit())" in by["exit"].reason
    assert "SystemExit(None)" in by["bare_exit"].reason
    assert "failed to load: VendorAbort: runtime not initialised" in by["baseexc"].reason
    assert "cannot import factory 'hwkv_tp_late_exit:B': SystemExit('no device')" in by["tp-late-import"].reason
    assert "availability check raised SystemExit(7)" in by["tp-late-avail"].reason
    assert not any(by[n].available for n in ("exit", "bare_exit", "baseexc", "tp-late-import", "tp-late-avail"))
    assert "cpu" in plugins.available_backends() and plugins.get_backend("cpu") is not None
    with pytest.raises(BackendUnavailable, match=r"SystemExit\(3\)"):
        plugins.get_backend("exit")


def test_ctrl_c_while_loading_a_plugin_is_not_swallowed(site):
    _install_exiting(site, ["ctrl_c"])
    with pytest.raises(KeyboardInterrupt):
        plugins.list_backends()


def test_an_exiting_plugin_breaks_neither_import_nor_the_cli(site):
    _install_exiting(site, ["exit", "baseexc"])
    env = {**os.environ, "PYTHONPATH": f"{site.root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = ("import hwkv, sys; from hwkv.cli import main; b = hwkv.get_backend('cpu'); print('BACKEND', b.name); "
            "sys.exit(main(['backends']))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "BACKEND cpu" in out.stdout
    assert "SystemExit(3)" in out.stdout and "VendorAbort" in out.stdout  # listed with the reason
