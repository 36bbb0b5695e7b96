"""Import safety, availability reasons, the plugin entry, the NPU device (on the emulator)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import textwrap

import pytest
import torch

from hwkv.interfaces import BackendUnavailable, KVCacheSpec, KVLayoutKind, NotSupported

FIX = "install CANN >= 9 and torch_npu>=2.10.0,<2.11 (see docs/ascend-backend.md)"
HAS_REAL_TORCH_NPU = importlib.util.find_spec("torch_npu") is not None


@pytest.mark.skipif(HAS_REAL_TORCH_NPU, reason="torch_npu is installed here")
def test_imports_without_torch_npu_and_reports_the_exact_error():
    code = textwrap.dedent("""
        import sys
        import hwkv, hwkv_ascend, hwkv_ascend.plugin, hwkv_ascend.backend, hwkv_ascend.attention, hwkv_ascend.device
        assert "torch_npu" not in sys.modules, "a module imported torch_npu at import time"
        from hwkv_ascend.backend import AscendBackend
        print(AscendBackend.availability()[1])
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"torch_npu import failed: ModuleNotFoundError: No module named 'torch_npu'; {FIX}"


def test_unavailable_reason_and_constructor_refusal(no_npu):
    from hwkv_ascend.backend import AscendBackend

    ok, reason = AscendBackend.availability()
    assert not ok
    assert reason.startswith("torch_npu import failed: ModuleNotFoundError: import of torch_npu halted")
    assert reason.endswith(FIX)
    with pytest.raises(BackendUnavailable, match="torch_npu import failed"):
        AscendBackend()


def test_registry_lists_ascend_unavailable_with_reason(no_npu):
    plugins = pytest.importorskip("hwkv.plugins")
    rows = {b.name: b for b in plugins.list_backends()}
    if "ascend" not in rows:
        pytest.skip("hwkv-ascend entry point not installed (pip install -e backends/ascend)")
    assert rows["ascend"].available is False
    assert "torch_npu import failed" in rows["ascend"].reason and FIX in rows["ascend"].reason
    with pytest.raises(BackendUnavailable, match="torch_npu import failed"):
        plugins.get_backend("ascend")


def test_hwkv_backends_command_shows_the_reason(no_npu, capsys):
    import json

    cli = pytest.importorskip("hwkv.cli")
    plugins = pytest.importorskip("hwkv.plugins")
    if "ascend" not in {b.name for b in plugins.list_backends()}:
        pytest.skip("hwkv-ascend entry point not installed (pip install -e backends/ascend)")
    cli.main(["backends", "--json"])
    data = json.loads(capsys.readouterr().out)
    rows = {b["name"]: b for b in (data if isinstance(data, list) else data["backends"])}
    assert rows["ascend"]["available"] is False and FIX in rows["ascend"]["reason"]


def test_plugin_hook_returns_the_spec():
    from hwkv_ascend import plugin

    from hwkv.interfaces import API_VERSION

    (spec,) = plugin.hwkv_backends()
    assert spec.name == "ascend" and spec.api_version == API_VERSION
    assert spec.factory == "hwkv_ascend.backend:AscendBackend"


@pytest.mark.parametrize(
    "change, expect",
    [
        (dict(version="2.6.0"), "torch_npu 2.6.0 is outside the supported range"),
        (dict(version="2.9.1"), "torch_npu 2.9.1 is outside the supported range"),  # no cache_mode
        (dict(version="2.11.0.post1"), "torch_npu 2.11.0.post1 is outside the supported range"),
        (dict(cann="8.3.RC1"), "CANN 8.3.RC1 is too old: FIA's TND layout with page attention needs CANN >= 9"),
        (dict(device_count=0), "no NPU is visible (check ASCEND_RT_VISIBLE_DEVICES"),
        (dict(soc_version=202), "Ascend 310P is not supported: FIA cannot take a block table there, its KV "
                                "caches are NZ-format and it has no bfloat16"),
        (dict(soc_version=260), "Ascend 950 (A5) is not supported: it has no ATB paged attention and must "
                                "split mixed prefill/decode batches"),
        (dict(soc_version=240), "unknown Ascend SoC (get_soc_version() = 240); supported: Atlas A2"),
    ],
    ids=["torch_npu-2.6", "torch_npu-2.9", "torch_npu-2.11", "cann-8", "no-npu", "310P", "A5", "unknown-soc"],
)
def test_availability_checks_version_cann_soc_and_devices(monkeypatch, emulator, change, expect):
    from hwkv_ascend.backend import AscendBackend

    monkeypatch.setitem(sys.modules, "torch_npu", emulator.make_module(**change))
    ok, reason = AscendBackend.availability()
    assert not ok and expect in reason
    with pytest.raises(BackendUnavailable, match="not supported|outside|too old|no NPU|unknown"):
        AscendBackend()


@pytest.mark.parametrize("soc", [222, 252], ids=["A2", "A3"])
def test_a2_and_a3_are_available(monkeypatch, emulator, soc):
    from hwkv_ascend.backend import AscendBackend

    monkeypatch.setitem(sys.modules, "torch_npu", emulator.make_module(soc_version=soc))
    assert AscendBackend.availability() == (True, "")
    assert AscendBackend().capabilities.extras["soc"] == {222: "A2", 252: "A3"}[soc]


def test_availability_checks_the_kv_write_schema(monkeypatch, emulator):
    """A 2.10-labelled build whose npu_scatter_pa_kv_cache lacks cache_mode (a pre-April-2026 op-plugin)."""
    from hwkv_ascend.backend import AscendBackend

    mod = emulator.make_module()
    mod.npu_scatter_pa_kv_cache = emulator.make_module(version="2.9.0").npu_scatter_pa_kv_cache
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    ok, reason = AscendBackend.availability()
    assert not ok
    assert reason.startswith("torch_npu 2.10.0+emulated: npu_scatter_pa_kv_cache has no 'cache_mode' argument "
                             "(its arguments are ['compress_lens', ")
    assert reason.endswith(FIX)


def test_availability_names_missing_ops(monkeypatch, emulator):
    from hwkv_ascend.backend import AscendBackend

    mod = emulator.make_module()
    del mod.npu_scatter_pa_kv_cache
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    ok, reason = AscendBackend.availability()
    assert not ok and "lacks npu_scatter_pa_kv_cache" in reason


def test_backend_on_emulator(npu):
    from hwkv_ascend.backend import AscendBackend

    b = AscendBackend()
    assert AscendBackend.availability() == (True, "")
    caps = b.capabilities
    assert caps.block_sizes == (128,) and caps.kv_layouts == (KVLayoutKind.SEPARATE_KV,)
    assert caps.dtypes == (torch.float16, torch.bfloat16)
    assert caps.transfer_protocols == () and "emulated" in caps.transfer_reason  # no HCCS on a CPU
    with pytest.raises(NotSupported, match="emulated"):
        b.create_transfer()
    assert b.device.dist_backend == "hccl" and b.device.name == "npu:0"
    assert "emulated" in b.device.description() and "A2" in b.device.description()
    free, total = b.device.memory_info()
    assert 0 < free <= total


def test_device_index_and_visible_devices(npu, monkeypatch):
    from hwkv_ascend.device import AscendDevice

    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "4,5")
    assert AscendDevice(0).physical_id == "4"
    with pytest.raises(ValueError, match=r"device index 1 out of range: 1 NPU\(s\) visible.*ASCEND_RT_VISIBLE_DEVICES"):
        AscendDevice(1)


def test_aligned_kv_allocation_and_block_copies(npu):
    from hwkv_ascend.backend import AscendBackend

    dev = AscendBackend(transfer=True).device
    spec = KVCacheSpec(2, 6, 128, 2, 64, torch.float16)
    cache = dev.allocate_kv_cache(spec, KVLayoutKind.SEPARATE_KV)
    assert len(cache.tensors) == 4
    assert all(t.data_ptr() % (2 << 20) == 0 and t.is_contiguous() and not bool(t.any()) for t in cache.tensors)
    for t in cache.tensors:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    host = dev.allocate_kv_cache(spec, KVLayoutKind.SEPARATE_KV, host=True)
    stream = dev.new_stream()
    dev.copy_blocks(cache, host, [(1, 0), (4, 5)], stream=stream)
    ev = dev.new_event()
    ev.record(stream)
    ev.synchronize()
    for s, h in zip(cache.tensors, host.tensors):
        assert torch.equal(h[0], s[1]) and torch.equal(h[5], s[4]) and not bool(h[1].any())
    seg = cache.segments([1, 2])
    assert seg[0].nbytes == 2 * 128 * 2 * 64 * 2  # two consecutive blocks merged into one segment
    assert dev.pinned_empty(64).numel() == 64
    with dev.stream_context(stream):
        dev.synchronize()


def test_pyproject_pins_the_same_torch_npu_range_and_entry_point():
    from pathlib import Path

    from hwkv_ascend import _npu

    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

    meta = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    assert meta["name"] == "hwkv-ascend"
    assert meta["entry-points"]["hwkv.backends"] == {"ascend": "hwkv_ascend.plugin"}
    assert meta["optional-dependencies"]["npu"] == [_npu.VERSION_RANGE.replace("torch_npu", "torch-npu")]
    assert meta["optional-dependencies"]["mooncake"] == ["mooncake-transfer-engine-npu"]
    assert not any("torch-npu" in d or "torch_npu" in d for d in meta["dependencies"])  # import-safe install


@pytest.mark.parametrize("with_cache_mode", [False, True])
def test_availability_reads_the_registered_op_schema(monkeypatch, emulator, with_cache_mode):
    """On hardware the schema comes from torch.ops.npu (the dispatcher), not a Python signature:
    register one there and check it wins over the emulated function's signature."""
    monkeypatch.setitem(sys.modules, "torch_npu", emulator.make_module())
    lib = torch.library.Library("npu", "FRAGMENT")
    try:
        lib.define("npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, Tensor(b!) value_cache, "
                   "Tensor slot_mapping, *, Tensor? compress_lens=None, Tensor? compress_seq_offsets=None, "
                   "Tensor? seq_lens=None" + (", str? cache_mode='PA_NZ'" if with_cache_mode else "") + ") -> ()")
        from hwkv_ascend.backend import AscendBackend

        ok, reason = AscendBackend.availability()
    finally:
        lib._destroy()
    if with_cache_mode:
        assert (ok, reason) == (True, "")
    else:
        assert not ok and "has no 'cache_mode' argument (its arguments are ['compress_lens'" in reason
