"""Engine and scheduler behaviour on failure paths: a failing step, connectors over-claiming,
mixing generate() with add_request(), configuration the engine must resolve itself."""

from __future__ import annotations

from typing import Any

import pytest

import hwkv
from hwkv.connectors.base import NoOpConnector
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams

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
    assert not e.runner.reqs and not e.runner.generators and not e.scheduler.requests
    assert not e._tracked and not e._live and not e.scheduler.suspects


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
    assert list(so.num_scheduled_tokens.values()) == [1]  # the last prompt token is computed: logits exist


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


# ---- request ids ------------------------------------------------------------------------------
def _drain(e: hwkv.Engine, max_steps: int = 500) -> dict[str, list]:
    """Step until idle; every output per id, in order (bounded)."""
    seen: dict[str, list] = {}
    for _ in range(max_steps):
        if not e.has_unfinished():
            return seen
        for o in e.step():
            seen.setdefault(o.request_id, []).append(o)
    raise AssertionError("engine did not go idle")



def _finish_all(e: hwkv.Engine, raises: type[Exception], match: str,
                max_steps: int = 200) -> tuple[dict[str, Any], int]:
    """Step until idle: the final outputs by id, and how many steps raised ``raises`` (each message
    containing ``match``). Bounded."""
    finals: dict[str, Any] = {}
    errors = 0
    for _ in range(max_steps):
        if not e.has_unfinished():
            return finals, errors
        try:
            finals.update({o.request_id: o for o in e.step() if o.finished})
        except raises as exc:
            assert match in str(exc)
            errors += 1
    raise AssertionError("engine did not go idle")

def test_generate_after_abort_of_a_reused_id_returns_only_its_own_outputs(model_dir):
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    want = [o.token_ids for o in _engine(model_dir).generate(PROMPTS[1:3], [GREEDY, short], use_tqdm=False)]
    e = _engine(model_dir)
    e.add_request("0", PROMPTS[0], GREEDY)
    e.step()
    e.abort("0")  # its final output is pending; generate() numbers its requests from "0"
    outs = e.generate(PROMPTS[1:3], [GREEDY, short], use_tqdm=False)
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert [o.token_ids for o in outs] == want
    assert [o.prompt_token_ids for o in outs] == PROMPTS[1:3]
    assert "0" not in {o.request_id for o in outs}  # still reserved: its abort output was not returned
    later = _drain(e)
    assert list(later) == ["0"] and [o.finish_reason for o in later["0"]] == ["abort"]
    _no_leak(e)


def test_an_id_stays_reserved_until_its_final_output_was_returned(model_dir):
    e = _engine(model_dir)
    e.add_request("x", PROMPTS[0], GREEDY)
    e.step()
    e.abort("x")
    with pytest.raises(ValueError, match="'x' is already in use"):
        e.add_request("x", PROMPTS[1], GREEDY)
    (out,) = e.step()
    assert (out.request_id, out.finish_reason) == ("x", "abort")
    e.add_request("x", PROMPTS[1], GREEDY)  # free again: a new request, nothing of the old one
    (final,) = [o for o in _drain(e)["x"] if o.finished]
    assert final.prompt_token_ids == PROMPTS[1] and final.finish_reason == "length"
    _no_leak(e)


# ---- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [2**70, 2**64, -(2**63) - 1, True, 1.5])
def test_seed_outside_the_generator_range_is_refused(seed):
    with pytest.raises(ValueError, match=r"SamplingParams\.seed must be None or an integer in \["):
        SamplingParams(seed=seed)


def test_a_seed_mutated_out_of_range_is_refused_by_add_request(model_dir):
    e = _engine(model_dir)
    sp = SamplingParams(temperature=1.0, max_tokens=3, seed=1)
    sp.seed = 2**70
    with pytest.raises(ValueError, match=r"SamplingParams\.seed"):
        e.add_request("s", PROMPTS[0], sp)
    (out,) = e.generate([PROMPTS[0]], SamplingParams(max_tokens=3, seed=2**64 - 1), use_tqdm=False)
    assert len(out.token_ids) == 3
    _no_leak(e)


def test_untokenizable_prompt_raises_value_error_and_generate_rolls_back(model_dir):
    e = _engine(model_dir)
    with pytest.raises(ValueError, match="cannot be tokenized"):
        e.add_request("s", "a\ud800b", GREEDY)
    with pytest.raises(ValueError, match="cannot be tokenized"):
        e.generate(["fine", "a\ud800b"], GREEDY, use_tqdm=False)
    _no_leak(e)
    e.add_request("s", "fine", GREEDY)  # the id was never taken
    assert e.generate(["fine"], GREEDY, use_tqdm=False)[0].finish_reason == "length"
    _drain(e)
    _no_leak(e)


def test_any_failure_while_validating_a_batch_rolls_back_every_id(model_dir, monkeypatch):
    e = _engine(model_dir)
    real, calls = e._make_request, []

    def flaky(rid, prompt, params):
        calls.append(rid)
        if len(calls) == 3:
            raise KeyError("validator bug")
        return real(rid, prompt, params)

    monkeypatch.setattr(e, "_make_request", flaky)
    with pytest.raises(KeyError):
        e.generate(PROMPTS, GREEDY, use_tqdm=False)
    _no_leak(e)
    monkeypatch.undo()
    assert len(e.generate(PROMPTS, GREEDY, use_tqdm=False)) == len(PROMPTS)
    _no_leak(e)


# ---- a request whose execution fails ------------------------------------------------------------
def _poison(e: hwkv.Engine, monkeypatch, bad: str) -> list[str]:
    """Make every step that runs request ``bad`` raise; returns the log of raised messages."""
    real, raised = e.runner.execute_async, []

    def execute_async(so):
        if any(rid.startswith(f"{bad}-") for rid in so.num_scheduled_tokens):
            raised.append(sorted(so.num_scheduled_tokens))
            raise RuntimeError("poisoned row")
        return real(so)

    monkeypatch.setattr(e.runner, "execute_async", execute_async)
    return raised


@pytest.mark.parametrize("async_", [False, True])
def test_a_request_that_always_fails_is_finished_with_an_error(model_dir, monkeypatch, async_):
    want = [o.token_ids for o in _engine(model_dir).generate(PROMPTS[:3], GREEDY, use_tqdm=False)]
    e = _engine(model_dir, async_scheduling=async_)
    raised = _poison(e, monkeypatch, "bad")
    for i, p in enumerate(PROMPTS[:3]):
        e.add_request(f"r{i}", p, GREEDY)
    e.add_request("bad", PROMPTS[3], GREEDY)
    finals, errors = _finish_all(e, RuntimeError, "poisoned row")
    assert errors == 1  # the batched failure propagates once; then the suspect runs alone
    assert len(raised) == 2 and len(raised[1]) == 1  # ... and fails alone: its own failure
    bad = finals.pop("bad")
    assert bad.finish_reason == "error" and bad.finished and "RuntimeError: poisoned row" in bad.error
    assert [finals[f"r{i}"].token_ids for i in range(3)] == want  # the others recompute, unharmed
    assert all(o.error is None and o.finish_reason == "length" for o in finals.values())
    _no_leak(e)


def test_a_failure_only_when_sampling_a_chunked_prompt_is_contained(model_dir, monkeypatch):
    """The poisoned request passes its prefill chunks and fails only when it samples: it must not
    be cleared by the chunks and requeued forever."""
    import hwkv.engine.model_runner as mr

    real = mr.sample_tokens

    def sample_tokens(logits, batch, argmax=None):
        if any(sp.seed == 4242 for sp in batch.params):
            raise RuntimeError("sampler overflow")
        return real(logits, batch, argmax)

    monkeypatch.setattr(mr, "sample_tokens", sample_tokens)
    e = hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=128, max_num_batched_tokens=16)
    long = list(range(10, 50))  # 40 tokens: three chunks of <= 16
    e.add_request("ok", PROMPTS[0], GREEDY)
    e.add_request("bad", long, SamplingParams(temperature=0, max_tokens=4, seed=4242))
    e.add_request("ok2", PROMPTS[1], GREEDY)
    finals, errors = _finish_all(e, RuntimeError, "sampler overflow")
    assert errors == 1 and finals["bad"].finish_reason == "error" and "sampler overflow" in finals["bad"].error
    assert finals["ok"].finish_reason == finals["ok2"].finish_reason == "length"
    _no_leak(e)


def test_generate_raises_a_batched_failure_once_and_the_engine_stays_usable(model_dir, monkeypatch):
    e = _engine(model_dir)
    _poison(e, monkeypatch, "1")  # generate()'s second request
    with pytest.raises(RuntimeError, match="poisoned row"):
        e.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    _no_leak(e)
    assert [o.finish_reason for o in e.generate(PROMPTS[:2], GREEDY, use_tqdm=False)] == ["length"] * 2


def test_a_detokenizer_failure_fails_only_its_request(model_dir, monkeypatch):
    from hwkv.engine.detokenizer import IncrementalDetokenizer

    real = IncrementalDetokenizer.add_tokens

    def add_tokens(self, token_ids, check_stop=True):
        if "BOOM" in self.stop:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")
        return real(self, token_ids, check_stop)

    monkeypatch.setattr(IncrementalDetokenizer, "add_tokens", add_tokens)
    e = _engine(model_dir)
    outs = e.generate(["hello there", "the sun"], [GREEDY, SamplingParams(temperature=0, stop=["BOOM"])],
                      use_tqdm=False)
    assert outs[0].finish_reason == "length" and outs[1].finish_reason == "error"
    assert "detokenizing failed: UnicodeDecodeError" in outs[1].error
    _no_leak(e)


def _fail_once(e: hwkv.Engine, monkeypatch) -> None:
    real = e.runner.execute_async

    def boom(so):
        monkeypatch.setattr(e.runner, "execute_async", real)
        raise RuntimeError("transient device error")

    monkeypatch.setattr(e.runner, "execute_async", boom)
    with pytest.raises(RuntimeError, match="transient"):
        e.step()


def test_blocks_a_failed_step_was_to_fill_are_not_left_in_the_prefix_cache(model_dir, monkeypatch):
    prompt = list(range(20, 50))  # 30 tokens: blocks of 4 registered when the prefill is scheduled
    want = _engine(model_dir, block_size=4).generate([prompt], GREEDY, use_tqdm=False)[0].token_ids
    e = _engine(model_dir, block_size=4)
    e.add_request("a", prompt, GREEDY)
    _fail_once(e, monkeypatch)  # the prefill never wrote its KV
    assert not e.kv_cache_manager.block_pool.cached_block_hash_to_block  # nothing left to hit
    e.add_request("b", prompt, GREEDY)  # would hit the never-written blocks
    finals = {o.request_id: o.token_ids for rid, outs in _drain(e).items() for o in outs if o.finished}
    assert finals == {"a": want, "b": want}
    _no_leak(e)


def test_a_seeded_request_draws_the_same_tokens_after_a_failed_step(model_dir, monkeypatch):
    sp = SamplingParams(temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    want = _engine(model_dir).generate([PROMPTS[0]], sp, use_tqdm=False)[0].token_ids
    e = _engine(model_dir)
    e.add_request("s", PROMPTS[0], sp)
    for _ in range(4):
        e.step()
    _fail_once(e, monkeypatch)  # requeued: recompute keeps its generator, as a preemption does
    (final,) = [o for o in _drain(e)["s"] if o.finished]
    assert final.token_ids == want
    _no_leak(e)


def test_a_seed_the_generator_rejects_past_validation_ends_only_its_request(model_dir):
    """The issue's jam: a seed torch cannot take (mutated after validation) made every step raise
    "Overflow when unpacking long long" forever. Now: one raised step, then that request alone fails."""
    e = _engine(model_dir)
    bad = SamplingParams(temperature=1.0, seed=1, max_tokens=4)
    e.add_request("ok", PROMPTS[0], GREEDY)
    e.add_request("bad", PROMPTS[1], bad)
    bad.seed = 2**70  # bypasses SamplingParams validation
    finals, errors = _finish_all(e, ValueError, "Overflow")
    assert errors == 1
    assert finals["bad"].finish_reason == "error" and "Overflow" in finals["bad"].error
    assert finals["ok"].finish_reason == "length" and len(finals["ok"].token_ids) == GREEDY.max_tokens
    _no_leak(e)
