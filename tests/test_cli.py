"""The ``hwkv`` command: lazy subcommands, ``hwkv backends`` (table / JSON), ``hwkv bench`` dispatch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest

from hwkv import cli, plugins

PLUGIN_SRC = Path(__file__).parent / "plugins"


def hwkv_cmd() -> list[str]:
    exe = shutil.which("hwkv")  # the console script of `pip install -e .`
    return [exe] if exe else [sys.executable, "-c", "import sys; from hwkv.cli import main; sys.exit(main())"]


@pytest.fixture(autouse=True)
def fresh_discovery(monkeypatch):
    monkeypatch.delenv("HWKV_PLUGINS", raising=False)
    monkeypatch.delenv("HWKV_DISABLED_PLUGINS", raising=False)
    plugins.reset()
    yield
    plugins.reset()


def test_backends_table_via_main(capsys):
    assert cli.main(["backends", "--wide"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["NAME", "DISTRIBUTION", "VERSION", "AVAILABLE", "REASON", "CAPABILITIES"]
    cpu = next(ln for ln in lines if ln.startswith("cpu "))
    assert cpu.split()[:4] == ["cpu", "hwkv", "0.1.0", "yes"] and "dtypes=float32,float16,bfloat16" in cpu


def _entries(out: str) -> dict[str, str]:
    """Backend name -> its row with wrapped continuation lines joined."""
    rows: dict[str, str] = {}
    name = None
    for ln in out.splitlines()[1:]:
        if ln.startswith(" "):
            rows[name] += " " + ln.strip()
        else:
            name = ln.split()[0]
            rows[name] = ln
    return rows


@pytest.mark.parametrize("columns", [100, 80])
def test_backends_table_fits_the_terminal(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert cli.main(["backends"]) == 0
    out = capsys.readouterr().out
    assert max(len(ln) for ln in out.splitlines()) <= columns
    assert out.splitlines()[0].split()[:4] == ["NAME", "DISTRIBUTION", "VERSION", "AVAILABLE"]
    rows = _entries(out)
    assert rows["cpu"].split()[:4] == ["cpu", "hwkv", "0.1.0", "yes"]
    assert "dtypes=float32,float16,bfloat16" in rows["cpu"] and "graphs=no" in rows["cpu"]


def test_backends_json_via_main(capsys):
    assert cli.main(["backends", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    cpu = rows["cpu"]
    assert cpu["available"] is True and cpu["dist"] == "hwkv" and cpu["reason"] == ""
    assert cpu["spec"]["factory"] == "hwkv.reference.backend:CpuBackend" and "block=1..256" in cpu["capabilities"]


def test_backends_subprocess_reports_a_broken_plugin(tmp_path):
    site = tmp_path / "site"
    info = site / "hwkv_tp_broken-1.0.dist-info"
    info.mkdir(parents=True)
    shutil.copy(PLUGIN_SRC / "hwkv_tp_broken.py", site)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: hwkv-tp-broken\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[hwkv.backends]\ntpbroken = hwkv_tp_broken\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("HWKV_")}
    env["PYTHONPATH"] = f"{site}{os.pathsep}{env.get('PYTHONPATH', '')}"
    out = subprocess.run([*hwkv_cmd(), "backends"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = _entries(out.stdout)
    assert rows["tpbroken"].split()[:4] == ["tpbroken", "hwkv-tp-broken", "1.0", "no"]
    assert "libfake_driver.so" in rows["tpbroken"]
    assert rows["cpu"].split()[:4] == ["cpu", "hwkv", "0.1.0", "yes"]
    js = subprocess.run([*hwkv_cmd(), "backends", "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert {r["name"]: r["available"] for r in json.loads(js.stdout)}["tpbroken"] is False


def test_unimportable_command_fails_alone(monkeypatch, capsys):
    monkeypatch.setitem(cli.COMMANDS, "ghost", ("hwkv.commands.does_not_exist", "a command not written yet"))
    monkeypatch.setitem(sys.modules, "hwkv_tp_halfcmd", types.ModuleType("hwkv_tp_halfcmd"))
    monkeypatch.setitem(cli.COMMANDS, "half", ("hwkv_tp_halfcmd", "a module without add_arguments/run"))
    assert cli.main(["ghost", "--anything"]) == 2
    err = capsys.readouterr().err
    assert "command 'ghost' is unavailable" in err and "hwkv.commands.does_not_exist" in err
    assert cli.main(["half"]) == 2
    assert "lacks add_arguments(parser) and run(args)" in capsys.readouterr().err
    assert cli.main(["backends"]) == 0  # the others are unaffected


def test_no_command_prints_help_and_version(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    for name in ("backends", "generate", "bench", "conformance"):
        assert name in err
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and "hwkv 0.1.0" in capsys.readouterr().out


def test_bench_dispatches_to_bench_module(monkeypatch, capsys):
    seen = {}
    fake = types.ModuleType("hwkv.bench.cache")
    fake.add_arguments = lambda p: p.add_argument("--blocks", type=int, default=1)
    fake.run = lambda args: seen.setdefault("blocks", args.blocks) and 7
    monkeypatch.setitem(sys.modules, "hwkv.bench.cache", fake)
    assert cli.main(["bench", "cache", "--blocks", "32"]) == 7 and seen == {"blocks": 32}
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "cache", "--help"])
    assert e.value.code == 0 and "hwkv bench cache" in capsys.readouterr().out
    monkeypatch.setitem(sys.modules, "hwkv.bench.scheduler", None)  # an unimportable bench
    assert cli.main(["bench", "scheduler"]) == 2
    assert "bench 'scheduler' is unavailable" in capsys.readouterr().err
    assert cli.main(["bench", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown bench 'nope'" in err
    allowed = err.split("allowed: ")[1].split(";")[0].split(", ")
    assert allowed == sorted(allowed) and {"cache", "e2e", "host", "scheduler"} <= set(allowed)


@pytest.mark.parametrize(("argv", "extra", "hidden"), [
    (["serve", "--model", "m"], "serve", "uvicorn"), (["proxy", "--prefill", "http://a", "--decode", "http://b"],
                                                      "serve", "httpx"),
    (["conformance", "--backend", "cpu"], "conformance", "pytest"), (["bench", "serve"], "serve", "httpx"),
])
def test_a_missing_extra_is_one_line_naming_it(monkeypatch, capsys, argv, extra, hidden):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == hidden else real(name, *a))
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"'{extra}' extra" in err and f"missing: {hidden}" in err, err
    assert f"pip install 'hwkv[{extra}]'" in err
