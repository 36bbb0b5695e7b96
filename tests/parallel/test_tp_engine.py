"""Engine(tensor_parallel_size=N) on the CPU backend (gloo, worker processes): exactly the tp=1
greedy tokens for GQA, MHA and KV-replicated (MQA) models; clear refusals; no process left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hwkv.engine import Engine
from hwkv.engine.tp.executor import TPWorkerError
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams
from tests.parallel.conftest import add_biases

pytestmark = pytest.mark.timeout(180)

PROMPTS = [[5, 6, 7, 8, 9], [100, 200, 300], list(range(30, 70)), [7] * 20]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0)
SEEDED = SamplingParams(max_tokens=10, temperature=0.8, seed=7)  # not plain: the driver samples, then broadcasts


def _tokens(engine: Engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY, use_tqdm=False)]


def _gone(pids: list[int], within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{p}") and _not_zombie(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


# (arch, heads, kv heads, vocab, tied, engine options): GQA with a vocabulary that does not divide
# (padded shard), q/k/v/o/MLP biases and preemption (small pool); MHA with async scheduling; MQA (KV replicated) on a
# Qwen3-MoE (per-head q/k norm, experts sharded)
CASES = {
    "gqa": ("llama", 4, 2, 515, False, {"num_kv_blocks": 5, "max_model_len": 64}),
    "mha": ("qwen3", 4, 4, 512, True, {"async_scheduling": True}),
    "mqa": ("qwen3_moe", 4, 1, 512, False, {}),
    # a sliding window of 8 in every layer (per layer, not per head: each rank keeps it)
    "window": ("mistral", 4, 2, 512, False, {}),
    # Qwen2 windowed from layer 1 on: a full-attention and a window KV-cache group on every rank
    "hybrid": ("qwen2", 4, 2, 512, False, {}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_tp2_tokens_equal_tp1(tmp_path, case):
    arch, heads, kv, vocab, tie, opts = CASES[case]
    path = write_tiny_model(tmp_path, arch=arch, num_heads=heads, num_kv_heads=kv, vocab_size=vocab,
                            tie_word_embeddings=tie, tokenizer=False,
                            sliding_window=8 if case in ("window", "hybrid") else None)
    if case == "hybrid":
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "max_window_layers": 1}))
    if arch == "llama":
        path = add_biases(path)
    kw = {"block_size": 16, "num_kv_blocks": 32, "max_model_len": 128, **opts}
    one = Engine(str(path), **kw)
    ref = _tokens(one)
    seeded = [o.token_ids for o in one.generate(PROMPTS, SEEDED, use_tqdm=False)] if case == "mha" else None
    eng = Engine(str(path), tensor_parallel_size=2, **kw)
    pids = [p.pid for p in eng._tp.procs]
    try:
        assert eng.model.config.num_kv_heads == max(1, kv // 2)  # this rank holds only its KV heads
        if case == "window":
            assert eng.model.attention_features == ("sliding_window",)  # prompts of up to 40 + 10 tokens
        comm, broadcasts = eng.runner.comm, []
        real = comm.broadcast
        comm.broadcast = lambda t, src=0: broadcasts.append(len(t)) or real(t, src)
        assert _tokens(eng) == ref
        assert not broadcasts  # greedy, plain: every rank took the argmax itself
        if seeded is not None:
            assert [o.token_ids for o in eng.generate(PROMPTS, SEEDED, use_tqdm=False)] == seeded
            assert broadcasts  # sampled on the driver, tokens broadcast
        pools = [m.block_pool for m in getattr(eng.kv_cache_manager, "managers", [eng.kv_cache_manager])]
        assert all(p.num_free_blocks == p.num_usable_blocks for p in pools) and not eng.runner.reqs  # all back
        if case in ("window", "hybrid"):  # KV-cache groups on every rank (docs/hybrid-models.md)
            assert [g.window for g in eng.config.kv_groups] == ([8] if case == "window" else [None, 8])
        if case == "gqa":
            assert eng.scheduler.num_preemptions > 0  # the preempt path was mirrored on the worker
    finally:
        eng.close()
    assert _gone(pids)
    eng.close()  # idempotent


def test_tp2_fp8_kv_tokens_equal_tp1(tmp_path):
    """fp8 KV at tp=2: every rank stores e4m3 and reads it with its own KV heads' scales. Head 1's scale is
    small enough to saturate its keys and values, so a rank that took head 0's scale would not reproduce
    tp=1 (checked: the unsaturated run differs); per-head scales come from the checkpoint for layer 0
    and from ``kv_cache_scales`` in the second engine pair."""
    from safetensors.torch import load_file, save_file

    path = write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, tokenizer=False)
    w = load_file(str(path / "model.safetensors"))
    w["model.layers.0.self_attn.k_scale"] = torch.tensor([1.0, 1e-3])
    w["model.layers.0.self_attn.v_scale"] = torch.tensor([1.0, 1e-3])
    save_file(w, str(path / "model.safetensors"), metadata={"format": "pt"})
    kw = {"block_size": 16, "num_kv_blocks": 32, "max_model_len": 128, "kv_cache_dtype": "fp8"}
    explicit = [[[1.0, 2e-3], [1.0, 2e-3]]] * 2  # [layers, K/V, KV heads]
    for scales in (None, explicit):
        one = Engine(str(path), kv_cache_scales=scales, **kw)
        ref = _tokens(one)
        assert _tokens(Engine(str(path), kv_cache_scales=1.0, **kw)) != ref  # the scales matter here
        eng = Engine(str(path), tensor_parallel_size=2, kv_cache_scales=scales, **kw)
        pids = [p.pid for p in eng._tp.procs]
        try:
            assert eng.kv_cache.spec.dtype == torch.float8_e4m3fn
            assert torch.equal(eng.kv_cache.scales, one.kv_cache.scales[:, :, :1])  # rank 0: head 0's
            assert _tokens(eng) == ref
        finally:
            eng.close()
        assert _gone(pids)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("HWKV_TEST_TP4") != "1", reason="4 processes on a 2-core CI box (~20 s): "
                    "HWKV_TEST_TP4=1 runs it")
def test_tp4_tokens_equal_tp1(tmp_path):
    path = str(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, tokenizer=False))
    kw = {"block_size": 16, "num_kv_blocks": 32, "max_model_len": 128}
    ref = _tokens(Engine(path, **kw))
    eng = Engine(path, tensor_parallel_size=4, **kw)
    try:
        assert _tokens(eng) == ref
    finally:
        eng.close()


def test_tp1_is_the_single_device_path(tmp_path, monkeypatch):
    """tp=1 builds no group, no worker and runs no collective."""
    import torch.distributed as dist

    def no_collective(*a, **k):
        raise AssertionError("a collective ran at tp=1")

    for name in ("all_reduce", "all_gather", "broadcast", "init_process_group"):
        monkeypatch.setattr(dist, name, no_collective)
    path = str(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, tokenizer=False))
    eng = Engine(path, block_size=16, num_kv_blocks=16, max_model_len=64)
    assert eng._tp is None and eng.model.tp is None and type(eng.runner).__name__ == "ModelRunner"
    assert len(_tokens(eng)[0]) == GREEDY.max_tokens
    eng.close()


def test_refusals_before_any_process(tmp_path):
    path = str(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, tokenizer=False))
    with pytest.raises(ValueError, match=r"num_attention_heads 4 is not divisible by tensor_parallel_size 3.*"
                                         r"allowed tensor_parallel_size: 1, 2, 4"):
        Engine(path, tensor_parallel_size=3)
    from hwkv.plugins import get_backend

    with pytest.raises(ValueError, match="backend must be a registered backend name"):
        Engine(path, backend=get_backend("cpu"), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="decode_ops=True but backend 'cpu' offers none"):
        Engine(path, decode_ops=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"speculative decoding \(method 'ngram'\) runs at tensor_parallel_size=1 "
                                         r"only.*allowed at tensor_parallel_size > 1: speculative_config=None"):
        Engine(path, tensor_parallel_size=2,
               speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        Engine(path, tensor_parallel_size=0)


def test_failed_start_leaves_no_worker(tmp_path):
    import gc

    path = str(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, tokenizer=False))
    before = _children()
    with pytest.raises(ValueError, match="max_model_len 4096 exceeds the model's 2048"):
        Engine(path, tensor_parallel_size=2, max_model_len=4096, num_kv_blocks=16)
    gc.collect()
    assert _gone(list(_children() - before))


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if f.read().split(") ")[1].split()[1] == me:
                        out.add(int(d))
            except (FileNotFoundError, IndexError):
                pass
    return out


def test_dead_worker_is_fatal_and_reported(tmp_path):
    path = str(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, tokenizer=False))
    eng = Engine(path, tensor_parallel_size=2, block_size=16, num_kv_blocks=16, max_model_len=64)
    try:
        eng._tp.procs[0].send_signal(signal.SIGKILL)
        eng._tp.procs[0].wait(10)
        t = time.monotonic()
        with pytest.raises(TPWorkerError, match="rank 1"):
            eng.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
        assert time.monotonic() - t < 30  # a send to the dead rank's socket blocked until a 180 s timeout
        with pytest.raises(TPWorkerError):  # and stays dead
            eng.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    finally:
        eng.close()
    with pytest.raises(TPWorkerError, match="was closed"):
        eng.generate([[1, 2, 3]], GREEDY, use_tqdm=False)


_DRIVER = """
import sys, time, torch
torch.set_num_threads(1)
from hwkv.engine import Engine
e = Engine(sys.argv[1], tensor_parallel_size=2, block_size=16, num_kv_blocks=16, max_model_len=64)
print(e._tp.procs[0].pid, flush=True)
time.sleep(60)
"""


def test_workers_exit_when_the_driver_dies(tmp_path):
    path = str(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, tokenizer=False))
    drv = subprocess.Popen([sys.executable, "-c", _DRIVER, path], stdout=subprocess.PIPE, text=True)
    try:
        line = drv.stdout.readline()  # type: ignore[union-attr]
        assert line.strip().isdigit(), line
        worker = int(line)
        drv.send_signal(signal.SIGKILL)
        drv.wait(10)
        assert _gone([worker], within=15)
    finally:
        if drv.poll() is None:
            drv.kill()
            drv.wait(10)


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _drain_with_errors(eng: Engine) -> tuple[dict, int]:
    finals, errors = {}, 0
    for _ in range(200):
        if not eng.has_unfinished():
            break
        try:
            finals.update({o.request_id: o for o in eng.step() if o.finished})
        except RuntimeError:
            errors += 1
    return finals, errors


@pytest.mark.parametrize("where", ["sampling", "state"])
def test_a_driver_side_step_failure_is_contained(tmp_path, monkeypatch, where):
    """A step failing on the driver only — while sampling, or while applying its state changes
    (before any collective) — is contained as at tp=1: the request fails alone, the others get the
    tp=1 tokens, the workers stay in step."""
    import hwkv.engine.model_runner as mr

    path = str(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, tokenizer=False))
    kw = {"block_size": 16, "num_kv_blocks": 32, "max_model_len": 128}
    want = _tokens(Engine(path, **kw))
    eng = Engine(path, tensor_parallel_size=2, **kw)
    try:
        if where == "sampling":
            real = mr.sample_tokens

            def sample_tokens(logits, batch, argmax=None):
                if any(sp.seed == 4242 for sp in batch.params):
                    raise RuntimeError("sampler overflow")
                return real(logits, batch, argmax)

            monkeypatch.setattr(mr, "sample_tokens", sample_tokens)
        else:
            real_add = eng.runner._add

            def _add(new):
                if new.sampling_params.seed == 4242:
                    raise RuntimeError("generator refused")
                return real_add(new)

            monkeypatch.setattr(eng.runner, "_add", _add)
        for i, p in enumerate(PROMPTS):
            eng.add_request(f"r{i}", p, GREEDY)
        eng.add_request("bad", [3, 4, 5], SamplingParams(temperature=0.0, max_tokens=4, seed=4242))
        finals, errors = _drain_with_errors(eng)
        assert errors == 1 and finals.pop("bad").finish_reason == "error"
        assert [finals[f"r{i}"].token_ids for i in range(len(PROMPTS))] == want
        assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache_manager.block_pool.num_blocks
        assert _tokens(eng) == want  # the workers are still in step
    finally:
        eng.close()


@pytest.mark.parametrize("hybrid", [False, True], ids=["dense", "hybrid"])
def test_tp2_fused_decode_ops_tokens_equal_tp1(tmp_path, monkeypatch, hybrid):
    """The backend's fused decode ops at tp=2 (every rank takes them; each projection's partial
    output goes through all_reduce_add into the residual): the tp=1 greedy tokens, fp32. ``hybrid``:
    a Qwen2 model with a full and a window-8 layer, two KV-cache groups on every rank, the ops taking
    each layer's group's slot mapping."""
    from hwkv import plugins

    monkeypatch.setenv("HWKV_PLUGIN_MODULES", "tests.parallel.ops_plugin")
    monkeypatch.syspath_prepend(os.getcwd())
    plugins.reset()
    try:
        if hybrid:
            path = write_tiny_model(tmp_path, arch="qwen2", num_heads=4, num_kv_heads=2, vocab_size=512,
                                    tie_word_embeddings=False, tokenizer=False, sliding_window=8)
            cfg = json.loads((path / "config.json").read_text())
            (path / "config.json").write_text(json.dumps({**cfg, "max_window_layers": 1}))
        else:
            path = add_biases(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, vocab_size=515,
                                               tokenizer=False))
        kw = {"backend": "cpu-decode-ops", "block_size": 16, "num_kv_blocks": 32, "max_model_len": 128,
              "decode_ops": True}
        one = Engine(str(path), **kw)
        assert one.model.decode_ops is not None
        ref = _tokens(one)
        eng = Engine(str(path), tensor_parallel_size=2, **kw)
        try:
            assert eng.model.decode_ops is not None
            assert [g.window for g in eng.config.kv_groups] == ([None, 8] if hybrid else [])
            assert _tokens(eng) == ref
        finally:
            eng.close()
    finally:
        monkeypatch.delenv("HWKV_PLUGIN_MODULES")
        plugins.reset()


def test_tp2_overlapped_mlp_halves_tokens_equal_tp1(tmp_path, monkeypatch):
    """Communicator.overlap_tokens (HWKV_TP_OVERLAP_TOKENS, every rank's process): forwards of at least
    that many tokens run in two row halves (o_proj, norms, MLP, the next qkv) whose all-reduces are started
    before the other half's work - the same greedy tokens as tp=1, and the driver started them (4 per layer
    per prefill)."""
    monkeypatch.setenv("HWKV_TP_OVERLAP_TOKENS", "8")
    path = add_biases(write_tiny_model(tmp_path, num_heads=4, num_kv_heads=2, vocab_size=515, tokenizer=False))
    kw = {"block_size": 16, "num_kv_blocks": 32, "max_model_len": 128}
    ref = _tokens(Engine(str(path), **kw))
    eng = Engine(str(path), tensor_parallel_size=2, **kw)
    try:
        comm, starts = eng.runner.comm, []
        assert comm.overlap_tokens == 8
        real = comm.all_reduce_start
        comm.all_reduce_start = lambda t: starts.append(t.shape[0]) or real(t)
        assert _tokens(eng) == ref
        layers = eng.model.config.num_layers
        assert starts and len(starts) % (4 * layers) == 0  # every layer: two halves, twice
        # a communicator that fuses the sum into the next norm (CUDA's one-shot copy-engine path): the halves take
        # it at every site followed by a norm (two a layer but the last's MLP, per half); the workers' plain
        # start + norm makes the same collectives, so the tokens stay tp=1's
        from hwkv.model.layers import add_rms_norm

        fused, starts[:] = [], []

        def fused_start(t, residual, weight, eps):
            fused.append(t.shape[0])
            wait = real(t)
            return lambda: add_rms_norm(wait(), residual, weight, eps)

        comm.all_reduce_add_rms_norm_start = fused_start
        assert _tokens(eng) == ref
        per_forward = 2 * (2 * layers - 1)
        assert fused and len(fused) % per_forward == 0 and len(starts) == 2 * len(fused) // per_forward
    finally:
        eng.close()


def test_a_worker_exits_with_its_driver_wherever_it_is_stuck():
    """The worker's watcher thread: once the process's parent is not the driver it was started by, it exits
    (code 3) whatever the main thread is doing - here sleeping, as a rank stuck in a rendezvous would."""
    import subprocess
    import sys

    code = ("import threading, time; from hwkv.engine.tp.worker import _exit_with_driver; "
            "threading.Thread(target=_exit_with_driver, args=(-1,), daemon=True).start(); time.sleep(60)")
    t0 = time.monotonic()
    p = subprocess.run([sys.executable, "-c", code], timeout=60, capture_output=True)
    assert p.returncode == 3 and time.monotonic() - t0 < 30, p.stderr[-2000:]
