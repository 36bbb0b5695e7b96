"""pytest wiring of the suite: options, certification rules, backend fixtures, parametrization."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conformance.check import Check
from conformance.coverage import recording
from conformance.harness import generator
from conformance.report import DEFAULT_TIMEOUT_S, ReportPlugin, environment, short_id
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
    g.addoption("--quick", action="store_true", help="smoke subset: one dtype, block size and head size per test "
                "(refused by --certify)")
    g.addoption("--devices", type=int, default=1, help="devices the run may use: >= 2 adds the multi-device tests")
    g.addoption("--worker-dir", default=None, help=argparse_suppress())
    g.addoption("--worker-index", type=int, default=0, help=argparse_suppress())


def argparse_suppress() -> str:
    import argparse

    return argparse.SUPPRESS


def _certify_violations(config: pytest.Config) -> list[str]:
    o = config.option
    bad = []
    if o.quick:
        bad.append("--quick")
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
    config.addinivalue_line("markers", "slow: left out of --quick")
    config.addinivalue_line("markers", "registered_backend: needs the backend by its registered name (not an "
                            "in-process instance)")
    config.addinivalue_line("markers", "serial: runs alone (reads a device-wide figure other tests move)")
    config.addinivalue_line("markers", "multi_device: needs several devices (or ranks on the host): --devices >= 2")
    if config.option.devices < 1:
        raise pytest.UsageError(f"--devices must be >= 1, got {config.option.devices}")
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
        "devices": config.option.devices,
        "quick": bool(config.option.quick),
    }
    plugin.configure(meta, config.option.hwkv_report, config.option.test_timeout or DEFAULT_TIMEOUT_S)
    if config.option.worker_dir:
        from conformance.parallel import WorkerLoop

        plugin.worker = (Path(config.option.worker_dir), config.option.worker_index)
        config.pluginmanager.register(WorkerLoop(config.option.worker_dir, config.option.worker_index),
                                      "hwkv-conformance-worker")
    config.stash[_BACKEND], config.stash[_REFERENCE] = backend, reference
    config.stash[_TABLE], config.stash[_PLUGIN] = table, plugin


def _head_sizes(caps: Capabilities) -> list[int]:
    declared = [h for h in (caps.head_sizes or ()) if h not in PROBE_HEAD_SIZES]  # every declared one
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
    if "long_combo" in metafunc.fixturenames:  # every declared dtype at the default block size, + the smallest
        combos = [(d, caps.default_block_size) for d in caps.dtypes]
        smallest = min(caps.test_block_sizes())
        if smallest != caps.default_block_size:
            combos.append((caps.dtypes[0], smallest))
        metafunc.parametrize("long_combo", combos, ids=[f"{str(d).removeprefix('torch.')}-bs{b}" for d, b in combos])
    if "head_size" in metafunc.fixturenames:
        hs = _head_sizes(caps)
        metafunc.parametrize("head_size", hs, ids=[f"hd{h}" for h in hs])


def host_ranks(backend: object) -> bool:
    """The backend's device is the host: several ranks share it, so multi-rank tests always run."""
    return getattr(backend.device, "visible_devices_env", None) is None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    backend, plugin = config.stash[_BACKEND], config.stash[_PLUGIN]
    # several devices given (or ranks on the host), and a backend other processes can rebuild
    multi = (config.option.devices >= 2 or host_ranks(backend)) and _spec(config) is not None
    keep, drop = [], []
    quick = _quick_params(backend.capabilities) if config.option.quick else None
    for it in items:
        if it.get_closest_marker("multi_device") is not None and not multi:
            drop.append(it)
        elif it.get_closest_marker("registered_backend") is not None and plugin.backend is not None:
            drop.append(it)  # e.g. tensor-parallel workers build their backend by its registered name
        elif quick is not None and not _quick_keep(it, quick):
            drop.append(it)
        else:
            keep.append(it)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    plugin.multi_device_ids = [short_id(it.nodeid) for it in items
                               if it.get_closest_marker("multi_device") is not None]


def _spec(config: pytest.Config) -> str | None:
    """How another process rebuilds the backend under test (conformance.ranks.build), or None."""
    plugin = config.stash[_PLUGIN]
    if plugin.backend is None:
        return f"plugin:{config.option.backend}"
    return getattr(plugin.backend, "conformance_spec", None)


@pytest.fixture(scope="session")
def backend_spec(pytestconfig: pytest.Config) -> str:
    spec = _spec(pytestconfig)
    assert spec is not None, "multi-device tests need a backend other processes can rebuild"
    return spec


def _quick_params(caps: Capabilities) -> dict[str, object]:
    dtype = torch.bfloat16 if torch.bfloat16 in caps.dtypes else caps.dtypes[0]
    head = 128 if caps.head_sizes is None or 128 in caps.head_sizes else caps.head_sizes[0]
    return {"dtype": dtype, "block_size": caps.default_block_size, "head_size": head, "protocol": None}


def _quick_keep(item: pytest.Item, quick: dict[str, object]) -> bool:
    """--quick: the backend's preferred dtype, default block size and one head size per test."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name, want in quick.items():
        if name in params and want is not None and params[name] != want:
            return False
    return item.get_closest_marker("slow") is None


@pytest.fixture(scope="session")
def backend(pytestconfig: pytest.Config):
    """The backend under test, seen through the coverage recorder (arguments of interface calls)."""
    return recording(pytestconfig.stash[_BACKEND], pytestconfig.stash[_PLUGIN].coverage)


@pytest.fixture(scope="session")
def coverage_log(pytestconfig: pytest.Config):
    """The run's argument coverage (:class:`conformance.coverage.Coverage`): rank processes' notes merge here."""
    return pytestconfig.stash[_PLUGIN].coverage


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

