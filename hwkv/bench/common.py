"""Shared by the engine benches: the synthetic workload, the model directory, the backend lookup, the
offload bench's engine, freeing an engine's device memory, copy bandwidth, the result file."""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hwkv
from hwkv.bench import results_dir


def workload(n: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs, both lengths uniform in ``[lo, hi]``."""
    rng = random.Random(seed)
    return [
        ([rng.randrange(100, vocab - 100) for _ in range(rng.randint(lo, hi))], rng.randint(lo, hi))
        for _ in range(n)
    ]


# Realistic model shapes the benches write random-weight checkpoints of (``--model NAME``).
SHAPES: dict[str, dict[str, Any]] = {
    # Llama-3.2-1B: 16 layers, hidden 2048, 32 q / 8 kv heads, head 64, ffn 8192, vocab 128256, tied.
    "llama-1b": dict(arch="llama", hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                     intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, max_position_embeddings=131072),
    # Llama-3-8B: 32 layers, hidden 4096, 32 q / 8 kv heads, head 128, ffn 14336, vocab 128256, untied.
    "llama-8b": dict(arch="llama", hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8,
                     intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                     rope_theta=500000.0, max_position_embeddings=8192),
    # One rank of Llama-3-8B at tp=2 as a model of its own: 16 q / 4 kv heads of 128, ffn 7168, vocab 64128. At tp=1
    # its decode GEMVs are a tp=2 rank's (qkv 3072 x 4096, o_proj 4096 x 2048, gate_up 14336 x 4096, down 4096 x 7168,
    # LM head 64128 x 4096) and so is its attention, without the all-reduces: per-rank tile A/Bs on one GPU.
    "llama-8b-tp2-rank": dict(arch="llama", hidden_size=4096, num_layers=32, num_heads=16, num_kv_heads=4,
                              head_dim=128, intermediate_size=7168, vocab_size=64128, tie_word_embeddings=False,
                              rope_theta=500000.0, max_position_embeddings=8192),
    # Qwen2.5-0.5B: 24 layers, hidden 896, 14 q / 2 kv heads, head 64, ffn 4864, vocab 151936, tied.
    "qwen-0.5b": dict(arch="qwen2", hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                      intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True,
                      rope_theta=1000000.0, max_position_embeddings=32768),
    # SmolLM2-135M: 30 layers, hidden 576, 9 q / 3 kv heads, head 64, ffn 1536, vocab 49152, tied.
    "smollm2-135m": dict(arch="llama", hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True,
                         rope_theta=100000.0, max_position_embeddings=8192),
}


# The benches' "tiny" model: one shape for all of them, as they share its directory under --workdir.
TINY = dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, vocab_size=512,
            max_position_embeddings=16384)


def model_dir(args: argparse.Namespace) -> Path:
    """``args.model`` as a checkpoint directory: a path as given, or a random-weight model of a shape of
    ``hwkv bench e2e`` (or ``"tiny"``: :data:`TINY`) written once per ``args.dtype`` under ``args.workdir``."""
    shapes = {**SHAPES, "tiny": TINY}
    if args.model not in shapes:
        return Path(args.model)
    import torch

    from hwkv.model.tiny import write_tiny_model

    d = Path(args.workdir) / f"{args.model}-{args.dtype}"
    if not (d / "config.json").exists():
        # weights drawn on the GPU where there is one (an 8B shape: seconds, not minutes of CPU randn)
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        write_tiny_model(d, dtype=getattr(torch, args.dtype), seed=0, tokenizer=False, device=dev,
                         num_shards=1 if args.model == "tiny" else 4,
                         **shapes[args.model])
        if dev == "cuda":  # the drawing's cached blocks would count as used when the engine sizes its pool
            torch.cuda.empty_cache()
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


@dataclass(frozen=True)
class EngineBench:
    """What an engine bench starts from: the checkpoint (written once for a bench shape), its
    config.json, the backend and its device, and the ``--engine-args`` it passes beyond the defaults."""

    model_dir: Path
    config: dict[str, Any]
    backend: Any
    device: Any
    engine_args: dict[str, Any]

    def header(self, bench: str, args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
        """The first keys of the bench's result: what ran, where, when."""
        import sys

        import torch

        sub = [] if sys.argv[1:3] == ["bench", bench] else ["bench", bench]  # run as a module of its own
        return dict(bench=bench, model=args.model, dtype=args.dtype, device=self.device.description(),
                    date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit=source_commit(),
                    command=" ".join(["python3 -m hwkv", *sub, *sys.argv[1:]]), **extra, torch=torch.__version__)


def source_commit() -> str | None:
    """The checkout's short commit: a ``COMMIT`` file at the tree's root (a copy shipped to the GPU
    machine, which may sit inside another checkout: its ``git rev-parse`` names that one), else
    ``git rev-parse``."""
    root = Path(__file__).resolve().parents[2]
    if (root / "COMMIT").is_file():
        return (root / "COMMIT").read_text().strip() or None
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=root).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        out = ""
    return out or None


def engine_bench(args: argparse.Namespace) -> EngineBench:
    """:class:`EngineBench` from the common arguments ``--model/--dtype/--workdir/--backend/--engine-args``."""
    mdir = model_dir(args)
    be = backend(args.backend)
    return EngineBench(mdir, json.loads((Path(mdir) / "config.json").read_text()), be, be.device,
                       json.loads(args.engine_args))


def result_path(args: argparse.Namespace, bench: str) -> Path:
    """``--out`` or ``<results_dir>/<bench>-<model>-<date>.json``."""
    return Path(args.out) if args.out else results_dir() / f"{bench}-{args.model}-{time.strftime('%Y-%m-%d')}.json"


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


def free_engine(engine: Any, device: Any) -> None:
    """Drop ``engine``'s captured graphs (they pin the graph memory pool) and return cached device
    memory, so the next engine of the same bench process gets it (``engine`` may be ``None``)."""
    for name in ("graphs", "graphs_b", "tail_graphs", "loading_tail_graphs"):
        if engine is not None and getattr(engine.runner, name, None) is not None:
            getattr(engine.runner, name).graphs.clear()
            getattr(engine.runner, name).graph_tokens.clear()  # the sampling graphs' (graph, tokens)
    del engine
    gc.collect()
    device.empty_cache()


def offload_engine(mdir: Path, args: argparse.Namespace, offload: bool, **kw: Any) -> Any:
    """An engine for ``hwkv bench offload``: with the offload connector (``--cpu-gb`` of host tier,
    ``--store-batch-blocks``, ``--offload-config``) or without it (``offload=False``)."""

    if offload:
        cfg: dict[str, Any] = {"cpu_bytes": int(args.cpu_gb * 2**30)}
        if args.store_batch_blocks is not None:
            cfg["store_batch_blocks"] = args.store_batch_blocks
        cfg.update(args.offload_config)
        kw.update(kv_connector="offload", kv_connector_config=cfg)
    if args.block_size:
        kw["block_size"] = args.block_size
    # the figures that follow were taken with these beyond the public defaults (issue 36: no hidden tuning)
    print(f"[offload] engine arguments beyond the defaults: {kw}", flush=True)
    return hwkv.Engine(str(mdir), backend=backend(args.backend), dtype=args.dtype, **kw)


def resolved(engine: Any) -> dict[str, Any]:
    """The values the engine chose (what the defaults resolved to)."""
    c = engine.config
    return dict(max_num_batched_tokens=c.scheduler.max_num_batched_tokens, max_num_seqs=c.scheduler.max_num_seqs,
                max_model_len=c.model.max_model_len, num_kv_blocks=c.cache.num_kv_blocks, block_size=c.cache.block_size,
                graphs=c.runtime.graphs, async_scheduling=c.runtime.async_scheduling,
                kv_cache_dtype=getattr(c.cache, "kv_cache_dtype", "auto"))
