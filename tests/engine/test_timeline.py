"""hwkv.bench.timeline.graph_timeline's attribution, on a synthetic kernel trace (no GPU): each kernel is charged
with how far it moves the critical path's frontier, gaps are idle, replays are split at the host syncs, and the
first kernels are listed in launch order with the dense launches named by their place in a layer."""

from __future__ import annotations

import types

import torch

from hwkv.bench import timeline


def test_graph_timeline_charges_the_critical_path(monkeypatch):
    cuda = torch.autograd.DeviceType.CUDA
    events, t = [], 0.0
    for _ in range(3):  # three replays, 100 us apart (the host syncs)
        # (name, start offset, duration): dense launches overlap their predecessor by 1 us (PDL)
        for name, start, dur in (("embed", 0, 2), ("dense_kernel", 2, 5), ("attention_kernel", 6, 7),
                                 ("dense_kernel", 14, 4), ("argmax", 19, 1)):
            events.append(types.SimpleNamespace(name=name, device_type=cuda,
                                                time_range=types.SimpleNamespace(start=t + start, end=t + start + dur)))
        t += 120

    class Profile:
        def __init__(self, **kw):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def events(self):
            return events

    monkeypatch.setattr(torch.profiler, "profile", Profile)
    graph = types.SimpleNamespace(replay=lambda: None)
    graphs = types.SimpleNamespace(graph=lambda b, s: graph)
    device = types.SimpleNamespace(synchronize=lambda: None)
    engine = types.SimpleNamespace(runner=types.SimpleNamespace(graphs=graphs),
                                   backend=types.SimpleNamespace(device=device))
    got = timeline.graph_timeline(engine, batch=256, max_seq_len=640, reps=3)
    # idle: the gaps before the second dense launch and before argmax
    assert got["kernels"] == 5 and got["span_us"] == 20.0 and got["idle_us"] == 2.0
    # attention starts 1 us before the first dense launch ends: it is charged from that end on
    assert got["critical_us"] == {"attention_kernel": 6.0, "qkv": 5.0, "lm_head": 4.0, "embed": 2.0, "argmax": 1.0}
    assert got["first_kernels"] == [("embed", 2.0), ("qkv", 5.0), ("attention_kernel", 6.0), ("lm_head", 4.0),
                                    ("argmax", 1.0)]


def test_pass_gaps_counts_idle_between_overlapping_kernels():
    """pass_gaps: the busy union of overlapping kernels, idle = span - busy, gaps binned by size (a gap counts in
    every bin it reaches) and the largest named by the kernels around it; no kernel records gives {}."""
    cuda = torch.autograd.DeviceType.CUDA
    ev = lambda name, s, e: types.SimpleNamespace(name=name, device_type=cuda,
                                                  time_range=types.SimpleNamespace(start=s, end=e))
    # busy 0-10 (a and b overlap), gap 6 us, busy 16-20, gap 150 us, busy 170-171; a CPU event is ignored
    events = [ev("b", 4, 10), ev("a", 0, 8), ev("c", 16, 20), ev("d", 170, 171),
              types.SimpleNamespace(name="cpu", device_type=torch.autograd.DeviceType.CPU,
                                    time_range=types.SimpleNamespace(start=20, end=160))]
    prof = types.SimpleNamespace(events=lambda: events)
    g = timeline.pass_gaps(prof)
    assert (g["span_ms"], g["busy_ms"], g["idle_ms"], g["kernels"]) == (0.171, 0.015, 0.156, 4)
    assert g["gaps_by_size"][">=5us"] == dict(count=2, ms=0.156)
    assert g["gaps_by_size"][">=100us"] == dict(count=1, ms=0.15)
    assert g["gaps_by_size"][">=1000us"] == dict(count=0, ms=0.0)
    assert g["largest"][0] == dict(us=150.0, after="c", before="d")
    assert g["largest"][1] == dict(us=6.0, after="b", before="c")
    assert timeline.pass_gaps(types.SimpleNamespace(events=lambda: [])) == {}


def test_pin_decode_inputs_sets_the_graph_inputs_to_the_asked_lengths():
    """pin_decode_inputs: the decode graph's static inputs hold `batch` requests of `max_seq_len` keys over distinct
    blocks (in order, wrapping at the pool's size), no KV write, and the bucket's other rows padded as pad_into pads
    them; a runner without those buffers (or a bound past the static table) is left alone."""
    rows, mb, max_blocks = 3, 8, 6
    gr = types.SimpleNamespace(
        key=lambda n, s: (8, 1 << 20) if n <= 8 else None, q=1, block_size=16,
        seq_lens=torch.full((mb,), 99, dtype=torch.int32),
        block_tables=torch.full((mb, max_blocks), 7, dtype=torch.int32),
        d64=torch.full((rows, mb), 5, dtype=torch.int64), dg64=torch.zeros((0, mb), dtype=torch.int64),
        dg32=torch.zeros((0, mb, max_blocks), dtype=torch.int32))
    engine = types.SimpleNamespace(runner=types.SimpleNamespace(graphs=gr),
                                   kv_cache=types.SimpleNamespace(spec=types.SimpleNamespace(num_blocks=10)))
    assert timeline.pin_decode_inputs(engine, batch=6, max_seq_len=40)  # 3 blocks a request
    assert gr.seq_lens.tolist() == [40] * 6 + [1] * 2
    assert gr.block_tables[:6, :3].flatten().tolist() == [i % 10 for i in range(18)]
    assert gr.block_tables[6:, 0].tolist() == [0, 0] and gr.block_tables[0, 3:].tolist() == [7, 7, 7]
    assert gr.d64[0].tolist() == [0] * 8 and gr.d64[1].tolist() == [39] * 6 + [0] * 2
    assert gr.d64[2].tolist() == [-1] * 8
    assert not timeline.pin_decode_inputs(engine, batch=6, max_seq_len=16 * max_blocks + 1)  # wider than the table
    assert not timeline.pin_decode_inputs(engine, batch=9, max_seq_len=40)  # no graph serves it
    bare = types.SimpleNamespace(runner=types.SimpleNamespace(graphs=types.SimpleNamespace(graph=lambda b, s: None)))
    assert not timeline.pin_decode_inputs(bare, batch=1, max_seq_len=40)
