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
