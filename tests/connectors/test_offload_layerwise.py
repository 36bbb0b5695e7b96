"""Layer-by-layer loads: a synchronous load is copied layer after layer and each layer's attention
waits only for its own layer's copies.

On the reference device a copy happens when it is issued, so wrong ordering could never show. The
device here defers every copy queued on a side stream until something waits for it (an event
recorded behind it is waited on, queried or synchronised), as a GPU's copy engine would still be
busy: a forward that read layer ``i`` before waiting for layer ``i``'s copies reads the zeros of a
freshly reset block and produces other tokens.
"""

from __future__ import annotations

from typing import Any

import pytest

from hwkv.connectors.offload import OffloadConnector
from hwkv.connectors.offload.worker import OffloadWorker
from hwkv.reference.backend import CpuBackend
from hwkv.reference.device import CpuDevice, CpuEvent, CpuStream

from .conftest import assert_no_leak, engine, run_one_by_one, settle, workload

MB = 1 << 20


class LazyStream(CpuStream):
    def __init__(self) -> None:
        self.queue: list[Any] = []  # copies not run yet
        self.done = 0  # how many ran

    def run_until(self, pos: int) -> None:
        while self.done < pos:
            self.queue[self.done]()
            self.done += 1

    def wait_event(self, event: CpuEvent) -> None:
        event.synchronize()

    def synchronize(self) -> None:
        self.run_until(len(self.queue))


class LazyEvent(CpuEvent):
    def __init__(self, enable_timing: bool = False) -> None:
        super().__init__(enable_timing)
        self.at = None

    def record(self, stream: Any = None) -> None:
        super().record(stream)
        self.at = (stream, len(stream.queue)) if isinstance(stream, LazyStream) else None

    def synchronize(self) -> None:
        if self.at is not None:
            self.at[0].run_until(self.at[1])

    def query(self) -> bool:
        self.synchronize()  # the copy engine finished by the time anyone looks
        return True


class LazyDevice(CpuDevice):
    """The reference device with copies on side streams deferred (module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.streams: list[LazyStream] = []
        self._default_stream = LazyStream()  # compute: runs at once, but its waits run the copies waited for

    def new_stream(self) -> LazyStream:
        s = LazyStream()
        self.streams.append(s)
        return s

    def new_event(self, enable_timing: bool = False) -> LazyEvent:
        return LazyEvent(enable_timing)

    def copy_blocks(self, src: Any, dst: Any, pairs: list[tuple[int, int]], stream: Any = None) -> None:
        if not isinstance(stream, LazyStream):
            return super().copy_blocks(src, dst, pairs, stream)
        self.check_copy(src, dst, pairs)
        stream.queue.append(lambda: CpuDevice.copy_blocks(self, src, dst, pairs))

    def synchronize(self) -> None:
        for s in self.streams:
            s.synchronize()


def lazy_engine(model_dir: str, **cfg: Any):
    backend = CpuBackend()
    backend._device = LazyDevice()
    # every run through copy_blocks (no memcpy path, which would copy at once)
    conn = OffloadConnector(cpu_bytes=MB, min_run_blocks=1 << 30, **cfg)
    return engine(model_dir, backend=backend, kv_connector=conn), conn


@pytest.fixture(scope="module")
def reference(model_dir):
    return run_one_by_one(engine(model_dir), workload())


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-load"])
def test_loads_are_waited_for_before_they_are_read(model_dir, reference, layerwise):
    e, conn = lazy_engine(model_dir, layerwise_load=layerwise)
    assert e.stats()["kv_connector"]["layerwise"] is layerwise
    waits: list[int] = []
    wait = conn.wait_for_layer_load
    conn.wait_for_layer_load = lambda i: (waits.append(i), wait(i))[1]  # type: ignore[method-assign]
    assert run_one_by_one(e, workload()) == reference
    st = e.stats()["kv_connector"]
    assert st["external_hit_tokens"] == 2 * 4 * 16 and st["load_failures"] == 0
    layers = e.kv_cache.spec.num_layers
    if layerwise:  # every forward waits once per layer, in order
        assert waits and waits == list(range(layers)) * (len(waits) // layers)
    else:
        assert not waits
    assert_no_leak(e)


def test_a_forward_that_skips_a_layer_wait_reads_unloaded_kv(model_dir, reference):
    """The emulation has teeth: without layer 1's wait the loaded prompts get other tokens."""
    e, conn = lazy_engine(model_dir)
    wait = conn.wait_for_layer_load
    conn.wait_for_layer_load = lambda i: None if i == 1 else wait(i)  # type: ignore[method-assign]
    got = run_one_by_one(e, workload())
    assert got[:3] == reference[:3]  # nothing loaded yet
    assert got[3] != reference[3] or got[5] != reference[5]
    settle(e)


class FailAtLayerWorker(OffloadWorker):
    fail_layer, failed = 0, False

    def load_blocks(self, host_ids, device_ids, layer=None):
        if layer == self.fail_layer and not self.failed:
            self.failed = True
            raise RuntimeError("injected failure at one layer")
        super().load_blocks(host_ids, device_ids, layer)


class FailAtLayer(OffloadConnector):
    """The first load fails to issue at ``layer`` (earlier layers' copies were already queued)."""

    worker_cls = FailAtLayerWorker

    def __init__(self, layer: int, **kw: Any):
        super().__init__(**kw)
        self.worker.fail_layer = layer


def test_load_failing_midway_through_the_layers_is_recomputed(model_dir, reference):
    backend = CpuBackend()
    backend._device = LazyDevice()
    conn = FailAtLayer(1, cpu_bytes=MB, min_run_blocks=1 << 30)
    e = engine(model_dir, backend=backend, kv_connector=conn)
    assert run_one_by_one(e, workload()) == reference
    st = e.stats()["kv_connector"]
    assert conn.worker.failed and st["load_failures"] == 1 and st["external_hit_tokens"] == 4 * 16
    assert_no_leak(e)


def test_layer_views_and_devices_without_graph_waits(model_dir):
    import torch

    from hwkv.interfaces.layout import KVCache, KVCacheSpec, KVLayoutKind

    spec = KVCacheSpec(3, 4, 2, 1, 2, torch.float32)
    for layout, per in ((KVLayoutKind.PER_LAYER, 1), (KVLayoutKind.SEPARATE_KV, 2)):
        kv = KVCache.allocate(spec, layout)
        one = kv.layer_cache(2)
        assert one.spec.num_layers == 1 and one.tensors == kv.tensors[2 * per:3 * per]
    assert KVCache.allocate(spec, KVLayoutKind.CROSS_LAYER).layer_cache(0) is None
    with pytest.raises(IndexError, match="layer 3 out of range"):
        kv.layer_cache(3)

    class NoGraphWaits(CpuDevice):
        def graph_event(self):
            return None  # a device whose graphs cannot wait on events

    backend = CpuBackend()
    backend._device = NoGraphWaits()
    e = engine(model_dir, backend=backend, kv_connector="offload", kv_connector_config={"cpu_bytes": MB})
    assert e.stats()["kv_connector"]["layerwise"] is False  # whole loads, waited for before the forward
    with pytest.raises(ValueError, match="layerwise_load must be a bool"):
        OffloadConnector(cpu_bytes=MB, layerwise_load="yes")  # type: ignore[arg-type]


def test_per_layer_waits_are_captured_only_in_the_graphs_of_loading_steps(tmp_path):
    """Emulated graphs (CPU): decode and short-query graphs are captured without the offload
    connector's per-layer waits (a captured wait costs every replay) and wait for all loads before
    each replay; a second set of short-query graphs carries one wait per layer and serves exactly the
    steps whose loads went out layer by layer (the tail a load feeds)."""
    import hwkv
    from hwkv.model.tiny import write_tiny_model
    from hwkv.reference.graphs import GraphCpuBackend, RecordingCpuDevice

    class Device(RecordingCpuDevice):
        def graph_event(self):  # events its graphs could wait on: the offload connector goes layerwise
            return self.new_event()

    class Logged(OffloadConnector):
        def __init__(self, **kw: Any):
            super().__init__(**kw)
            self.calls: list = []
            self.layered_steps = 0

        def wait_for_layer_load(self, layer: int) -> None:
            self.calls.append(layer)
            super().wait_for_layer_load(layer)

        def wait_for_all_layer_loads(self) -> None:
            self.calls.append("all")
            super().wait_for_all_layer_loads()

        def start_load_kv(self) -> None:
            super().start_load_kv()
            self.layered_steps += self.loads_layer_by_layer()

    model_dir = str(write_tiny_model(tmp_path / "llama", arch="llama", max_position_embeddings=256))
    backend = GraphCpuBackend()
    backend._device = Device()
    conn = Logged(cpu_bytes=MB)
    e = hwkv.Engine(model_dir, backend=backend, kv_connector=conn, num_kv_blocks=8, block_size=16,
                    max_model_len=128, fuse_elementwise=False)
    r = e.runner
    assert e.stats()["kv_connector"]["layerwise"] and r.loading_tail_graphs is not None
    assert r.graphs.hooks_left_out is conn and r.tail_graphs.hooks_left_out is conn
    assert r.loading_tail_graphs.hooks_left_out is None
    layers = e.kv_cache.spec.num_layers
    # capture: only the loading tail graphs' forwards called the per-layer waits (warm-up + capture)
    assert conn.calls == list(range(layers)) * (2 * len(r.loading_tail_graphs.graphs))
    conn.calls.clear()
    prompts = workload() + workload()[-1:]  # the last again: a device prefix hit, a tail with no load
    want = run_one_by_one(engine(model_dir), prompts)
    assert run_one_by_one(e, prompts) == want
    loading = sum(g.replays for g, _, _ in r.loading_tail_graphs.graphs.values())
    plain = sum(g.replays for g, _, _ in r.tail_graphs.graphs.values())
    decode = sum(g.replays for gr in (r.graphs, r.graphs_b) if gr is not None for g, _, _ in gr.graphs.values())
    assert conn.layered_steps == loading == 2 and plain > 0  # the two loads' tails, and other tails
    assert conn.calls.count("all") == decode + plain == r.num_graph_steps + r.num_tail_graph_steps - loading
    assert e.stats()["kv_connector"]["external_hit_tokens"] == 2 * 4 * 16
    assert_no_leak(e)


def test_layer_by_layer_plans_never_mix_up_two_loads(model_dir):
    """Each load is planned once for all its layers; a ``load_blocks`` override that hands fresh
    lists to ``super()`` (freed after each call, their ids reused by the next job's) must still
    copy every job's own blocks."""
    import torch

    class CopyingWorker(OffloadWorker):
        def load_blocks(self, host_ids, device_ids, layer=None):
            super().load_blocks(host_ids[:], device_ids[:], layer)

    class Copying(OffloadConnector):
        worker_cls = CopyingWorker

    conn = Copying(cpu_bytes=MB, min_run_blocks=1 << 30)
    e = engine(model_dir, kv_connector=conn)
    host, dev = conn.worker.host_kv, e.kv_cache
    for t in host.tensors:  # host block b of every tensor holds the value b
        t.copy_(torch.arange(t.shape[0], dtype=t.dtype).view(-1, *[1] * (t.dim() - 1)).expand_as(t))
    jobs = [([h], [d]) for h, d in zip(range(1, 8), range(7, 0, -1))]
    for layer in range(dev.spec.num_layers):  # one planning window: one step's start_load_kv
        for h, d in jobs:
            conn.worker.load_blocks(h, d, layer)
    conn.worker._plans.clear()
    for t in dev.tensors:
        assert [int(t[d[0]].flatten()[0]) for _, d in jobs] == [h[0] for h, _ in jobs]


def test_layerwise_loads_with_kv_cache_groups(hybrid_dir):
    """A hybrid model (two window-16 layers and a global one: two groups): each layer's copies are its
    group's blocks of the load, behind that layer's event; tokens equal the engine without a connector."""
    want = run_one_by_one(engine(hybrid_dir), workload())
    e, conn = lazy_engine(hybrid_dir, layerwise_load=True)
    assert [g.window for g in e.config.kv_groups] == [None, 16] and e.stats()["kv_connector"]["layerwise"]
    waits: list[int] = []
    wait = conn.wait_for_layer_load
    conn.wait_for_layer_load = lambda i: (waits.append(i), wait(i))[1]  # type: ignore[method-assign]
    assert run_one_by_one(e, workload()) == want
    st = e.stats()["kv_connector"]
    assert st["external_hit_tokens"] > 0 and st["load_failures"] == 0
    assert waits and waits == [0, 1, 2] * (len(waits) // 3)
    assert_no_leak(e)
