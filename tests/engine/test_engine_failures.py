"""Engine and scheduler behaviour on failure paths: a failing step, connectors over-claiming,
mixing generate() with add_request(), configuration the engine must resolve itself."""

from __future__ import annotations

import pytest

import hwkv
from hwkv.connectors.base import NoOpConnector
from hwkv.sampling_params import SamplingParams
from hwkv.testing.tiny_models import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
PROMPTS = [[5 + i, 17, 33 + i, 9, 12, 40 + i, 7, 8, 3 + i] for i in range(4)]



@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=256))


def _engine(model_dir: str, **kw) -> hwkv.Engine:
    return hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=64, **kw)


def _no_leak(e: hwkv.Engine) -> None:
    assert not e.has_unfinished()
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks
    assert not e.runner.reqs and not e.scheduler.requests


def test_failed_step_rolls_back_and_the_engine_recovers(model_dir):
    want = [o.token_ids for o in _engine(model_dir).generate(PROMPTS, GREEDY, use_tqdm=False)]
    e = _engine(model_dir)
    for i, p in enumerate(PROMPTS):
        e.add_request(f"r{i}", p, GREEDY)
    e.step()
    e.step()
    real = e.runner.execute

    def boom(so):
        raise RuntimeError("device lost")

    e.runner.execute = boom
    with pytest.raises(RuntimeError, match="device lost"):
        e.step()
    assert e.scheduler.num_running == 0 and e.scheduler.num_waiting == len(PROMPTS)
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks  # nothing held by the failed step
    e.runner.execute = real
    done = {}
    while e.has_unfinished():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert [done[f"r{i}"] for i in range(len(PROMPTS))] == want  # recompute gives the same tokens
    _no_leak(e)


class _Greedy(NoOpConnector):
    """Claims every token of every prompt as externally available (synchronously)."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        return request.num_tokens - num_computed_tokens, False


def test_connector_claiming_every_token_still_leaves_one_to_compute(model_dir):
    e = _engine(model_dir, kv_connector=_Greedy())
    e.add_request("a", PROMPTS[0], GREEDY)
    so = e.scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1}  # the last prompt token is computed, so logits exist


def test_generate_keeps_outputs_of_streamed_requests(model_dir):
    e = _engine(model_dir)
    e.add_request("streamed", PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    outs = e.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    assert len(outs) == 3
    finals = []
    while e.has_unfinished():
        finals += [o for o in e.step() if o.finished]
    assert [o.request_id for o in finals] == ["streamed"] and len(finals[0].token_ids) == 3
    _no_leak(e)


def test_stop_strings_need_a_tokenizer(tmp_path):
    d = write_tiny_model(tmp_path / "m")
    (d / "tokenizer.json").unlink()
    e = hwkv.Engine(str(d), num_kv_blocks=32, max_model_len=64)
    with pytest.raises(ValueError, match="SamplingParams.stop needs a tokenizer"):
        e.generate([PROMPTS[0]], SamplingParams(stop=["x"]), use_tqdm=False)
    assert e.generate([PROMPTS[0]], SamplingParams(stop_token_ids=[3], max_tokens=4), use_tqdm=False)
    _no_leak(e)


def test_without_chunked_prefill_the_token_budget_covers_max_model_len(tmp_path):
    d = str(write_tiny_model(tmp_path / "long", max_position_embeddings=4096))
    e = hwkv.Engine(d, num_kv_blocks=256, max_model_len=2500, enable_chunked_prefill=False)
    assert e.scheduler.config.max_num_batched_tokens == 2500
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        hwkv.Engine(d, num_kv_blocks=256, max_model_len=2500, enable_chunked_prefill=False,
                    max_num_batched_tokens=2048)


def test_cache_salt_separates_prefix_cache(model_dir):
    e = _engine(model_dir)
    long = list(range(10, 60))
    e.generate([long], SamplingParams(temperature=0, max_tokens=2, cache_salt="tenant-a"), use_tqdm=False)
    hits = e.stats()["prefix_cache_hits"]
    e.generate([long], SamplingParams(temperature=0, max_tokens=2, cache_salt="tenant-b"), use_tqdm=False)
    assert e.stats()["prefix_cache_hits"] == hits  # another tenant's blocks are never matched
    e.generate([long], SamplingParams(temperature=0, max_tokens=2, cache_salt="tenant-a"), use_tqdm=False)
    assert e.stats()["prefix_cache_hits"] > hits
    _no_leak(e)


def test_streamed_text_only_grows_with_stop_strings(tmp_path):
    d = str(write_tiny_model(tmp_path / "m", max_position_embeddings=256))
    e = hwkv.Engine(d, num_kv_blocks=64, max_model_len=128)
    (full,) = e.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                         use_tqdm=False)
    text = full.text
    assert len(text) > 8
    stop = text[len(text) // 2 : len(text) // 2 + 4]
    e.add_request("s", "The quick brown fox", SamplingParams(temperature=0, max_tokens=24, stop=[stop]))
    seen: list[str] = []
    while e.has_unfinished():
        seen += [o.text for o in e.step()]
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:])), seen  # never retracts a streamed prefix
    assert seen[-1] == text[: text.find(stop)]
    _no_leak(e)
