"""Imports point down (docs/architecture.md, "Layering"), checked on the import graph of ``hwkv/``
read with ``ast``: every import counts, at module level or inside a function (a function-level
import still ties the two modules), except those under ``if TYPE_CHECKING:`` (annotations only)."""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import cache
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "hwkv"


@cache
def modules() -> dict[str, Path]:
    out = {}
    for p in PKG.rglob("*.py"):
        parts = p.relative_to(PKG.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _owner(name: str) -> str:
    """The module of ``hwkv.x.y`` (``hwkv.x`` where ``y`` is a name defined in it)."""
    mods = modules()
    while name not in mods:
        name = name.rpartition(".")[0]
    return name


@cache
def imports() -> tuple[tuple[str, str, int], ...]:
    """``(importer, imported, line)`` of every hwkv-internal import."""
    mods, out = modules(), []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[:len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                # ``from pkg import sub`` ties to the submodule, ``from pkg import name`` to pkg
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            out += [(mod, _owner(n), node.lineno) for n in names if n.split(".")[0] == "hwkv"]
    return tuple(sorted({i for i in out if i[0] != i[1]}))


def _area(mod: str) -> str:
    return mod.split(".")[1] if mod.count(".") else mod


def _breaking(rule: object) -> list[str]:
    return [f"{a} -> {b} (line {n})" for a, b, n in imports() if rule(a, b)]  # type: ignore[operator]


def test_interfaces_import_no_implementation():
    assert _breaking(lambda a, b: _area(a) == "interfaces" and _area(b) != "interfaces") == []


def test_interfaces_name_no_implementation_even_in_annotations():
    """The interfaces declare what they need of the core's records as Protocols
    (``interfaces/connector.py``): not even an annotation-only import points up."""
    up = []
    for path in sorted((PKG / "interfaces").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hwkv.") \
                    and not node.module.startswith("hwkv.interfaces"):
                up.append(f"{path.name}: {node.module} (line {node.lineno})")
    assert up == []


def test_core_imports_only_interfaces():
    """The scheduler, KV cache manager and prefix cache know neither connectors nor speculative
    decoding (they see the connector interface) nor anything above them."""
    assert _breaking(lambda a, b: _area(a) == "core" and _area(b) not in ("core", "interfaces")) == []


def test_engine_finds_speculative_decoding_by_name():
    """``spec_decode`` extends the engine (its runner is a ModelRunner); the engine reaches it only by
    name (``hwkv/engine/spec_config.py``: ``METHODS``, ``SPEC_RUNNER``), as it reaches backends."""
    assert _breaking(lambda a, b: _area(a) == "engine" and _area(b) == "spec_decode") == []


def test_package_code_never_imports_testing():
    assert _breaking(lambda a, b: _area(b) == "testing" and _area(a) != "testing") == []


def test_benches_live_under_bench():
    """Benchmarks are ``hwkv/bench/*`` (run through ``hwkv bench``), not parts of what they measure."""
    assert _breaking(lambda a, b: _area(b) == "bench" and _area(a) != "bench" and a != "hwkv.commands.bench") == []
    assert [m for m in modules() if "bench" in m.split(".")[-1] and _area(m) != "bench"] == ["hwkv.commands.bench"]


def test_no_import_cycles():
    """No two modules import each other, directly or around a loop (strongly connected components)."""
    graph = defaultdict(set)
    for a, b, _ in imports():
        graph[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while (w := stack.pop()) != v:
                comp.append(w)
            if comp:
                cycles.append(sorted([v, *comp]))

    for v in sorted(modules()):
        if v not in index:
            visit(v)
    assert cycles == []
