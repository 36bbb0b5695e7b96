"""Reporting for `hwkv bench e2e`: per-phase step profile, kernel mix of a decode step, Markdown."""

from __future__ import annotations

import time
from typing import Any

from hwkv.bench.common import workload

# (object attribute path from the engine, method, phase): each phase's time is exclusive of the
# phases it calls, so the phases and "other" add up to the step's wall time
PHASES = (("scheduler", "schedule", "schedule"), ("runner", "update_states", "runner_states"),
          ("runner", "build_inputs", "prep_inputs"), ("runner", "device_inputs", "prep_inputs"),
          ("runner", "_forward", "eager_forward"), ("runner", "_sample", "sample"),
          ("runner", "_resolve", "read_tokens"), ("scheduler", "update_from_output", "update"),
          ("_stats", "record_step", "stats"), ("", "_apply", "outputs"), ("runner.graphs", "run", "graph_copy_replay"),
          ("runner.graphs_b", "run", "graph_copy_replay"))  # the second set of small decode graphs (pingpong)


def timed_phases(engine: Any, acc: dict[str, float], clock: Any = time.perf_counter) -> list[tuple[Any, str]]:
    """Wrap the engine's host-path methods so ``acc[phase]`` accumulates seconds spent in each,
    exclusive of nested phases; returns what to pass to :func:`untime`."""
    stack: list[float] = []  # time nested phases took inside the running one
    wrapped = []
    targets = []
    for path, name, key in PHASES:
        obj = engine
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part, None)
        targets.append((obj, name, key))
    for g in (engine.runner.graphs, getattr(engine.runner, "graphs_b", None)):
        if g is not None:  # inside graph_copy_replay: the wait for the staging buffers, the graph launch call
            targets.append((g._copied, "synchronize", "graph_staging_wait"))
            targets += [(entry[0], "replay", "graph_launch") for entry in g.graphs.values()]
    for obj, name, key in targets:
        fn = getattr(obj, name, None) if obj is not None else None
        if fn is None:
            continue

        def wrapper(*a: Any, _fn: Any = fn, _key: str = key, **k: Any) -> Any:
            t = clock()
            stack.append(0.0)
            try:
                return _fn(*a, **k)
            finally:
                dt = clock() - t
                inner = stack.pop()
                acc[_key] = acc.get(_key, 0.0) + dt - inner
                if stack:
                    stack[-1] += dt
        try:
            setattr(obj, name, wrapper)
        except (AttributeError, TypeError):  # an object without a __dict__: not timed apart
            continue
        wrapped.append((obj, name))
    return wrapped


def untime(wrapped: list[tuple[Any, str]]) -> None:
    for obj, name in wrapped:
        obj.__dict__.pop(name, None)


def profile(engine: Any, vocab: int, batch: int, steps: int = 64, prompt_len: int = 128,
            gpu: bool = True, clock: Any = time.perf_counter) -> dict[str, Any]:
    """Mean wall ms per decode step by phase (:data:`PHASES`, exclusive times; "other" is the
    rest of ``engine.step()``), plus GPU-only graph replay time for this batch (``gpu``).
    ``read_tokens`` is the time spent waiting for a step's sampled tokens: with async stepping the
    GPU runs the next step meanwhile, so the phases add up to the step time only when it is 0.
    ``clock``: ``time.process_time`` measures host CPU time (a shared machine's stalls left out)."""
    from hwkv.sampling_params import SamplingParams

    r = engine.runner
    acc: dict[str, float] = {}
    work = workload(batch, prompt_len, prompt_len, vocab, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    for i, (p, _) in enumerate(work):
        engine.add_request(f"prof{i}", p, params)
    while len(r.reqs) < batch or not all(st.output_token_ids for st in r.reqs.values()):
        engine.step()  # prefills (maybe chunked) until every request decodes
    wrapped = timed_phases(engine, acc, clock)
    try:
        t0 = clock()
        for _ in range(steps):
            engine.step()
        wall = (clock() - t0) / steps
    finally:
        untime(wrapped)
    while engine.has_unfinished():
        engine.step()
    out: dict[str, Any] = {k: v / steps * 1e3 for k, v in acc.items()}
    out["step_wall"] = wall * 1e3
    out["other (engine.step rest)"] = wall * 1e3 - sum(v / steps * 1e3 for v in acc.values())
    gpu_ms = replay_ms(engine, batch, prompt_len + steps) if gpu else None
    if gpu_ms is not None:
        out["gpu_replay"] = gpu_ms
        out["wall_over_gpu"] = wall * 1e3 / gpu_ms
    return {k: round(v, 4) for k, v in out.items()}


def replay_ms(engine: Any, batch: int, max_seq_len: int, reps: int = 20) -> float | None:
    """GPU ms of one replay of the decode graph serving ``batch`` requests up to ``max_seq_len``
    (its inputs pinned to ``batch`` requests of ``max_seq_len`` keys: :func:`hwkv.bench.timeline.pin_decode_inputs`;
    before session 9, as the last step left them), or ``None`` without such a graph."""
    from hwkv.bench.timeline import pin_decode_inputs

    r, dev = engine.runner, engine.backend.device
    g = r.graphs.graph(batch, max_seq_len) if r.graphs is not None else None
    if g is None:
        return None
    pin_decode_inputs(engine, batch, max_seq_len)
    s, e = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
    g.replay()
    s.record()
    for _ in range(reps):
        g.replay()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) / reps


def kernel_mix(engine: Any, top: int = 12) -> dict[str, Any]:
    """CUDA kernels of one eager batch-1 decode forward (static buffers, torch.profiler)."""
    import torch
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as tprof

    g = engine.runner.graphs
    if g is None:
        return {}
    md = g._metadata(1, torch.full((1,), 512, dtype=torch.int32))
    g.seq_lens[:1].fill_(512)
    g.d64[2, :1].fill_(-1)  # write no KV
    with torch.inference_mode():
        g._forward(1, md)
        engine.backend.device.synchronize()
        with tprof(activities=[ProfilerActivity.CUDA]) as prof:
            g._forward(1, md)
            engine.backend.device.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and ev.count:
            rows.append((t, ev.count, ev.key))
    rows.sort(reverse=True)
    total = sum(t for t, _, _ in rows)
    return dict(total_us=round(total, 1), launches=sum(c for _, c, _ in rows),
                top=[dict(us=round(t, 1), count=c, name=k[:90]) for t, c, k in rows[:top]])


def markdown(res: dict[str, Any]) -> str:
    def f(x: Any, d: int = 1) -> str:
        return f"{x:,.{d}f}" if isinstance(x, (int, float)) else "—"

    lines = [f"# hwkv bench e2e — {res['model']} ({res['dtype']}) on {res['device']}, {res['date']}", "",
             f"Command: `{res['command']}`  ", f"torch {res['torch']}, transformers {res.get('transformers')}, "
             f"copy BW {f(res.get('copy_bw_TBps'), 2)} TB/s (read+write)  ",
             f"Engine arguments: {res.get('engine') or 'none (the public defaults)'}; resolved "
             f"{res.get('resolved', '—')}", "",
             "| workload | hwkv | HF generate | ratio |", "| --- | --- | --- | --- |"]
    t = res.get("throughput", {})
    if t:
        hf = t.get("hf", {})
        hits = t.get("timed_prefix_cache_hits")
        rf = t.get("roofline_fraction")
        lines.append(f"| (a) offline {t['hwkv']['requests']} req, in/out U[{res['min_len']},{res['max_len']}], "
                     f"output tok/s (prefix-cache hits in the timed pass: {f(hits, 0)}; "
                     f"{f(100 * rf if rf else None)}% of the roofline at the mean lengths) | "
                     f"{f(t['hwkv']['tok_per_s'])} "
                     f"| {f(hf.get('tok_per_s'))} "
                     f"({hf.get('requests', '—')} req, batch {hf.get('batch', '—')}) | {f(t.get('ratio'))}× |")
    r = res.get("roofline", {})
    if r:
        hf, roof = r.get("hf", {}), r["roofline"]
        lines.append(f"| (r) offline {r['workload']}, output tok/s (roofline {f(roof['tok_per_s'])}: prefill "
                     f"{f(roof['prefill_s'] * 1e3)} ms + decode {f(roof['decode_s'] * 1e3)} ms at "
                     f"{f(roof['copy_bw_TBps'], 2)} TB/s, {f(roof['matmul_TFLOPs'])} TFLOP/s; hwkv "
                     f"{f(100 * r['efficiency'])}% of it) | {f(r['hwkv']['tok_per_s'])} | {f(hf.get('tok_per_s'))} "
                     f"({hf.get('requests', '—')} req, batch {hf.get('batch', '—')}) | {f(r.get('ratio'))}× |")
    b = res.get("batch1", {})
    if b:
        mode = ("default: graphs + fused decode ops + async scheduling" if res.get("graph_buckets")
                else "default: no graph capture")
        lines.append(f"| (b) batch-1 decode tok/s ({mode}) | {f(b.get('tok_per_s'))} "
                     f"(step {f(b.get('step_ms'), 3)} ms, GPU replay of the last graph "
                     f"{f(b.get('gpu_replay_ms_last'), 3)} ms, "
                     f"MBU {f(100 * b['mbu'] if 'mbu' in b else None)}%) | {f(b.get('hf_tok_per_s'))} | "
                     f"{f(b['tok_per_s'] / b['hf_tok_per_s'] if b.get('hf_tok_per_s') else None)}× |")
        e = b.get("eager", {})
        if e:
            lines.append(f"| (b) batch-1 decode tok/s (eager) | {f(e.get('tok_per_s'))} (MBU "
                         f"{f(100 * e['mbu'] if 'mbu' in e else None)}%) | | |")
    variants = [(f"default, {k}", v) for k, v in res.get("batch1_variants", {}).items()]
    for label, bf in variants + [("graphs, elementwise ops not fused", res.get("batch1_graphs_unfused"))]:
        if bf:
            lines.append(f"| (b) batch-1 decode tok/s ({label}) | {f(bf.get('tok_per_s'))} (step "
                         f"{f(bf.get('step_ms'), 3)} ms, MBU {f(100 * bf['mbu'] if 'mbu' in bf else None)}%) | | |")
    c = res.get("shared_prefix", {})
    if c:
        on, off = c.get("prefix_on", {}), c.get("prefix_off", {})
        for name, key, scale, unit in (("mean TTFT", "mean_ttft_s", 1e3, "ms"), ("p50 TTFT", "p50_ttft_s", 1e3, "ms"),
                                       ("output tok/s", "tok_per_s", 1, "")):
            lines.append(f"| (c) {c.get('workload', '')}: {name} {unit}, prefix cache on / off | "
                         f"{f(on.get(key, 0) * scale)} / {f(off.get(key, 0) * scale)} | | |")
    for title, key in (("Profile", "profile"),):
        for k, v in res.get(key, {}).items():
            lines += ["", f"{title}, {k} (ms per decode step): " + ", ".join(f"{n} {f(x, 3)}" for n, x in v.items())]
    km = res.get("kernel_mix")
    if km:
        lines += ["", f"Eager batch-1 decode forward: {km['launches']} kernels, {f(km['total_us'])} µs GPU; top: "
                  + "; ".join(f"{r['name']} ×{r['count']} {f(r['us'])} µs" for r in km["top"][:6])]
    tl = res.get("graph_timeline")
    if tl:
        lines += ["", f"Batch-1 graph replay (ctx bucket {tl['max_seq_len']}): {tl['kernels']} kernels, span "
                  f"{f(tl['span_us'])} µs, idle {f(tl['idle_us'])} µs; critical path by kernel (µs): "
                  + "; ".join(f"{k} {f(v)}" for k, v in tl["critical_us"].items())]
    for k in ("errors",):
        if res.get(k):
            lines += ["", f"Errors: {res[k]}"]
    return "\n".join(lines) + "\n"
