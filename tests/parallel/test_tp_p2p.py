"""p2p disaggregation between engines of different tensor-parallel sizes (CPU, gloo, tcp transfer
engine on loopback): each consumer rank gets the KV heads ``map_kv_heads`` assigns it from the
producer ranks holding them (pull: it reads them; push: those producer ranks write them), and
decodes exactly the tokens one tp=1 engine gives."""

from __future__ import annotations

import time
from contextlib import closing

import pytest

import hwkv
from hwkv.model.tiny import write_tiny_model
from hwkv.testing.mooncake import skip_unless_mooncake

skip_unless_mooncake(allow_module_level=True)
pytestmark = pytest.mark.timeout(240)

BS = 16


def prompts() -> list[list[int]]:
    import random

    rng = random.Random(7)
    return [[rng.randrange(1, 500) for _ in range(n)] for n in (17, 47)]


def greedy(n: int, params: dict | None = None) -> hwkv.SamplingParams:
    return hwkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, kv_transfer_params=params)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """KV heads -> model: 4 (tp=2 holds 2 per rank, so tp=2 -> tp=1 reads two slices into each
    block), 2 (a different model for the refused handshake), 1 (MQA: tp=2 replicates the head)."""
    root = tmp_path_factory.mktemp("tp_p2p")
    return {kv: str(write_tiny_model(root / f"kv{kv}", num_heads=4, num_kv_heads=kv, tokenizer=False,
                                     max_position_embeddings=256)) for kv in (4, 2, 1)}


def _reference(model: str) -> list[list[int]]:
    e = hwkv.Engine(model, num_kv_blocks=16, block_size=BS, max_model_len=128)
    return [o.token_ids for o in e.generate(prompts(), greedy(6), use_tqdm=False)]


def _engine(model_dir: str, role: str, tp: int, mode: str = "pull", **cfg) -> hwkv.Engine:
    return hwkv.Engine(model_dir, num_kv_blocks=16, block_size=BS, max_model_len=128, tensor_parallel_size=tp,
                       kv_connector="p2p", kv_connector_config={"role": role, "mode": mode,
                                                                "transfer_timeout_s": 5.0, **cfg})


def _settle(*engines: hwkv.Engine, timeout_s: float = 20.0) -> None:
    from tests.connectors.test_p2p_engine import settle

    settle(*engines, timeout_s=timeout_s)
    for e in engines:
        assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks
        assert all(b.ref_cnt == 0 for b in e.kv_cache_manager.block_pool.blocks)
        assert not e.scheduler.delayed_free and not e.runner.reqs
        if hasattr(e.runner, "kv_outputs"):
            assert e.runner.kv_outputs.pending() == 0


@pytest.mark.parametrize("kv, p_tp, d_tp, mode", [(4, 2, 1, "pull"), (4, 1, 2, "pull"), (1, 2, 1, "pull"),
                                                  (4, 2, 1, "push"), (4, 1, 2, "push")],
                         ids=["pull-2to1", "pull-1to2", "pull-mqa-2to1", "push-2to1", "push-1to2"])
def test_heterogeneous_tp_gives_one_engines_tokens(models, kv, p_tp, d_tp, mode):
    model_dir, reference = models[kv], _reference(models[kv])
    with (
        closing(_engine(model_dir, "producer", p_tp, mode)) as p,
        closing(_engine(model_dir, "consumer", d_tp, mode)) as d,
    ):
        for prompt, want in zip(prompts(), reference):
            out = p.generate([prompt], greedy(1, {"do_remote_decode": True}), use_tqdm=False)[0]
            params = out.kv_transfer_params
            assert params and params["do_remote_prefill"]
            assert d.generate([prompt], greedy(6, params), use_tqdm=False)[0].token_ids == want
        _settle(p, d)
        st = d.stats()["kv_connector"]
        assert st["external_hit_tokens"] == sum(len(q) - 1 for q in prompts()) and st["load_failures"] == 0
        if d_tp == 1:  # the bytes of every prompt token's KV (all heads, all layers) arrived on the one rank
            per_token = d.kv_cache.spec.bytes_per_block // BS
            assert st["loaded_bytes"] == per_token * sum(len(q) - 1 for q in prompts())
        assert p.stats()["kv_connector"]["held_requests"] == 0


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_one_consumer_rank_failing_recomputes_and_releases_everything(models, mode):
    """Consumer tp=2 whose rank 1 fails its transfer while rank 0's lands: the request recomputes
    (identical tokens); the producer, served for rank 0 only, frees its blocks when the hold
    expires; no block stays pinned on either side."""
    with (
        closing(_engine(models[4], "producer", 1, mode, hold_timeout_s=1.0, transfer_timeout_s=0.5)) as p,
        closing(hwkv.Engine(models[4], num_kv_blocks=16, block_size=BS, max_model_len=128, tensor_parallel_size=2,
                            kv_connector="hwkv.testing.tp_connectors:FailingP2PRank",
                            kv_connector_config={"role": "consumer", "mode": mode, "transfer_timeout_s": 5.0})) as d,
    ):
        prompt, want = prompts()[1], _reference(models[4])[1]
        params = p.generate([prompt], greedy(1, {"do_remote_decode": True}), use_tqdm=False)[0].kv_transfer_params
        assert d.generate([prompt], greedy(6, params), use_tqdm=False)[0].token_ids == want
        assert d.stats()["kv_connector"]["load_failures"] == 1
        _settle(p, d)


def test_untranslatable_split_is_refused_at_handshake_and_recomputed(models, caplog):
    """A consumer whose model has other KV heads: every consumer rank's handshake is refused with
    both engines named, the request recomputes (its own model's tokens), nothing stays pinned."""
    with (
        closing(_engine(models[4], "producer", 1, hold_timeout_s=1.0)) as p,
        closing(_engine(models[2], "consumer", 2)) as d,
    ):
        prompt, want = prompts()[0], _reference(models[2])[0]
        params = p.generate([prompt], greedy(1, {"do_remote_decode": True}), use_tqdm=False)[0].kv_transfer_params
        with caplog.at_level("WARNING"):
            assert d.generate([prompt], greedy(6, params), use_tqdm=False)[0].token_ids == want
        pid, did = p.scheduler.connector.worker.engine_id, d.scheduler.connector.worker.engine_id
        assert f"refused: the models' KV heads differ: 4 at engine {pid}, 2 at engine {did}" in caplog.text
        assert d.stats()["kv_connector"]["load_failures"] == 1
        _settle(p, d)  # every consumer rank released the hold it could not read: freed without expiring
        assert p.stats()["kv_connector"]["expired_holds"] == 0


def test_layerwise_at_tp_is_refused_before_any_worker_starts(models):
    with pytest.raises(ValueError, match=r"layerwise=True needs tensor_parallel_size=1 \(got 2; allowed at "
                                         r"tensor_parallel_size > 1: layerwise=False"):
        hwkv.Engine(models[4], num_kv_blocks=16, block_size=BS, max_model_len=128, tensor_parallel_size=2,
                    kv_connector="p2p", kv_connector_config={"role": "producer", "mode": "push", "layerwise": True})


def test_serving_a_tp2_producer_behind_the_proxy(tmp_path):
    """`hwkv serve --tensor-parallel-size 2` as the producer (the serving core passes the connector
    by name, so every rank builds its own), a tp=1 consumer, `hwkv proxy`: one engine's tokens."""
    from tests.connectors.test_p2p_serving import ENGINE, Proxy, Server, complete, connector, counter

    tiny = write_tiny_model(tmp_path / "tiny", seed=0, max_position_embeddings=1024, tokenizer=True)
    prompt = "The quick brown fox jumps over the lazy dog " * 3
    local = hwkv.Engine(tiny, num_kv_blocks=64, block_size=16, max_model_len=512, seed=0)
    want = local.generate([prompt], greedy(8), use_tqdm=False)[0].token_ids
    started = []
    try:
        started.append(Server(tiny, *ENGINE, "--served-model-name", "tiny", "--tensor-parallel-size", "2",
                              *connector("producer", "pull"), timeout=180))
        started.append(Server(tiny, *ENGINE, "--served-model-name", "tiny", *connector("consumer", "pull"),
                              timeout=180))
        started.append(Proxy([started[0].url], [started[1].url]))
        assert complete(started[2].url, prompt)["choices"][0]["token_ids"] == want
        assert counter(started[1].url, "load_failures") == 0 and counter(started[1].url, "loaded_bytes") > 0
    finally:
        for s in reversed(started):
            s.stop()


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_staged_tp2_producer(models, mode):
    """A tp=2 producer staging through host mirrors (as tcp from GPUs does; host to host here):
    every rank stages its shard at its next step, the consumer's reads wait for it (pull: Acquire is
    answered "retry"; push: the write starts once staged), one engine's tokens."""
    with (
        closing(_engine(models[4], "producer", 2, mode, staging=True)) as p,
        closing(_engine(models[4], "consumer", 1, mode)) as d,
    ):
        prompt, want = prompts()[1], _reference(models[4])[1]
        params = p.generate([prompt], greedy(1, {"do_remote_decode": True}), use_tqdm=False)[0].kv_transfer_params
        d.add_request("x", prompt, greedy(6, params))
        got, t0 = None, time.monotonic()
        while time.monotonic() < t0 + 0.3:  # the consumer asks before the producer's ranks staged: it waits
            assert not d.step()
            time.sleep(0.01)
        while d.has_unfinished():  # the producer steps now: its ranks stage at its next step
            assert time.monotonic() < t0 + 30, "the staged transfer never completed"
            p.step()
            got = next((o.token_ids for o in d.step() if o.finished), got)
        assert got == want and d.stats()["kv_connector"]["load_failures"] == 0
        _settle(p, d)


@pytest.mark.parametrize("p_tp, d_tp, mode, staging", [(2, 1, "pull", False), (1, 2, "push", False),
                                                      (2, 1, "push", True)],
                         ids=["pull-2to1", "push-1to2", "push-2to1-staged"])
def test_kv_cache_groups_across_tensor_parallel_sizes(tmp_path, p_tp, d_tp, mode, staging):
    """A Qwen2 with a full and a window-8 layer (two KV-cache groups on every rank): each consumer rank
    gets its heads of both groups (the window group's window only), one tp=1 engine's tokens; a staged
    tp=2 producer copies both groups' blocks of a hold to its ranks' host mirrors first."""
    import json

    path = write_tiny_model(tmp_path / "hybrid", arch="qwen2", num_heads=4, num_kv_heads=4, tokenizer=False,
                            max_position_embeddings=256, sliding_window=8)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "use_sliding_window": True, "max_window_layers": 1}))
    reference = _reference(str(path))
    with (
        closing(_engine(str(path), "producer", p_tp, mode, staging=staging)) as p,  # staging: a host mirror per group
        closing(_engine(str(path), "consumer", d_tp, mode)) as d,
    ):
        assert [g.window for g in d.config.kv_groups] == [None, 8] == [g.window for g in p.config.kv_groups]
        for i, (prompt, want) in enumerate(zip(prompts(), reference)):
            params = p.generate([prompt], greedy(1, {"do_remote_decode": True}), use_tqdm=False)[0].kv_transfer_params
            d.add_request(str(i), prompt, greedy(6, params))
            got, t0 = None, time.monotonic()
            while d.has_unfinished():  # the producer steps too: a staged hold is copied at its next step
                assert time.monotonic() < t0 + 30, "the transfer never completed"
                p.step()
                got = next((o.token_ids for o in d.step() if o.finished), got)
            assert got == want
        from tests.connectors.test_p2p_engine import assert_clean

        assert_clean(p, d)
        st = d.stats()["kv_connector"]
        assert st["external_hit_tokens"] == sum(len(q) - 1 for q in prompts()) and st["load_failures"] == 0
