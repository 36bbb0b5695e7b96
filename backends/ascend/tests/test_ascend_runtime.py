"""The engine's runtime on AscendDevice, through an emulated ``torch_npu.npu`` runtime (ACL graphs,
streams, events, memory): the calls vllm-ascend's ACL-graph capture makes — ``NPUGraph()``, captured
under ``torch.npu.graph(graph, pool=graph_pool_handle(), stream=...)``, then ``replay()`` — reach
torch_npu with the engine's arguments, and the engine's graph decode path served by AscendDevice
gives the eager path's greedy tokens. (Emulation on the CPU: no claim about NPU hardware.)"""

from __future__ import annotations

import contextlib

import pytest
import torch

from hwkv.model.tiny import write_tiny_model
from hwkv.reference.graphs import GraphCpuBackend, RecordedGraph
from hwkv.sampling_params import SamplingParams


class _Runtime:
    """Records the ACL-graph calls reaching the emulated ``torch_npu.npu`` (which captures them)."""

    def __init__(self) -> None:
        self.captures: list[tuple[RecordedGraph, object, object]] = []
        self.pools: list[object] = []
        self.emptied = 0

    def install(self, npu_ns) -> None:
        assert npu_ns.NPUGraph is RecordedGraph  # the emulator's graphs (npu_emulator_graph.py), recorded here
        self._graph = npu_ns.graph
        npu_ns.graph_pool_handle = self.graph_pool_handle
        npu_ns.graph = self.graph
        npu_ns.empty_cache = self.empty_cache

    def graph_pool_handle(self) -> object:
        self.pools.append(object())
        return self.pools[-1]

    @contextlib.contextmanager
    def graph(self, g: RecordedGraph, pool=None, stream=None):
        self.captures.append((g, pool, stream))
        with self._graph(g, pool=pool, stream=stream):
            yield

    def empty_cache(self) -> None:
        self.emptied += 1


@pytest.fixture
def runtime(npu):
    rt = _Runtime()
    rt.install(npu.npu)
    return rt


def test_device_graph_capture_uses_torch_npu_graphs(npu, runtime):
    from hwkv_ascend.device import AscendDevice

    dev = AscendDevice(0)
    a = torch.zeros(3)
    pool, stream = dev.graph_pool(), dev.new_stream()
    with torch.inference_mode():
        g, out = dev.capture_graph(lambda: a + 1, pool, stream)
        a.fill_(4)
        g.replay()
    assert out.tolist() == [5.0, 5.0, 5.0]
    assert runtime.captures == [(g, pool, stream)] and runtime.pools == [pool]
    ev = dev.new_event(enable_timing=True)
    ev.record()
    ev.synchronize()
    dev.empty_cache()
    assert runtime.emptied == 1
    host, done = dev.to_host_async(out)  # emulated: the "NPU" memory is the host's, no staging
    assert done is None and host.tolist() == out.tolist() and not dev.async_copies


class _AscendGraphBackend(GraphCpuBackend):
    """Graph-safe static attention on AscendDevice: every graph/stream/event call goes to torch_npu."""

    name = "ascend-graphs-emulated"

    def __init__(self) -> None:
        from hwkv_ascend.device import AscendDevice

        super().__init__()
        self._device = AscendDevice(0)


def test_engine_graph_decode_through_ascend_device(npu, runtime, tmp_path):
    import hwkv

    torch.set_num_threads(1)
    model = str(write_tiny_model(tmp_path / "m", arch="qwen2", max_position_embeddings=256))
    prompts = [[5, 9, 13, 2], list(range(20, 47)), [7], list(range(100, 111))]
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    kw = dict(num_kv_blocks=32, max_model_len=128, max_num_batched_tokens=64, max_num_seqs=4, fuse_elementwise=False)

    def run(**extra):
        e = hwkv.Engine(model, backend=_AscendGraphBackend(), **kw, **extra)
        out = [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)]
        assert e.kv_cache_manager.num_free_blocks == 32 and not e.runner.reqs
        return e, out

    _, want = run(enforce_eager=True)
    assert not runtime.captures
    e, got = run()
    assert got == want
    keys = sorted(e.runner.graphs.graphs)
    second = e.runner.graphs_b.graphs  # the second set of small decode graphs (pingpong), the same keys
    tail = e.runner.tail_graphs.graphs  # short-query steps' graphs (static attention captures them)
    assert [k[0] for k in keys] == [1, 2, 4] and sorted(second) == keys
    assert len(runtime.captures) == len(keys) + len(second) + len(tail)
    assert {id(p) for _, p, _ in runtime.captures} == {id(runtime.pools[0])}  # one pool shared by all graphs
    decode_replays = sum(g.replays for g, _, _ in [*e.runner.graphs.graphs.values(), *second.values()])
    assert decode_replays == e.runner.num_graph_steps > 5
    assert sum(g.replays for g, _, _ in runtime.captures) == decode_replays + e.runner.num_tail_graph_steps
