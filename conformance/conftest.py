"""pytest wiring of the suite: options, certification rules, backend fixtures, parametrization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.check import Check
from conformance.coverage import recording
from conformance.harness import generator
from conformance.report import DEFAULT_TIMEOUT_S, ReportPlugin, environment
from conformance.tolerances import DTYPES, SUITE_VERSION, ToleranceTable
from hwkv.interfaces import Capabilities

SUITE_DIR = Path(__file__).resolve().parent
REFERENCE = "cpu"
PROBE_HEAD_SIZES = (64, 128)
_BACKEND = pytest.StashKey[object]()
_REFERENCE = pytest.StashKey[object]()
_TABLE = pytest.StashKey[ToleranceTable]()
_PLUGIN = pytest.StashKey[ReportPlugin]()


def pytest_addoption(parser: pytest.Parser) -> None:
    g = parser.getgroup("hwkv-conformance")
    g.addoption("--backend", default="cpu", help="backend under test (default: cpu, the reference)")
    g.addoption("--certify", action="store_true", help="certification run: no selection, overrides or extra options")
    g.addoption("--report", dest="hwkv_report", default=None, metavar="DIR", help="write conformance.json/.md here")
    g.addoption("--tolerance-override", action="append", default=[], metavar="DTYPE:OP=ATOL,RTOL",
                help="replace one tolerance-table entry (refused by --certify)")
    g.addoption("--conformance-seed", type=int, default=0, help="input seed (refused by --certify)")
    g.addoption("--test-timeout", type=float, default=None, help=f"per-test limit, s (default {DEFAULT_TIMEOUT_S:g})")


def _certify_violations(config: pytest.Config) -> list[str]:
    o = config.option
    bad = []
    if o.tolerance_override:
        bad.append("--tolerance-override")
    if o.conformance_seed != 0:
        bad.append("--conformance-seed")
    if o.test_timeout is not None:
        bad.append("--test-timeout")
    for name, flag in (("keyword", "-k"), ("markexpr", "-m")):
        if getattr(o, name, ""):
            bad.append(flag)
    for name, flag in (("deselect", "--deselect"), ("ignore", "--ignore"), ("ignore_glob", "--ignore-glob")):
        if getattr(o, name, None):
            bad.append(flag)
    if getattr(o, "runxfail", False):
        bad.append("--runxfail")
    if getattr(o, "maxfail", 0):
        bad.append("-x/--maxfail")
    if getattr(o, "lf", False) or getattr(o, "failedfirst", False):
        bad.append("--lf/--ff")
    if any(Path(a.split("::")[0]).resolve() != SUITE_DIR for a in config.args):
        bad.append(f"test selection {config.args}")
    return bad


def _backend_meta(name: str, backend: object) -> dict[str, object]:
    import hwkv
    from hwkv.plugins import list_backends

    info = next((b for b in list_backends() if b.name == name), None)
    return {
        "suite_version": SUITE_VERSION,
        "hwkv_version": hwkv.__version__,
        "backend": name,
        "backend_dist": getattr(info, "dist", None) or "in-process (no distribution)",
        "backend_version": getattr(info, "version", None),
        "capabilities": backend.capabilities.summary(),
        "device": backend.device.description(),
        # An emulated device proves glue, not hardware: such a run is never certified.
        "emulated": backend.capabilities.extras.get("emulated") == "yes",
    }


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "capability(name): the capability a conformance test exercises")
    config.addinivalue_line("markers", "timeout_s(seconds): per-test time limit")
    if config.option.certify:
        bad = _certify_violations(config)
        if bad:
            raise pytest.UsageError(f"--certify refuses selection, overrides and extra options; got {', '.join(bad)}")
    try:
        table = ToleranceTable(config.option.tolerance_override)
    except ValueError as e:
        raise pytest.UsageError(str(e)) from None
    from hwkv.interfaces import BackendUnavailable
    from hwkv.plugins import get_backend

    name = config.option.backend
    plugin = next((p for p in config.pluginmanager.get_plugins() if isinstance(p, ReportPlugin)), None)
    if plugin is None:
        plugin = ReportPlugin()
        config.pluginmanager.register(plugin, "hwkv-conformance-report")
    try:  # an instance handed to conformance.run (a mutant, an unregistered backend) wins over the name
        backend = plugin.backend if plugin.backend is not None else get_backend(name)
        reference = get_backend(REFERENCE)
    except (BackendUnavailable, ValueError) as e:
        raise pytest.UsageError(f"cannot load backend {name!r}: {e}") from None
    meta = _backend_meta(name, backend) | {
        "seed": config.option.conformance_seed,
        "certify": bool(config.option.certify),
        "tolerance_table": table.as_dict(),
        "tolerance_overrides": {f"{d}:{op}": str(t) for (d, op), t in table.overrides.items()},
        "pytest_args": list(config.invocation_params.args),
        "environment": environment(),
    }
    plugin.configure(meta, config.option.hwkv_report, config.option.test_timeout or DEFAULT_TIMEOUT_S)
    config.stash[_BACKEND], config.stash[_REFERENCE] = backend, reference
    config.stash[_TABLE], config.stash[_PLUGIN] = table, plugin


def _head_sizes(caps: Capabilities) -> list[int]:
    declared = [h for h in (caps.head_sizes or ()) if h not in PROBE_HEAD_SIZES][:2]
    return [*PROBE_HEAD_SIZES, *declared]


def _block_sizes(caps: Capabilities) -> list[int]:
    # Every block size the backend declares (a spread for open ranges) plus probes outside it, so
    # an exclusion shows up as NOT_SUPPORTED in the report.
    sizes = set(caps.test_block_sizes()) | {1, 16, 128}
    return sorted(sizes)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    caps = metafunc.config.stash[_BACKEND].capabilities
    if "dtype" in metafunc.fixturenames:
        metafunc.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
    if "block_size" in metafunc.fixturenames:
        bs = _block_sizes(caps)
        metafunc.parametrize("block_size", bs, ids=[f"bs{b}" for b in bs])
    if "protocol" in metafunc.fixturenames:  # every declared protocol, and tcp as a probe
        metafunc.parametrize("protocol", sorted(set(caps.transfer_protocols) | {"tcp"}))
    if "head_size" in metafunc.fixturenames:
        hs = _head_sizes(caps)
        metafunc.parametrize("head_size", hs, ids=[f"hd{h}" for h in hs])


@pytest.fixture(scope="session")
def backend(pytestconfig: pytest.Config):
    """The backend under test, seen through the coverage recorder (arguments of interface calls)."""
    return recording(pytestconfig.stash[_BACKEND], pytestconfig.stash[_PLUGIN].coverage)


@pytest.fixture(scope="session")
def engine_backend(pytestconfig: pytest.Config):
    """What ``Engine(backend=...)`` takes: the backend instance under test itself (unrecorded)."""
    return pytestconfig.stash[_BACKEND]


@pytest.fixture(scope="session")
def reference(pytestconfig: pytest.Config):
    return pytestconfig.stash[_REFERENCE]


@pytest.fixture(scope="session")
def caps(pytestconfig: pytest.Config) -> Capabilities:
    return pytestconfig.stash[_BACKEND].capabilities


@pytest.fixture
def check(request: pytest.FixtureRequest) -> Check:
    cfg = request.config
    return Check(cfg.stash[_PLUGIN].record(request.node.nodeid), cfg.stash[_TABLE])


@pytest.fixture
def gen(request: pytest.FixtureRequest) -> torch.Generator:
    """Seeded per test id, so every test's inputs are reproducible in isolation."""
    return generator(request.config.option.conformance_seed, request.node.nodeid.rsplit("/", 1)[-1])

