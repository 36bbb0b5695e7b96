"""Shared by the engine benches: the synthetic workload, the model directory, the backend lookup, copy
bandwidth, the result file."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import time
from pathlib import Path
from typing import Any


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs, both lengths uniform in ``[lo, hi]``."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
        for _ in range(n)
    ]


# The benches' "tiny" model: one shape for all of them, as they share its directory under --workdir.
TINY = dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
            max_position_embeddings=16384)


def model_dir(args: argparse.Namespace) -> Path:
    """``args.model`` as a checkpoint directory: a path as given, or a random-weight model of a shape of
    ``hwkv bench e2e`` (or ``"tiny"``: :data:`TINY`) written once per ``args.dtype`` under ``args.workdir``."""
    from hwkv.bench.e2e import SHAPES

    shapes = {**SHAPES, "tiny": TINY}
    if args.model not in shapes:
        return Path(args.model)
    import torch

    from hwkv.testing.tiny_models import write_tiny_model

    d = Path(args.workdir) / f"{args.model}-{args.dtype}"
    if not (d / "config.json").exists():
        write_tiny_model(d, dtype=getattr(torch, args.dtype), seed=0, tokenizer=False, **shapes[args.model])
    return d


def machine(**extra: Any) -> dict[str, Any]:
    """The host a CPU-side result was measured on (shared machines: the load average says how busy)."""
    import torch

    return {"platform": platform.platform(), **extra, "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "load_average_1m": os.getloadavg()[0]}


def write_result(out: Path, doc: dict[str, Any]) -> None:
    """Write a bench's JSON result (parents created) and say where."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {out}")


def backend(name: str) -> Any:
    """The registered backend ``name``; an unknown name says how to register a source checkout's."""
    from hwkv.plugins import get_backend

    try:
        return get_backend(name)
    except ValueError as e:
        raise ValueError(f"{e} (a backend run from a source checkout registers through "
                         f"HWKV_PLUGIN_MODULES, e.g. HWKV_PLUGIN_MODULES=hwkv_{name}.plugin)") from None


def copy_bandwidth(device: Any, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth of ``device`` (an hwkv Device) in bytes/s, counting bytes
    read plus bytes written; timed with the device's events."""
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device=device.torch_device).random_(0, 255)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    device.synchronize()
    s, e = device.new_event(enable_timing=True), device.new_event(enable_timing=True)
    times = []
    for _ in range(10):
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    return 2 * nbytes / times[len(times) // 2]


def decode_read_bytes(model: Any) -> int:
    """Weight bytes one decode step must read: every parameter except an untied embedding table, of
    which only the batch's rows are gathered (bandwidth accounting)."""
    emb = model.model.embed_tokens.weight
    untied = 0 if model.config.tie_word_embeddings else emb.numel() * emb.element_size()
    return model.param_bytes() - untied


def enable_weight_prefetch(engine: Any) -> None:
    """Experiment (measured slower on an H100): the plain forward asks the device to prefetch the next
    weights (``Device.prefetch``); decode graphs are captured again with the hints inside."""
    dev = engine.backend.device
    if not dev.supports_prefetch:
        raise ValueError(f"weight prefetch needs a device with prefetch; device {dev.name} has none")
    engine.model.set_prefetch(dev.prefetch, dev.join_prefetch)
    if engine.runner.graphs is not None:
        engine.runner.enable_graphs(engine.config.runtime.graph_max_batch)


def wait_http(proc: subprocess.Popen, url: str, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Poll ``url`` (GET) until it answers: True; False once ``proc`` has exited or ``timeout_s`` passed."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            httpx.get(url, timeout=1.0)
            return True
        except httpx.HTTPError:
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(poll_s)


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Terminate ``proc``, killing it if it outlives ``grace_s``; always reaped."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace_s)
