"""Shared by the engine benches: the synthetic workload, the backend lookup, copy bandwidth."""

from __future__ import annotations

import random
from typing import Any


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs, both lengths uniform in ``[lo, hi]``."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
        for _ in range(n)
    ]


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
