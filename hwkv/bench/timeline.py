"""Where a decode step's GPU time goes: a torch.profiler trace of CUDA-graph replays, attributed on
the critical path.

Kernels chained by programmatic dependent launch overlap (the next one starts during the previous
one's tail), so their durations do not add up to the step. Each kernel is charged instead with how
far it moves the frontier, ``end_i - max(end of all earlier kernels, start_i)``; time with no kernel
running is counted apart (``idle``): charges + idle = the replay's span.
"""

from __future__ import annotations

from typing import Any

FIRST_KERNELS = 32


def _label(names: list[str]) -> list[str]:
    # the decoder's dense launches carry one kernel name; their order in a layer names them
    order = ("qkv", "o_proj", "gate_up", "down")
    labels, i = [], 0
    for j, n in enumerate(names):
        if n.startswith("dense_kernel"):
            last = not any(m.startswith("dense_kernel") for m in names[j + 1:])
            labels.append("lm_head" if last else order[i % 4])
            i += 1
        else:
            labels.append(n[:60])
    return labels


def pin_decode_inputs(engine: Any, batch: int, max_seq_len: int) -> bool:
    """Set the static inputs of the decode graph that serves ``batch`` requests up to ``max_seq_len`` keys to exactly
    that: ``batch`` requests of ``max_seq_len`` keys each over distinct KV blocks (in order), no KV write (slot -1),
    the bucket's other rows padded as a real step pads them. Without it a replay runs over whatever the last step (or
    the capture) left in those buffers: a graph captured at a bound sizes its grid by the bound, but its kernels
    read each request's length from the static ``seq_lens`` (session 8 saw 51 µs for an attention layer of 256 x 544
    keys that the probes time at ~80-90 µs). False where the runner has no such buffers (nothing changed)."""
    import torch

    gr = getattr(engine.runner, "graphs", None)
    key = gr.key(batch, max_seq_len) if gr is not None and hasattr(gr, "key") else None
    if key is None or not hasattr(gr, "seq_lens") or not hasattr(gr, "block_tables"):
        return False
    b, q, bs = key[0], gr.q, gr.block_size
    w = -(-max_seq_len // bs)
    if w > gr.block_tables.shape[1]:
        return False
    n = min(batch, b)
    blocks = max(1, int(engine.kv_cache.spec.num_blocks))
    ids = (torch.arange(n * w, dtype=torch.int64, device=gr.block_tables.device) % blocks).to(torch.int32).view(n, w)
    gr.seq_lens[:n].fill_(max_seq_len)
    gr.seq_lens[n:b].fill_(q)
    gr.block_tables[:n, :w].copy_(ids)
    gr.block_tables[n:b, 0] = 0
    gr.d64[0, : b * q].zero_()
    gr.d64[1, : n * q].copy_(torch.arange(max_seq_len - q, max_seq_len, device=gr.d64.device).repeat(n))
    gr.d64[1, n * q: b * q].zero_()
    gr.d64[2, : b * q].fill_(-1)
    if len(getattr(gr, "dg64", ())):
        gr.dg64[:, : b * q].fill_(-1)
        gr.dg32[:, :n, :w].copy_(ids.expand(gr.dg32.shape[0], n, w))
        gr.dg32[:, n:b, 0] = 0
    return True


def graph_timeline(engine: Any, batch: int = 1, max_seq_len: int = 512, reps: int = 5) -> dict[str, Any]:
    """Critical-path µs per kernel label for one replay of the decode graph of ``batch`` (mean of
    ``reps``) over ``batch`` requests of ``max_seq_len`` keys (:func:`pin_decode_inputs`), its span, idle time and
    kernel count; ``{}`` without graphs or kernel records."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    r = engine.runner
    g = r.graphs.graph(batch, max_seq_len) if r.graphs is not None else None
    if g is None:
        return {}
    pinned = pin_decode_inputs(engine, batch, max_seq_len)
    sync = engine.backend.device.synchronize
    g.replay()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.replay()
            sync()  # separates the replays in the trace
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                      if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                      and "Memcpy" not in e.name and "Memset" not in e.name)
    if not kernels:
        return {}
    # split into replays at the host syncs: a gap much longer than any in-graph gap
    runs, cur = [], [kernels[0]]
    for k in kernels[1:]:
        if k[0] - max(c[1] for c in cur) > 20.0:
            runs.append(cur)
            cur = []
        cur.append(k)
    runs.append(cur)
    n = len(runs[-1])
    runs = [x for x in runs if len(x) == n]
    charge: dict[str, float] = {}
    seq = [0.0] * n  # critical-path us per kernel position (the same graph every run)
    idle = span = 0.0
    labels = _label([k[2] for k in runs[0]])
    for run in runs:
        frontier = run[0][0]
        for i, ((s, e, _), label) in enumerate(zip(run, labels)):
            idle += max(0.0, s - frontier)
            c = max(0.0, e - max(frontier, s))
            charge[label] = charge.get(label, 0.0) + c
            seq[i] += c
            frontier = max(frontier, e)
        span += frontier - run[0][0]
    k = len(runs)
    rows = sorted(((v / k, name) for name, v in charge.items()), reverse=True)
    # the first kernels in launch order (embedding, layer 0, the start of layer 1): where one layer's
    # time goes when several projections share a kernel name (cuBLAS at larger batches)
    first = [(labels[i][:48], round(seq[i] / k, 1)) for i in range(min(n, FIRST_KERNELS))]
    return dict(batch=batch, max_seq_len=max_seq_len, pinned=pinned, kernels=n, span_us=round(span / k, 1),
                idle_us=round(idle / k, 1), critical_us={name: round(v, 1) for v, name in rows}, first_kernels=first)


def pass_gaps(prof: Any, top: int = 8) -> dict[str, Any]:
    """GPU idle over a whole profiled pass (many steps): the kernels' busy union, the idle time between them by gap
    size, and the largest gaps with the kernels on either side - whether the GPU waits for the host between steps
    (async scheduling that does not overlap shows as one gap per step). ``{}`` without kernel records."""
    import torch

    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not ks:
        return {}
    edges = (5.0, 20.0, 100.0, 1000.0)  # µs
    hist = {f">={x:g}us": [0, 0.0] for x in edges}
    gaps, busy, frontier = [], 0.0, ks[0][0]
    prev = ks[0][2]
    for s, e, name in ks:
        if s > frontier:
            g = s - frontier
            gaps.append((g, prev[:40], name[:40]))
            for x in edges:
                if g >= x:
                    hist[f">={x:g}us"][0] += 1
                    hist[f">={x:g}us"][1] += g
        busy += max(0.0, e - max(frontier, s))
        if e > frontier:
            frontier, prev = e, name
    span = frontier - ks[0][0]
    gaps.sort(reverse=True)
    return dict(span_ms=round(span / 1e3, 3), busy_ms=round(busy / 1e3, 3), idle_ms=round((span - busy) / 1e3, 3),
                kernels=len(ks), gaps_by_size={k: dict(count=c, ms=round(t / 1e3, 3)) for k, (c, t) in hist.items()},
                largest=[dict(us=round(g, 1), after=a, before=b) for g, a, b in gaps[:top]])
