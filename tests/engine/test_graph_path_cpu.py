"""The engine's graph decode path through the Device interface, on the CPU: a backend declaring
``graph_capture`` (emulated graphs, :mod:`hwkv.reference.graphs`) gets captured decode graphs and async
scheduling, and replays give the eager path's greedy tokens. Also: the runtime stays hardware-neutral."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import hwkv
from hwkv.interfaces.backend import NotSupported
from hwkv.model.tiny import write_tiny_model
from hwkv.reference.device import CpuDevice
from hwkv.reference.graphs import GraphCaptureError, GraphCpuBackend, capture
from hwkv.sampling_params import SamplingParams

ROOT = Path(hwkv.__file__).resolve().parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("g") / "llama", arch="llama", max_position_embeddings=256))


def _run(model_dir, **kw):
    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 500, (int(n),), generator=rng).tolist() for n in (5, 17, 2, 30, 9, 12, 3)]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 4 * i, ignore_eos=True) for i in range(len(prompts))]
    e = hwkv.Engine(model_dir, backend=GraphCpuBackend(), num_kv_blocks=64, max_model_len=128,
                    max_num_batched_tokens=64, max_num_seqs=8, fuse_elementwise=False, **kw)
    out = [o.token_ids for o in e.generate(prompts, params, use_tqdm=False)]
    assert e.kv_cache_manager.num_free_blocks == 64 and not e.runner.reqs
    return e, out


def test_declared_graph_capture_turns_on_graphs_and_replays_match_eager(model_dir):
    torch.set_num_threads(1)
    eager, want = _run(model_dir, enforce_eager=True)
    assert eager.runner.graphs is None and not eager.async_scheduling
    e, got = _run(model_dir)
    g = e.runner.graphs
    assert g is not None and g.use_graphs and e.async_scheduling  # from the capability, not a device type
    assert sorted({b for b, _ in g.graphs}) == [1, 2, 4, 8]
    assert got == want
    replays = sum(gr.replays for gr in e.backend.device.captured)
    b = e.runner.graphs_b  # the second set of small decode graphs (pingpong): every other steady step
    assert b is not None and sorted({k for k, _ in b.graphs}) == [1, 2, 4, 8] and b.feeds is g and g.feeds is b
    decode_replays = sum(gr.replays for gr, _, _ in [*g.graphs.values(), *b.graphs.values()])
    assert decode_replays == e.runner.num_graph_steps > 10 and sum(gr.replays for gr, _, _ in b.graphs.values()) > 3
    assert replays == decode_replays + e.runner.num_tail_graph_steps  # the rest: short-query steps' graphs


def test_packed_block_tables_give_the_same_tokens(model_dir, monkeypatch):
    """Steps whose block tables are copied packed (only the columns the step's requests use; the
    default for wide tables: graph_runner.COMPACT_MIN) replay to the full-row copies' tokens."""
    from hwkv.engine import graph_runner

    torch.set_num_threads(1)
    _, want = _run(model_dir)
    monkeypatch.setattr(graph_runner, "COMPACT_MIN", -1)  # every graph step packed
    e, got = _run(model_dir)
    assert got == want and e.runner.num_graph_steps > 10


def test_sliced_id_rows_give_the_same_tokens(model_dir, monkeypatch):
    """Steps whose ids / positions / slots go over as the step's columns only (wide rows: above
    graph_runner.IDS_WHOLE_BYTES) replay to the whole-row copies' tokens (the default for small rows)."""
    from hwkv.engine import graph_runner

    torch.set_num_threads(1)
    _, want = _run(model_dir)
    monkeypatch.setattr(graph_runner, "IDS_WHOLE_BYTES", -1)  # every graph step sliced
    e, got = _run(model_dir)
    assert got == want and e.runner.num_graph_steps > 10


def _outs(e, prompts, params):
    return [(o.token_ids, o.finish_reason, o.stop_reason, o.text) for o in e.generate(prompts, params, use_tqdm=False)]


def test_greedy_tokens_from_the_graph_feed_the_next_step(model_dir):
    """Small decode graphs take the greedy argmax and write it into their ids row (graph_runner's module doc): a plain
    greedy batch's tokens come from the graph, and a steady step (same rows, same order) copies no ids in - the eager
    engine's tokens, finish reasons and texts, also where stop tokens, stop strings and max_tokens end requests
    between steps (one at batch 1)."""
    torch.set_num_threads(1)
    make = lambda **kw: hwkv.Engine(model_dir, backend=GraphCpuBackend(), num_kv_blocks=64, max_model_len=128,  # noqa: E731
                                    max_num_batched_tokens=64, max_num_seqs=8, fuse_elementwise=False, **kw)
    rng = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 500, (int(n),), generator=rng).tolist() for n in (7, 3, 21, 12)]
    base = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)] * 4
    first = _outs(make(enforce_eager=True), prompts, base)
    params = [SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop_token_ids=[first[0][0][9]]),
              SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[first[1][3][6:9]]),
              SamplingParams(temperature=0.0, max_tokens=17, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=30)]
    want = _outs(make(enforce_eager=True), prompts, params)
    assert want[0][1] == want[1][1] == "stop" and want[2][1] == "length"
    e = make()
    assert _outs(e, prompts, params) == want
    r = e.runner
    sets = (r.graphs, r.graphs_b)  # pingpong: the two sets take turns
    ready = lambda: sum(g.num_ids_ready for g in sets)  # noqa: E731
    side = lambda: sum(g.num_side_copies for g in sets)  # noqa: E731
    assert r.num_graph_sampled_steps == r.num_graph_steps > 20 and ready() > 15 and side() > 15
    one = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[first[2][0][25]])]
    n0, s0 = ready(), side()
    assert _outs(e, prompts[2:3], one) == _outs(make(enforce_eager=True), prompts[2:3], one)
    assert ready() - n0 >= 20 and side() - s0 == ready() - n0  # batch 1: every decode step after the first two


def test_graph_greedy_tokens_through_preemption_and_abort(model_dir):
    """Preemptions (a small KV pool) and an abort while a step is in flight change the rows between two steps of the
    graph path: every step after such a change copies its ids in, and the tokens stay the eager engine's."""
    torch.set_num_threads(1)
    kw = dict(backend=GraphCpuBackend(), num_kv_blocks=14, block_size=16, max_model_len=128, max_num_batched_tokens=64,
              max_num_seqs=6, fuse_elementwise=False)
    rng = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 500, (int(n),), generator=rng).tolist() for n in (20, 9, 30, 14, 3, 25)]
    params = [SamplingParams(temperature=0.0, max_tokens=20 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    want = _outs(hwkv.Engine(model_dir, enforce_eager=True, **kw), prompts, params)
    e = hwkv.Engine(model_dir, **kw)
    assert _outs(e, prompts, params) == want and e.scheduler.num_preemptions > 0
    r = e.runner
    assert r.num_graph_sampled_steps > 10 and r.graphs.num_ids_ready + r.graphs_b.num_ids_ready > 5
    for i, (p, sp) in enumerate(zip(prompts, params)):  # an abort lands while the next step is already launched
        e.add_request(f"a{i}", p, sp)
    got: dict[str, list[int]] = {}
    for step in range(400):
        for o in e.step():
            got[o.request_id] = list(o.token_ids)
        if step == 12:
            e.abort("a2")
        if not e.has_unfinished():
            break
    assert not e.has_unfinished() and not r.reqs
    for i, w in enumerate(want):
        if i != 2:
            assert got[f"a{i}"] == w[0], i


def test_a_non_greedy_request_keeps_the_sampler_outside_the_graph(model_dir):
    """While a request with penalties (or sampling) is held, no step takes the graph's argmax (the sampler runs on
    the logits for every row); greedy rows get the eager engine's tokens either way."""
    torch.set_num_threads(1)
    make = lambda **kw: hwkv.Engine(model_dir, backend=GraphCpuBackend(), num_kv_blocks=64, max_model_len=128,  # noqa: E731
                                    max_num_batched_tokens=64, max_num_seqs=8, fuse_elementwise=False, **kw)
    rng = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 500, (int(n),), generator=rng).tolist() for n in (9, 4, 15)]
    params = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, repetition_penalty=1.5),
              SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)]
    want = _outs(make(enforce_eager=True), prompts, params)
    e = make()
    assert _outs(e, prompts, params) == want
    r = e.runner
    assert 0 < r.num_graph_sampled_steps < r.num_graph_steps  # after the penalised request finished only
    e2 = make()
    assert _outs(e2, prompts[1:2], params[1:2]) == want[1:2]
    assert e2.runner.num_graph_sampled_steps == 0
    assert e2.runner.graphs.num_ids_ready == e2.runner.graphs_b.num_ids_ready == 0


def test_only_a_per_layer_host_connector_keeps_graphs_off(model_dir):
    from hwkv.interfaces.connector import KVConnectorBase

    class Layerwise(KVConnectorBase):
        layerwise = True

    class CapturableLayerwise(Layerwise):
        capturable_layer_hooks = True

    def make(conn):
        return hwkv.Engine(model_dir, backend=GraphCpuBackend(), num_kv_blocks=16, kv_connector=conn,
                           fuse_elementwise=False)

    e = make(Layerwise())
    assert e.runner.graphs is None and not e.async_scheduling
    for conn in (KVConnectorBase(), CapturableLayerwise()):  # nothing per layer, or device work only
        e = make(conn)
        assert e.runner.graphs is not None and e.async_scheduling


def test_recorded_graph_semantics():
    a, b = torch.zeros(4), torch.ones(4)
    with torch.inference_mode():
        g, out = capture(lambda: (a * 2 + b).view(2, 2).sum(0))
        a.fill_(3)
        g.replay()
        assert out.tolist() == [14.0, 14.0]  # the current inputs, into the captured output
        with pytest.raises(GraphCaptureError, match="host synchronisation"):
            capture(lambda: int(a.sum()))


def test_host_device_defaults():
    dev = CpuDevice()
    t = torch.arange(5)
    assert dev.to_device(t) is t  # the host is the device: zero-copy
    host, ev = dev.to_host_async(t)
    assert ev is None and host.tolist() == t.tolist() and host is not t  # a copy: t may be a graph's static output
    assert not dev.host_empty((2, 3), torch.int32).is_pinned()
    with pytest.raises(NotSupported, match="graph_capture"):
        dev.capture_graph(lambda: t, dev.graph_pool, dev.current_stream())
    with pytest.raises(NotSupported, match="graph_capture"):
        dev.graph_pool()


def test_runtime_speaks_only_to_interfaces():
    """No vendor runtime and no device-type branches in the shared core, engine and model: they reach
    the accelerator through Device (graphs, streams, events, staging) and Capabilities."""
    bad = re.compile(r"torch\.(cuda|npu)\b|\.type\s*[!=]=\s*['\"]|['\"](cuda|npu)['\"]|\.is_cuda\b|import\s+torch_npu")
    hits = [f"{p.relative_to(ROOT.parent)}:{i}: {line.strip()}"
            for d in ("core", "engine", "model") for p in sorted((ROOT / d).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert not hits, "\n".join(hits)
