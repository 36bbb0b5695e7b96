"""Short-query steps replay captured graphs (emulated on the CPU, :mod:`hwkv.reference.graphs`): a prompt's
tail after a prefix-cache hit — alone, several at once, beside running decodes (async scheduling: their
input ids are still on the device) or as partial prefill chunks that sample nothing — runs through the
tail graphs (rows padded to one block of query tokens, logits of each row's last token) and gives the
eager engine's greedy tokens (float32). Pure-decode steps keep their own graphs; nothing leaks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hwkv
from hwkv.engine.graph_runner import GraphRunner, pad_queries
from hwkv.engine.inputs import build_batch
from hwkv.model.tiny import write_tiny_model
from hwkv.reference.graphs import GraphCpuBackend
from hwkv.sampling_params import SamplingParams

BS = 4  # block size: the tail graphs serve up to 4 query tokens per request
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tail") / "llama", max_position_embeddings=256))


def _engine(model_dir: str, **kw) -> hwkv.Engine:
    torch.set_num_threads(1)
    kw = {"num_kv_blocks": 96, "block_size": BS, "max_model_len": 128, "max_num_seqs": 8, "fuse_elementwise": False,
          **kw}
    return hwkv.Engine(model_dir, backend=GraphCpuBackend(), **kw)


def _prompts(seed: int) -> tuple[list[int], list[list[int]]]:
    rng = np.random.default_rng(seed)
    base = rng.integers(3, 500, 41).tolist()  # 10 full blocks + 1 token
    return base, [base[:40] + rng.integers(3, 500, n).tolist() for n in (1, 2, 3, 4, 5, 9)]


def _done(e: hwkv.Engine) -> None:
    assert not e.has_unfinished() and not e.runner.reqs
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks


def _serial(e: hwkv.Engine, base: list[int], prompts: list[list[int]]) -> list[list[int]]:
    e.generate([base], GREEDY, use_tqdm=False)  # caches the shared 40-token prefix
    out = [e.generate([p], GREEDY, use_tqdm=False)[0].token_ids for p in prompts]
    out.append([o.token_ids for o in e.generate(prompts[:4], GREEDY, use_tqdm=False)])  # four tails at once
    _done(e)
    return out


def test_prefix_hit_tails_replay_tail_graphs_and_match_eager(model_dir):
    base, prompts = _prompts(0)
    eager = _engine(model_dir, enforce_eager=True)
    want = _serial(eager, base, prompts)
    assert eager.runner.tail_graphs is None
    e = _engine(model_dir)
    tg = e.runner.tail_graphs
    assert tg is not None and tg.q == BS and tg.last_only and sorted({b for b, _ in tg.graphs}) == [1, 2, 4, 8]
    got = _serial(e, base, prompts)
    assert got == want
    tail_replays = sum(g.replays for g, _, _ in tg.graphs.values())
    # tails of 2, 3 and 4 tokens after the 40-token hit and the batch of four (a 1-token tail has a pure
    # decode's shape: a decode graph; the 5- and 9-token ones exceed a block: eager)
    assert tail_replays == e.runner.num_tail_graph_steps == 4
    assert e.runner.num_graph_steps > 0  # their decodes stayed on the decode graphs


def test_a_tail_beside_running_decodes_async(model_dir):
    """A request arriving while others decode: its tail runs in the same step as their decodes, whose
    input ids are the previous step's tokens still on the device (filled in by a device copy)."""
    base, prompts = _prompts(1)
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    def run(e: hwkv.Engine) -> dict[str, list[int]]:
        e.generate([base], GREEDY, use_tqdm=False)
        e.add_request("a", prompts[5], long)
        e.add_request("b", prompts[4], long)
        out, arrivals = {}, iter([("c", prompts[0]), ("d", prompts[2]), ("e", prompts[3])])
        for i in range(200):
            if i in (4, 7, 8):
                e.add_request(*next(arrivals), GREEDY)
            for o in e.step():
                if o.finished:
                    out[o.request_id] = o.token_ids
            if not e.has_unfinished():
                break
        _done(e)
        return out

    want = run(_engine(model_dir, enforce_eager=True))
    e = _engine(model_dir)
    assert e.async_scheduling
    got = run(e)
    assert got == want and len(got) == 5
    # d's and e's tails (3, 4 tokens) beside a's and b's decodes; c's 1-token tail is a pure decode
    assert e.runner.num_tail_graph_steps == 2


def test_partial_chunks_that_sample_nothing(model_dir):
    """A token budget of one block: every prompt runs in chunks of <= 4 tokens beside the decodes, most
    of which sample nothing (the graph's logits rows of the sampling requests only are kept)."""
    _, prompts = _prompts(2)
    kw = {"max_num_batched_tokens": BS, "enable_prefix_caching": False}
    eager = _engine(model_dir, enforce_eager=True, **kw)
    want = [o.token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    e = _engine(model_dir, **kw)
    got = [o.token_ids for o in e.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == want
    _done(e)
    assert e.runner.num_tail_graph_steps > 20


def test_no_tail_graphs_where_multi_token_graphs_are_not_captured(model_dir):
    class OneTokenBuilder(type(GraphCpuBackend().attention.metadata_builder())):
        def before_replay(self, captured, step):  # re-binds host args: one-token queries only
            pass

    be = GraphCpuBackend()
    be.attention.metadata_builder = OneTokenBuilder
    e = hwkv.Engine(model_dir, backend=be, num_kv_blocks=32, block_size=BS, max_model_len=64,
                    fuse_elementwise=False)
    assert e.runner.graphs is not None and e.runner.tail_graphs is None
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    e = _engine(model_dir, speculative_config=spec)
    assert e.runner.graphs is not None and e.runner.tail_graphs is None  # spec steps do not use them


def test_last_only_run_matches_the_eager_forward_row_for_row(model_dir):
    """GraphRunner(last_only) on a hand-built batch: rows of 1..q tokens (and a 5-row batch padded to
    bucket 8) give the eager forward's last-token logits; padding writes no KV."""
    e = _engine(model_dir, enforce_eager=True, num_kv_blocks=64)
    r = e.runner
    rng = np.random.default_rng(3)
    n, ql = 5, np.array([1, 4, 2, 3, 1])
    ctx = np.array([7, 0, 12, 30, 3])
    token_ids = rng.integers(3, 500, (8, 128)).astype(np.int32)
    block_table = np.zeros((8, 32), np.int32)
    block_table[:n, :10] = 1 + np.arange(n * 10).reshape(n, 10)
    slots = np.arange(n)
    batch = build_batch(token_ids, block_table, slots, ctx, ql, ctx + ql, BS)
    gr = GraphRunner(r.model, r.kv_cache, r.meta_builder, r.dev, BS, 8, 128, use_graphs=False, query_len=BS,
                     last_only=True)
    with torch.inference_mode():
        for t in r.kv_cache.tensors:
            t.zero_()
        got = gr.run(batch)
        # the padding wrote nothing: the slots holding KV now are exactly the real tokens'
        written = {int(s) for s in np.flatnonzero(r.kv_cache.tensors[0].abs().sum((1, 3, 4)).flatten() > 0)}
        assert written == set(batch.slot_mapping.tolist())
        want = r._forward(r.device_inputs(batch))
    assert got.shape == want.shape == (n, e.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    with pytest.raises(ValueError, match=r"not all in \[1, 4\]"):
        pad_queries(build_batch(token_ids, block_table, slots, ctx, ql + 4, ctx + ql + 4, BS), BS, BS)


def test_a_prefix_loaded_by_the_offload_connector_then_its_tail_replays(model_dir):
    """The ``offload`` connector's host tier gives back a prefix the device pool could not keep; the tail
    after the loaded blocks runs through the tail graphs with the tokens of an eager engine without it."""
    base, prompts = _prompts(4)
    other = np.random.default_rng(5).integers(3, 500, 70).tolist()  # evicts the base prefix
    kw = {"num_kv_blocks": 20, "max_model_len": 80, "max_num_seqs": 2}

    def run(e: hwkv.Engine) -> list[list[int]]:
        out = []
        for p in (base, other, prompts[2], other, prompts[3]):
            out.append(e.generate([p], GREEDY, use_tqdm=False)[0].token_ids)
            for _ in range(100):  # let the stores finish before the next prompt may evict
                if not e.runner.connector or not e.scheduler.connector.has_pending_transfers():
                    break
                e.step()
        _done(e)
        return out

    want = run(_engine(model_dir, enforce_eager=True, **kw))
    e = _engine(model_dir, kv_connector="offload", kv_connector_config={"cpu_bytes": 2**20}, **kw)
    got = run(e)
    assert got == want
    assert e.stats()["kv_connector"]["external_hit_tokens"] >= 2 * 40  # both tails' prefixes were loaded
    assert e.runner.num_tail_graph_steps >= 2
