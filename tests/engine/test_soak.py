"""Soak: randomized add_request / step / abort / generate / invalid requests over several engine
configurations (preemption, chunked prefill, prefix caching, cache salts, stop strings, stop and
EOS tokens, async scheduling, reused ids).

Every request's prompt comes from a fixed pool whose output is known from an oracle run, so each
output is checked against *its own* prompt: a streamed output must be a prefix of it, a final one
must be exactly what the stop conditions cut from it (an abort: a prefix). After each run every
block is free with ref count 0 and no request or id is tracked anywhere (engine, scheduler, cache
manager, runner). Bounded: a fixed number of actions per run, cut short by a per-run deadline
(8 runs, ~1 minute at most on CI's 2 cores); runs in CI, not marked slow.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass

import pytest

import hwkv
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams

MAX_TOKENS = 24
MAX_MODEL_LEN = 96
ACTIONS = 400  # per run
RUN_DEADLINE_S = 7.0  # per run's actions (draining comes on top): a slow machine does fewer
NUM_PROMPTS = 16


@dataclass
class _Case:
    prompt: list[int]
    params: SamplingParams  # oracle params: max_tokens=MAX_TOKENS, ignore_eos
    tokens: list[int]  # oracle output
    text: str


@dataclass
class _Expect:
    case: _Case
    params: SamplingParams
    salt: str | None


def _prompts(rng: random.Random) -> list[list[int]]:
    systems = [[rng.randrange(3, 500) for _ in range(n)] for n in (24, 17)]
    out = []
    for i in range(NUM_PROMPTS):
        tail = [rng.randrange(3, 500) for _ in range(rng.randint(1, 30))]
        out.append((systems[i % 3] if i % 3 < 2 else []) + tail)  # two shared prefixes, some alone
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Per architecture: (model dir, oracle cases). The oracle engine has a roomy pool and runs the
    whole prompt pool at once, so it batches differently from every soak run."""
    root = tmp_path_factory.mktemp("soak")
    out = {}
    for arch in ("llama", "qwen2"):
        d = str(write_tiny_model(root / arch, arch=arch, max_position_embeddings=MAX_MODEL_LEN, seed=3))
        rng = random.Random(arch)
        prompts = _prompts(rng)
        params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True) if i % 4 else
                  SamplingParams(temperature=0.8, top_k=40, seed=1000 + i, max_tokens=MAX_TOKENS, ignore_eos=True)
                  for i in range(len(prompts))]
        e = hwkv.Engine(d, num_kv_blocks=256, max_model_len=MAX_MODEL_LEN, enable_prefix_caching=False)
        outs = e.generate(prompts, params, use_tqdm=False)
        out[arch] = (d, [_Case(p, sp, o.token_ids, o.text) for p, sp, o in zip(prompts, params, outs)])
    return out


CONFIGS = [  # (arch, engine kwargs); pools small enough to preempt
    ("llama", dict(block_size=8, num_kv_blocks=30, max_num_batched_tokens=32, max_num_seqs=8)),
    ("qwen2", dict(block_size=4, num_kv_blocks=60, max_num_batched_tokens=24, long_prefill_token_threshold=8,
                   max_num_partial_prefills=2, async_scheduling=True)),
    ("llama", dict(block_size=16, num_kv_blocks=14, enable_chunked_prefill=False, enable_prefix_caching=False,
                   max_num_seqs=4)),
    ("qwen2", dict(block_size=8, num_kv_blocks=24, max_num_batched_tokens=16, async_scheduling=True,
                   max_num_seqs=6)),
]


def _expected(case: _Case, sp: SamplingParams, eos: frozenset[int]) -> tuple[list[int], str]:
    toks: list[int] = []
    for t in case.tokens:
        toks.append(t)
        if (not sp.ignore_eos and t in eos) or t in sp.stop_token_ids:
            return toks, "stop"
        if len(toks) == sp.max_tokens:
            break
    return toks, "length"


class _Soak:
    def __init__(self, e: hwkv.Engine, cases: list[_Case], rng: random.Random):
        self.e, self.cases, self.rng = e, cases, rng
        self.live: dict[str, _Expect] = {}
        self.finished: list[str] = []  # ids whose final output was returned (reusable)
        self.n = 0
        self.counts = dict(final=0, aborted=0, invalid=0, generated=0, stop_strings=0, failed_steps=0)

    # ---- requests ----------------------------------------------------------------------------
    def _params(self, case: _Case) -> SamplingParams:
        rng, base = self.rng, case.params
        kw = dict(temperature=base.temperature, top_k=base.top_k, seed=base.seed,
                  max_tokens=rng.randint(1, MAX_TOKENS), ignore_eos=rng.random() < 0.7)
        r = rng.random()
        if r < 0.2 and len(case.tokens) > 3:
            kw["stop_token_ids"] = [case.tokens[rng.randrange(1, len(case.tokens))]]
        elif r < 0.4 and len(case.text) > 6:
            i = rng.randrange(1, len(case.text) - 3)
            kw.update(stop=[case.text[i : i + rng.randint(1, 3)]], max_tokens=MAX_TOKENS)
        return SamplingParams(**kw)

    def _new_id(self) -> str:
        if self.finished and self.rng.random() < 0.5:  # reuse an id whose final output was returned
            return self.finished.pop(self.rng.randrange(len(self.finished)))
        self.n += 1
        return str(self.n) if self.n % 2 else f"r{self.n}"  # numeric ids: the ones generate() hands out

    def add(self) -> None:
        case = self.rng.choice(self.cases)
        sp = self._params(case)
        salt = self.rng.choice([None, None, "tenant-a", "tenant-b"])
        sp.cache_salt = salt
        rid = self._new_id()
        self.e.add_request(rid, case.prompt, sp)
        self.live[rid] = _Expect(case, sp, salt)

    def invalid(self) -> None:
        rng, e = self.rng, self.e
        before = (len(e._tracked), len(e.scheduler.requests), e.kv_cache_manager.num_free_blocks)
        case = rng.choice(self.cases)
        bad = rng.randrange(7)
        rid, prompt, sp = f"bad{self.n}", case.prompt, SamplingParams(max_tokens=4)
        if bad == 0:
            prompt = []
        elif bad == 1:
            prompt = case.prompt + [e.vocab_size]
        elif bad == 2:
            sp = SamplingParams(max_tokens=MAX_MODEL_LEN)  # prompt + max_tokens > max_model_len
        elif bad == 3:
            sp.seed = 2**70  # mutated after construction: refused by add_request
        elif bad == 4 and self.live:
            rid = rng.choice(sorted(self.live))  # in use
        elif bad == 5:
            prompt = "a\ud800b"  # the tokenizer cannot encode it
        else:
            sp.temperature = -1.0
        with pytest.raises(ValueError):
            if bad == 6 and rng.random() < 0.5:  # a batch with one bad prompt: generate() rolls back all
                e.generate([case.prompt, prompt], [SamplingParams(max_tokens=2), sp], use_tqdm=False)
            else:
                e.add_request(rid, prompt, sp)
        assert (len(e._tracked), len(e.scheduler.requests), e.kv_cache_manager.num_free_blocks) == before
        self.counts["invalid"] += 1

    def abort(self) -> None:
        ids = sorted(self.live)
        if not ids:
            return
        rid = self.rng.choice(ids)
        self.e.abort(rid if self.rng.random() < 0.8 else "never-added")
        if rid in self.e._live:
            return
        with pytest.raises(ValueError, match="already in use"):  # reserved until step() returns the abort
            self.e.add_request(rid, self.cases[0].prompt, SamplingParams(max_tokens=2))

    def generate(self) -> None:
        cases = [self.rng.choice(self.cases) for _ in range(self.rng.randint(1, 3))]
        params = [self._params(c) for c in cases]
        for out, c, sp in zip(self.e.generate([c.prompt for c in cases], params, use_tqdm=False), cases, params):
            assert out.request_id not in self.live  # generate() never hands out a live id
            self._check_final(out, _Expect(c, sp, None))
            self.counts["generated"] += 1

    # ---- outputs -----------------------------------------------------------------------------
    def failing_step(self) -> None:
        """A transient failure (a device error, say) of one step: rolled back, raised, recomputed."""
        e = self.e
        if e.scheduler.suspects or not e.scheduler.has_unfinished_requests():
            return self.step()  # (a failure while a suspect runs alone would be that request's)
        real = e.runner.execute_async

        def boom(so):
            raise RuntimeError("transient device error")

        e.runner.execute_async = boom
        try:
            with pytest.raises(RuntimeError, match="transient device error"):
                self.step()
        finally:
            e.runner.execute_async = real
        self.counts["failed_steps"] += 1

    def step(self) -> None:
        for out in self.e.step():
            exp = self.live.get(out.request_id)
            assert exp is not None, f"output for {out.request_id!r}, which is not live: {out}"
            assert out.prompt_token_ids == exp.case.prompt  # its own prompt
            assert out.token_ids == exp.case.tokens[: len(out.token_ids)], out  # a prefix of its own output
            if out.finished:
                self._check_final(out, exp)
                del self.live[out.request_id]
                self.finished.append(out.request_id)

    def _check_final(self, out, exp: _Expect) -> None:
        want, reason = _expected(exp.case, exp.params, self.e.eos_token_ids)
        assert out.error is None, out.error
        if out.finish_reason == "abort":
            assert out.token_ids == want[: len(out.token_ids)]
            self.counts["aborted"] += 1
        elif exp.params.stop:
            self.counts["stop_strings"] += 1
            stop = exp.params.stop[0]
            assert out.token_ids == exp.case.tokens[: len(out.token_ids)]
            if out.finish_reason == "stop" and out.stop_reason == stop:
                assert exp.case.text.startswith(out.text) and stop not in out.text
            else:  # EOS / stop token / length before the stop string showed up
                assert (out.token_ids, out.finish_reason) == (want, reason) and stop not in out.text
        else:
            assert (out.token_ids, out.finish_reason) == (want, reason), (out, exp.params)
        self.counts["final"] += 1

    def drain(self) -> None:
        for _ in range(2000):
            if not self.e.has_unfinished():
                break
            self.step()
        assert not self.live, f"never finished: {sorted(self.live)}"
        self.step()  # async: the step launched after the last finish carries nothing


def _assert_nothing_tracked(e: hwkv.Engine) -> None:
    kv, s, r = e.kv_cache_manager, e.scheduler, e.runner
    assert not e.has_unfinished() and not e._tracked and not e._live and not e._pending
    assert kv.num_free_blocks == e.kv_cache.spec.num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert not kv.req_to_blocks and not kv.num_cached_block
    assert not s.requests and not s.waiting and not s.running and not s.delayed_free and not s.suspects
    assert not s._num_slots and not s.finished_recving
    assert not r.reqs and not r.generators and len(r.free_slots) == e.scheduler.config.max_num_seqs


def test_soak(models):
    totals: dict[str, int] = {}
    preemptions = hits = 0
    for seed, (arch, kw) in enumerate(CONFIGS * 2):
        d, cases = models[arch]
        e = hwkv.Engine(d, max_model_len=MAX_MODEL_LEN, **kw)
        soak = _Soak(e, cases, random.Random(seed))
        t_end = time.monotonic() + RUN_DEADLINE_S
        for _ in range(ACTIONS):
            if time.monotonic() > t_end:
                break
            x = soak.rng.random()
            if x < 0.30:
                soak.add()
            elif x < 0.36:
                soak.abort()
            elif x < 0.41:
                soak.invalid()
            elif x < 0.43:
                soak.generate()
            elif x < 0.45:
                soak.failing_step()
            else:
                soak.step()
        soak.drain()
        _assert_nothing_tracked(e)
        preemptions += e.scheduler.num_preemptions
        hits += e.stats()["prefix_cache_hits"]
        for k, v in soak.counts.items():
            totals[k] = totals.get(k, 0) + v
    assert preemptions > 0 and hits > 0, (preemptions, hits)
    assert totals["final"] > 100 and totals["aborted"] > 5 and totals["invalid"] > 10, totals
    assert totals["generated"] > 0 and totals["stop_strings"] > 5 and totals["failed_steps"] > 5, totals
