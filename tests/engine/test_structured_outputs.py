"""Structured outputs in the engine: grammars (llguidance) become a token bitmask the sampler applies
— valid answers under sync and async scheduling, across preemption, compiled grammars cached, no
matcher left behind; refused by name with speculative decoding; logit_bias."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

import hwkv
from hwkv.model.sampler import apply_token_bitmask
from hwkv.model.tiny import write_tiny_model

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "ok", "tag"],
          "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 9999}, "ok": {"type": "boolean"},
                         "tag": {"enum": ["a", "bb", "ccc"]}}}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("so") / "tiny", seed=0, max_position_embeddings=512)


def valid(text: str) -> bool:
    v = json.loads(text)
    return set(v) == {"id", "ok", "tag"} and type(v["id"]) is int and 0 <= v["id"] <= 9999 \
        and type(v["ok"]) is bool and v["tag"] in ("a", "bb", "ccc")


def test_bitmask_matches_a_reference_and_keeps_logits_elsewhere():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 70, generator=g)
    allowed = torch.rand(3, 70, generator=g) < 0.3
    words = torch.zeros(3, 3, dtype=torch.int64)
    for r, t in allowed.nonzero().tolist():
        words[r, t // 32] |= 1 << (t % 32)
    mask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # int32 two's complement
    for vocab in (70, 65):  # the last word partly past the vocabulary
        out = apply_token_bitmask(logits[:, :vocab], mask)
        want = allowed[:, :vocab]
        assert torch.equal(out[want], logits[:, :vocab][want]) and bool((out[~want] == float("-inf")).all())
        assert not bool((logits == float("-inf")).any())  # out of place: logprobs keep the raw distribution


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_json_schema_answers_are_valid_and_nothing_is_left(model, async_scheduling):
    e = hwkv.Engine(model, backend="cpu", num_kv_blocks=64, max_num_seqs=16, async_scheduling=async_scheduling)
    sp = [hwkv.SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs={"json": SCHEMA})
          for i in range(24)]
    outs = e.generate(["Give JSON:"] * 24, sp, use_tqdm=False)
    for o in outs:
        assert o.finish_reason == "stop" and valid(o.text), o.text
    assert e.runner.structured.num_compiled == 1  # one grammar, compiled once, copied per request
    assert not e.runner.structured.matchers and e.kv_cache_manager.num_free_blocks == 64
    free = e.generate(["Give JSON:"], hwkv.SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    assert free.text and not free.text.startswith("{")  # unconstrained requests are untouched


def test_async_equals_sync_and_preemption_restarts_the_matcher(model):
    sp = [hwkv.SamplingParams(temperature=1.0, seed=i, max_tokens=100, structured_outputs={"json": SCHEMA})
          for i in range(12)]
    want = [o.text for o in hwkv.Engine(model, backend="cpu", num_kv_blocks=128, max_num_seqs=16).generate(
        ["Give JSON:"] * 12, sp, use_tqdm=False)]
    got = hwkv.Engine(model, backend="cpu", num_kv_blocks=128, max_num_seqs=16, async_scheduling=True).generate(
        ["Give JSON:"] * 12, sp, use_tqdm=False)
    assert [o.text for o in got] == want
    tight = hwkv.Engine(model, backend="cpu", num_kv_blocks=10, block_size=16, max_num_seqs=12)
    got = tight.generate(["Give JSON:"] * 12, sp, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    assert [o.text for o in got] == want  # a preempted request recomputes and re-matches its tokens
    assert not tight.runner.structured.matchers


def test_prefetched_masks_equal_masks_computed_in_the_step(model):
    """The worker's masks (computed while the next forward runs) are the ones the step would compute:
    same answers as an engine that computes every mask in the step, constrained and free rows mixed."""
    sp = [hwkv.SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=[
        {"json": SCHEMA}, {"regex": "[a-z]{3,40}"}, None][i % 3]) for i in range(12)]
    ref = hwkv.Engine(model, backend="cpu", num_kv_blocks=128, max_num_seqs=16)
    ref.runner.structured.overlap = False
    want = [o.text for o in ref.generate(["Give JSON:"] * 12, sp, use_tqdm=False)]
    assert ref.runner.structured.rows_prefetched == 0
    for async_scheduling in (False, True):
        e = hwkv.Engine(model, backend="cpu", num_kv_blocks=128, max_num_seqs=16, async_scheduling=async_scheduling)
        assert [o.text for o in e.generate(["Give JSON:"] * 12, sp, use_tqdm=False)] == want
        so = e.runner.structured
        # every mask from the worker: a request's first one beside its prefill, the others beside the next forward
        assert so.rows_computed == 0 and so.rows_prefetched > 8 * 10, (so.rows_computed, so.rows_prefetched)
        assert not so.matchers
        e.close()
        assert so._worker is None


def test_draws_made_before_the_mask_give_the_same_tokens(model, monkeypatch):
    """The runner launches a masked step's random draws before it waits for the mask: the same
    generators in the same order, so the same answers as draws made inside the sampler."""
    import hwkv.engine.model_runner as mr

    sp = [hwkv.SamplingParams(temperature=1.0, seed=i if i % 2 else None, max_tokens=40,
                              structured_outputs={"json": SCHEMA}) for i in range(6)]
    texts = []
    for early in (True, False):
        if not early:
            monkeypatch.setattr(mr, "draw_uniforms", lambda batch, device: None)
        torch.manual_seed(7)  # the unseeded rows draw from torch's default generator
        e = hwkv.Engine(model, backend="cpu", num_kv_blocks=64, max_num_seqs=8, async_scheduling=True)
        texts.append([o.text for o in e.generate(["Give JSON:"] * 6, sp, use_tqdm=False)])
        e.close()
    assert texts[0] == texts[1] and all(valid(t) for t in texts[0])


def test_prefetch_with_aborts_and_reused_slots(model):
    """Requests aborted while the worker fills their next masks, and new requests taking their slots
    at once: every answer equals the one of an engine computing each mask in the step, nothing left."""
    def run(prefetch: bool) -> dict[str, str]:
        e = hwkv.Engine(model, backend="cpu", num_kv_blocks=128, max_num_seqs=6, async_scheduling=True)
        if not prefetch:
            e.runner.structured.overlap = False
        sp = lambda i: hwkv.SamplingParams(temperature=1.0, seed=i, max_tokens=50,  # noqa: E731
                                           structured_outputs={"json": SCHEMA})
        texts, n = {}, 0
        for i in range(6):
            e.add_request(f"r{i}", "Give JSON:", sp(i))
        for step in range(400):
            if step % 3 == 2 and n < 12:  # abort the lowest live request, start two new ones in its slot's place
                live = sorted(e._live, key=lambda r: int(r[1:]))
                if live:
                    e.abort(live[0])
                for _ in range(2):
                    e.add_request(f"r{6 + n}", "Give JSON:", sp(6 + n))
                    n += 1
            for o in e.step():
                if o.finished:
                    texts[o.request_id] = (o.finish_reason, o.text)
            if not e.has_unfinished():
                break
        so = e.runner.structured
        assert not e.has_unfinished() and not so.matchers and e.kv_cache_manager.num_free_blocks == 128
        assert (so.rows_prefetched > 0) == prefetch
        e.close()
        return texts

    got, want = run(True), run(False)
    assert got == want and len(got) == 18
    assert sum(r == "abort" for r, _ in got.values()) >= 4
    assert all(valid(t) for r, t in got.values() if r == "stop")


def test_matchers_of_their_own_are_reused_and_answer_as_copies(model):
    """Each request gets a matcher with a lexer of its own (not a copy sharing the cached one's lexer
    lock), reset and reused when its request ends (after the worker's next join): no more built than
    ran at once plus those that ended in the same step, none for a second batch, the same answers."""
    seqs = 6
    sp = [hwkv.SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs={"json": SCHEMA})
          for i in range(20)]
    e = hwkv.Engine(model, backend="cpu", num_kv_blocks=128, max_num_seqs=seqs, async_scheduling=True)
    so = e.runner.structured
    got = [o.text for o in e.generate(["Give JSON:"] * 20, sp, use_tqdm=False)]
    # The first `seqs` requests start in one step with no idle matcher: each builds one. A matcher is reused
    # only once the worker's next join has retired its request, so a request that starts in the step its
    # predecessor ended builds one more: at most one per running slot plus one per slot ended in that step.
    # Which of those happen depends on whether the worker thread's job was done at the drop (timing), so the
    # count is a range, not one number; without the reuse it would be 20.
    assert seqs <= so.num_matchers <= 2 * seqs and so.num_compiled == 1
    so.join()  # the last requests' matchers become idle once the worker's last job is joined
    idle = so._entry({"json": SCHEMA})[1]
    assert len(idle) == so.num_matchers and not so.matchers and not so._retired
    assert [o.text for o in e.generate(["Give JSON:"] * 20, sp, use_tqdm=False)] == got
    so.join()
    assert len(idle) == so.num_matchers <= 2 * seqs  # the second run built none
    so.shared_lexer = True  # the copies' path (llguidance deep_copy): the same answers
    assert [o.text for o in e.generate(["Give JSON:"] * 20, sp, use_tqdm=False)] == got
    e.close()


def test_worker_rows_in_place_equal_masks_computed_in_the_step(model):
    """With staging buffers (a device with asynchronous copies, mocked on the host), a decode step of the
    same requests in the same order takes the worker's rows where it wrote them; every step's mask equals
    the one computed in the step; a changed batch (a request gone) falls back to the gather."""
    import types

    from hwkv.engine.structured import StructuredOutputs
    from hwkv.model.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(model)
    dev = types.SimpleNamespace(async_copies=True, torch_device=torch.device("cpu"),
                                host_empty=lambda shape, dtype: torch.empty(shape, dtype=dtype))
    specs = [{"json": SCHEMA}, {"regex": "[a-z]{3,40}"}, {"json": SCHEMA}, {"choice": ["north", "south"]}]
    got, want = [], []
    for overlap, masks in ((True, got), (False, want)):
        so = StructuredOutputs(tok, tok.vocab_size, (tok.eos_token_id,))
        so.overlap = overlap
        ids, slots, outs = [f"r{i}" for i in range(4)], [5, 2, 7, 0], {f"r{i}": [] for i in range(4)}
        for rid, spec, slot in zip(ids, specs, slots):
            so.add(rid, spec, slot)
        so.start_fresh()
        for step in range(12):
            if step == 6:  # one request leaves: the next step's batch differs from the prediction
                so.drop(ids[1])
                ids, slots = [ids[0], *ids[2:]], [slots[0], *slots[2:]]
            m = so.bitmask(ids, [outs[r] for r in ids], dev, slots).clone()
            masks.append(m)
            bits = np.unpackbits(m.view(torch.uint8).numpy(), axis=1, bitorder="little")
            toks = [int(np.flatnonzero(row)[0]) for row in bits]  # the lowest allowed token (EOS once done)
            n_before = [len(outs[r]) for r in ids]
            for r, t in zip(ids, toks):
                outs[r].append(t)
            so.prefetch(ids, slots, n_before, torch.tensor(toks), None)
        so.close()
        if overlap:
            assert so.rows_in_place >= 3 * 5 and so.rows_computed == 0
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))


def test_gil_switch_interval_is_short_only_while_constrained_requests_run(model):
    import sys

    e = hwkv.Engine(model, backend="cpu", num_kv_blocks=64, max_num_seqs=4, async_scheduling=True)
    so, before, seen = e.runner.structured, sys.getswitchinterval(), []
    so.switch_s = 1e-4
    inner = so.bitmask
    so.bitmask = lambda *a, **k: (seen.append(sys.getswitchinterval()), inner(*a, **k))[1]
    sp = [hwkv.SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs={"json": SCHEMA})
          for i in range(4)]
    e.generate(["Give JSON:"] * 4, sp, use_tqdm=False)
    assert seen and all(abs(s - 1e-4) < 1e-9 for s in seen)  # from the first worker job (beside the prefill) on
    assert sys.getswitchinterval() == before
    e.close()
    assert sys.getswitchinterval() == before


def test_regex_choice_grammar_and_errors(model):
    e = hwkv.Engine(model, backend="cpu", num_kv_blocks=64, max_num_seqs=8)
    so = [{"regex": r"[a-c]{2}-[0-9]{2}"}, {"choice": ["north", "south"]}, {"grammar": 'start: "x" ("y" | "z")+ "."'}]
    outs = e.generate(["Go:"] * 3, [hwkv.SamplingParams(temperature=1.0, seed=3, max_tokens=60, structured_outputs=s)
                                    for s in so], use_tqdm=False)
    assert re.fullmatch(r"[a-c]{2}-[0-9]{2}", outs[0].text) and outs[1].text in ("north", "south")
    assert re.fullmatch(r"x[yz]+\.", outs[2].text)
    for bad, what in [({"regex": "(("}, "regex is invalid"), ({"json": 3}, "json is invalid"),
                      ({"regex": "a", "choice": ["b"]}, "exactly one"), ({"xml": "a"}, "unknown key")]:
        with pytest.raises(ValueError, match=what):
            e.add_request("bad", "Go:", hwkv.SamplingParams(structured_outputs=bad))
    assert not e.has_unfinished()


def test_refused_with_speculative_decoding(model):
    e = hwkv.Engine(model, backend="cpu", num_kv_blocks=64, speculative_config={"method": "ngram",
                                                                                 "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="not supported with speculative decoding"):
        e.add_request("r", "Hi", hwkv.SamplingParams(structured_outputs={"choice": ["a"]}))


def test_logit_bias(model):
    e = hwkv.Engine(model, backend="cpu", num_kv_blocks=64)
    out = e.generate(["Hi"], hwkv.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={42: 100}),
                     use_tqdm=False)[0]
    assert out.token_ids == [42] * 4
    with pytest.raises(ValueError, match="logit_bias"):
        hwkv.SamplingParams(logit_bias={1: 101})
    with pytest.raises(ValueError, match="logit_bias"):
        e.add_request("x", "Hi", hwkv.SamplingParams(logit_bias={10_000: 1.0}))


def test_bench_structured_runs_on_the_tiny_shape(tmp_path):
    import argparse

    from hwkv.bench import structured as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--model", "tiny", "--backend", "cpu", "--dtype", "float32", "--batch", "4", "--input-len",
                         "8", "--output-len", "12", "--repeat", "1", "--workdir", str(tmp_path / "m"),
                         "--out-dir", str(tmp_path / "out")])
    assert bench.run(args) == 0
    (res,) = (tmp_path / "out").glob("structured-tiny-*.json")
    doc = json.loads(res.read_text())
    assert set(doc["results"]) == {"free", "string", "records"} and doc["results"]["free"]["tokens"] == 48
    assert doc["results"]["records"]["tokens"] == 48  # minItems 40: no answer ends early
    assert all(r["mask_ms_per_step"] > 0 for k, r in doc["results"].items() if k != "free")
    tok = bench.synthetic_tokenizer(1000)
    assert tok.get_vocab_size() == 1000 and tok.decode(tok.encode("hello world").ids) == "hello world"


def test_bench_structured_mask_only_times_rows_of_a_checkpoint_vocab(tmp_path):
    import argparse

    from hwkv.bench import structured as bench

    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "config.json").write_text(json.dumps({"vocab_size": 1000}))
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    args = p.parse_args(["--model", str(tmp_path / "ck"), "--mask-only", "5", "--batch", "3", "--schemas", "records",
                         "--thread-counts", "2", "--out-dir", str(tmp_path / "out")])
    assert bench.run(args) == 0
    doc = json.loads((tmp_path / "out" / "structured-mask-only-ck.json").read_text())
    assert doc["vocab"] == 1000 and sorted(doc["results"]) == [
        f"records/{kind}/{label}" for kind in ("copies", "own") for label in ("1 thread", "executor 2 threads")]
    for kind in ("own", "copies"):
        one = doc["results"][f"records/{kind}/1 thread"]
        assert one["steps"] == 5 and doc["results"][f"records/{kind}/executor 2 threads"]["mean_ms"] > 0
        p50, p90, p99, top = one["row_ms_p50_p90_p99_max"]
        assert 0 < p50 <= p90 <= p99 <= top and 0 < one["slowest_row_mean_ms"] <= top


def test_graph_replayed_decode_steps_apply_the_mask(model):
    """Through captured decode graphs (the CPU backend that records and replays them) with async
    scheduling: the same valid answers as eager."""
    from hwkv.reference.graphs import GraphCpuBackend

    sp = [hwkv.SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs={"json": SCHEMA})
          for i in range(6)]
    want = [o.text for o in hwkv.Engine(model, backend="cpu", num_kv_blocks=64, max_num_seqs=8).generate(
        ["Give JSON:"] * 6, sp, use_tqdm=False)]
    e = hwkv.Engine(model, backend=GraphCpuBackend(), num_kv_blocks=64, max_model_len=256, max_num_seqs=8,
                    fuse_elementwise=False)
    got = e.generate(["Give JSON:"] * 6, sp, use_tqdm=False)
    assert e.async_scheduling and e.runner.num_graph_steps > 10
    assert [o.text for o in got] == want and all(valid(t) for t in want)
