"""Where a rank's GPU time goes over a window of steps: torch.profiler (CUDA activity only), summed
by kernel and by kind.

Every rank profiles the same steps: the driver sends ``Profile(path)`` to the workers in the step
stream (so a worker starts and stops between the same ``Execute`` messages as the driver) and runs
:class:`KernelProfile` itself; each rank writes ``<path>.rank<r>.json``. A kernel's *critical* time
is how far it moves the rank's GPU frontier (``end - max(frontier, start)``: kernels that overlap,
as with programmatic dependent launch, are not counted twice); ``idle`` is the time in the window
with no kernel running (the host or a peer not keeping the GPU fed). Together they are the span.
"""

from __future__ import annotations

import json
from typing import Any

KINDS = (  # (kind, name fragments), first match wins; names lower-cased
    ("nccl", ("nccl",)),
    ("push_allreduce", ("push_all_reduce",)),
    ("gemm", ("dense_kernel", "gemm", "nvjet", "cutlass", "xmma", "matmul", "cublas", "splitk", "sm90_", "gemv")),
    ("attention", ("attention_kernel", "decode_heads_kernel", "reduce_kernel", "flash", "fmha", "attn")),
    ("kv_write", ("write_kv", "reshape_and_cache")),
    ("memcpy", ("memcpy", "memset")),
)


def kind_of(name: str) -> str:
    low = name.lower()
    return next((k for k, frags in KINDS if any(f in low for f in frags)), "other")


def summarize(kernels: list[tuple[float, float, str]], steps: int, top: int = 25) -> dict[str, Any]:
    """``kernels``: (start µs, end µs, name) of one rank's window of ``steps`` steps. Per step:
    span, busy, idle, critical µs per kind, and the top kernels by critical time (count per step,
    µs per call)."""
    kernels = sorted(kernels)
    steps = max(steps, 1)
    if not kernels:
        return {"steps": steps, "kernels": 0}
    kernels = _label_dense(kernels, steps)
    frontier = kernels[0][0]
    idle = 0.0
    crit: dict[str, float] = {}
    raw: dict[str, float] = {}
    count: dict[str, int] = {}
    for s, e, name in kernels:
        idle += max(0.0, s - frontier)
        c = max(0.0, e - max(frontier, s))
        frontier = max(frontier, e)
        crit[name] = crit.get(name, 0.0) + c
        raw[name] = raw.get(name, 0.0) + (e - s)
        count[name] = count.get(name, 0) + 1
    span = frontier - kernels[0][0]
    kinds: dict[str, dict[str, float]] = {}
    for name, c in crit.items():
        k = kinds.setdefault(kind_of(name), {"critical_us": 0.0, "raw_us": 0.0, "calls": 0})
        k["critical_us"] += c / steps
        k["raw_us"] += raw[name] / steps
        k["calls"] += count[name] / steps
    rows = sorted(crit.items(), key=lambda x: -x[1])[:top]
    return {
        "steps": steps, "kernels": len(kernels), "span_us_per_step": round(span / steps, 1),
        "busy_us_per_step": round((span - idle) / steps, 1), "idle_us_per_step": round(idle / steps, 1),
        "kinds": {k: {f: round(v, 1) for f, v in d.items()}
                  for k, d in sorted(kinds.items(), key=lambda x: -x[1]["critical_us"])},
        "top": [{"name": n[:90], "kind": kind_of(n), "calls_per_step": round(count[n] / steps, 2),
                 "us_per_call": round(raw[n] / count[n], 2), "critical_us_per_step": round(c / steps, 1)}
                for n, c in rows],
    }


DENSE = "dense_kernel"
DENSE_ORDER = ("qkv", "o_proj", "gate_up", "down")  # a decoder layer's fused GEMVs, in launch order


def _label_dense(kernels: list[tuple[float, float, str]], steps: int) -> list[tuple[float, float, str]]:
    """The fused decode GEMVs carry one kernel name (``dense_kernel``, or its persistent variant's
    ``dense_kernel_stream``); where every step launched the same number,
    ``4 x layers + 1`` (a decode step of a dense model: four per layer, the LM head last), their order
    names them (``dense_kernel:o_proj``, ...)."""
    count = sum(k[2].startswith(DENSE) for k in kernels)  # dense_kernel and its persistent dense_kernel_stream
    per = count // steps
    if per < 5 or count % steps or (per - 1) % 4:
        return kernels
    out, i = [], 0
    for s, e, name in kernels:
        if name.startswith(DENSE):
            j = i % per
            name = f"{DENSE}:{'lm_head' if j == per - 1 else DENSE_ORDER[j % 4]}"
            i += 1
        out.append((s, e, name))
    return out


def table(summary: dict[str, Any], title: str = "") -> str:
    """A compact text table of :func:`summarize`'s result."""
    s = summary
    host = "".join(f"\n  host {n[:50]:<50} {d['calls_per_step']:>6} calls {d['us_per_step']:>9} us"
                   for n, d in s.get("host_calls", {}).items())
    if not s.get("kernels"):
        return f"{title}: no kernels recorded{host}"
    lines = [f"{title}: {s['steps']} steps, per step: span {s['span_us_per_step']} us, busy {s['busy_us_per_step']}"
             f" us, idle {s['idle_us_per_step']} us"]
    lines.append(f"  {'kind':<16}{'critical us':>12}{'raw us':>10}{'calls':>8}")
    for k, d in s["kinds"].items():
        lines.append(f"  {k:<16}{d['critical_us']:>12.1f}{d['raw_us']:>10.1f}{d['calls']:>8.1f}")
    lines.append(f"  {'kernel':<60}{'kind':>15}{'calls':>7}{'us/call':>9}{'crit us':>9}")
    for r in s["top"][:15]:
        lines.append(f"  {r['name'][:60]:<60}{r['kind']:>15}{r['calls_per_step']:>7}{r['us_per_call']:>9}"
                     f"{r['critical_us_per_step']:>9}")
    return "\n".join(lines) + host


class KernelProfile:
    """torch.profiler over a window of steps on this rank (start ... stop). ``device`` is the backend's
    Device: it is synchronised before the profiler stops, so the window's last kernels are in it."""

    def __init__(self, device: Any) -> None:
        self._device = device
        self._prof: Any = None

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile, supported_activities

        # the accelerator's activity (its kernels and its runtime's host calls) where torch has one; the
        # host's ops otherwise (tests) - tracing both would add the host ops' overhead to the window
        acc = [a for a in supported_activities() if a != ProfilerActivity.CPU]
        self._prof = profile(activities=acc or [ProfilerActivity.CPU])
        self._prof.start()

    def stop(self, steps: int) -> dict[str, Any]:
        import torch

        prof, self._prof = self._prof, None
        if prof is None:
            return {"steps": steps, "kernels": 0}
        self._device.synchronize()
        prof.stop()
        kernels, host = [], {}
        on_host = torch.autograd.DeviceType.CPU
        for e in prof.events():
            if e.device_type != on_host:  # a kernel on the accelerator
                if e.time_range.end > e.time_range.start:
                    kernels.append((e.time_range.start, e.time_range.end, e.name))
            else:  # the runtime's host calls (launches, syncs)
                d = host.setdefault(e.name, [0, 0.0])
                d[0] += 1
                d[1] += e.time_range.end - e.time_range.start
        out = summarize(kernels, steps)
        k = max(steps, 1)
        out["host_calls"] = {n: {"calls_per_step": round(c / k, 2), "us_per_step": round(t / k, 1)}
                             for n, (c, t) in sorted(host.items(), key=lambda x: -x[1][1])[:8]}
        return out


def write(path: str, rank: int, summary: dict[str, Any]) -> str:
    out = f"{path}.rank{rank}.json"
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
    return out
