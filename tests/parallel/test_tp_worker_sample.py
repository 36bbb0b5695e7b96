"""A worker's tokens on a plain greedy step: the driver's sampler fast path (the backend's argmax where offered)."""

from types import SimpleNamespace

import torch

from hwkv.engine.model_runner import ModelRunner
from hwkv.engine.tp.runner import WorkerRunner


def _worker(ops):
    fake = SimpleNamespace(argmax=True, model=SimpleNamespace(decode_ops=ops))
    fake._greedy = lambda logits: ModelRunner._greedy(fake, logits)
    return fake


def test_worker_greedy_takes_the_backend_argmax():
    calls = []
    ops = SimpleNamespace(argmax=lambda x: calls.append(x.dtype) or x.argmax(-1))
    logits = torch.randn(3, 50).to(torch.bfloat16)
    tokens, logprobs = WorkerRunner._sample(_worker(ops), logits, [None] * 3, ["a", "b", "c"])
    assert calls == [torch.float32]  # one call, on the float32 logits (as the driver's sample_tokens)
    assert torch.equal(tokens, logits.float().argmax(-1)) and logprobs is None


def test_worker_greedy_without_backend_argmax_is_argmax_rows():
    logits = torch.randn(2, 300)
    logits[1, 7] = logits[1, 200] = 99.0  # a tie: the first index, as torch.argmax
    for ops in (None, SimpleNamespace(argmax=lambda x: None)):
        tokens, _ = WorkerRunner._sample(_worker(ops), logits, [None] * 2, ["a", "b"])
        assert torch.equal(tokens, logits.argmax(-1)) and int(tokens[1]) == 7


def test_graph_tokens_follow_the_driver_word_and_the_switch(monkeypatch):
    """A worker takes a graph step's own argmax exactly when the driver says every request is plain (its requests
    carry placeholder sampling parameters); the tp runners sample in their graphs only with HWKV_TP_GRAPH_SAMPLE=1."""
    from hwkv.engine.tp.runner import DriverRunner

    w = SimpleNamespace(argmax=True)
    assert WorkerRunner._graph_tokens_ok(w) is True
    w.argmax = False
    assert WorkerRunner._graph_tokens_ok(w) is False
    monkeypatch.delenv("HWKV_TP_GRAPH_SAMPLE", raising=False)
    for cls in (DriverRunner, WorkerRunner):
        assert cls.samples_in_graphs.fget(None) is False
    monkeypatch.setenv("HWKV_TP_GRAPH_SAMPLE", "1")
    for cls in (DriverRunner, WorkerRunner):
        assert cls.samples_in_graphs.fget(None) is True
    assert ModelRunner.samples_in_graphs is True  # one device: always
