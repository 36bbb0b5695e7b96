"""KV-cache groups through the engine (docs/hybrid-models.md): windowed models with a KV cache, a block
pool and a block table per group give transformers' greedy tokens under prefix caching, chunking and
preemption; a window group holds at most its window plus one step's blocks per request; every block of
every group is free at the end; what cannot run with groups is refused by name."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hwkv  # noqa: E402
from hwkv.core.kv_groups import GroupedKVCacheManager  # noqa: E402
from hwkv.engine.kv_groups import GroupedKVCache, plan_groups  # noqa: E402
from tests.engine.test_engine_parity import CASES, NEW_TOKENS, PROMPTS, _hf_model, _saved_with_reference  # noqa: E402

WINDOW = 8  # _hf_model's windowed configs


@pytest.fixture(scope="module", params=["mistral-window", "gemma2", "gemma3", "gpt_oss"])
def window_case(request, tmp_path_factory):
    arch = request.param
    return arch, *_saved_with_reference(_hf_model(arch), tmp_path_factory.mktemp(f"hf-groups-{arch}"))


def _whole(engine) -> None:
    kv = engine.kv_cache_manager
    for m in kv.managers:
        assert m.block_pool.num_free_blocks == m.block_pool.num_usable_blocks
        assert not m.req_to_blocks
    assert not engine.runner.reqs and len(engine.runner.free_slots) == engine.config.scheduler.max_num_seqs


@pytest.mark.parametrize("case", list(CASES))
def test_grouped_greedy_parity_with_hf(window_case, case):
    arch, path, ref = window_case
    kw = CASES[case]
    engine = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, kv_cache_groups=True, **kw)
    kv, cache = engine.kv_cache_manager, engine.kv_cache
    assert isinstance(kv, GroupedKVCacheManager) and isinstance(cache, GroupedKVCache)
    windows = [g.window for g in engine.config.kv_groups]
    assert windows == ([WINDOW] if arch == "mistral-window" else [None, WINDOW])
    for g, c in zip(engine.config.kv_groups, cache.caches):  # each group's layers hold its pool's blocks
        assert c.spec.num_layers == len(g.layers) and c.spec.num_blocks == g.num_blocks
    bs = engine.block_size
    chunk = engine.config.scheduler.max_num_batched_tokens
    bound = -(-(WINDOW - 1 + min(chunk, 80)) // bs) + 1
    most = 0
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    computed: dict[str, int] = {}
    decodes = 0
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.token_ids)
        for r in engine.scheduler.running:  # the window group: the window and one step, not the context
            live = kv.num_live_blocks(r.request_id)
            most = max(most, live[-1])
            assert live[-1] <= bound, (r.request_id, live, r.num_computed_tokens)
            # a decode step (never preempted: a re-admission may look like one): its window and one block
            if r.num_computed_tokens == computed.get(r.request_id, -1) + 1 and not r.num_preemptions:
                assert live[-1] <= -(-WINDOW // bs) + 1, (r.request_id, live)  # (freed every step)
                decodes += 1
            computed[r.request_id] = r.num_computed_tokens
    assert [outs[str(i)] for i in range(len(PROMPTS))] == ref
    assert most > 0 and decodes > 0
    stats = engine.stats()
    if case == "default":
        assert stats["prefix_cache_hits"] > 0
    if case == "no_prefix_cache":
        assert stats["prefix_cache_hits"] == 0
    if case == "preemption" and arch != "mistral-window":  # the full group's 10 blocks run short
        assert stats["num_preemptions"] > 0
    assert [(g["window"], g["num_free_blocks"]) for g in stats["kv_groups"]] == [
        (g.window, g.num_blocks - (g.window is not None)) for g in engine.config.kv_groups]
    _whole(engine)


def test_groups_refused_by_name(window_case):
    arch, path, _ = window_case
    from hwkv.connectors.offload import OffloadConnector

    one_group = type("OneGroup", (OffloadConnector,), {"name": "one-group", "supports_kv_groups": False})
    with pytest.raises(ValueError, match=r"kv_cache_groups=True cannot be met: the 'one-group' KV connector "
                                         r"moves one block table per request"):
        hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64, kv_cache_groups=True,
                    kv_connector=one_group(cpu_bytes=1 << 20))
    if arch == "mistral-window":  # no full group to index a proposer's KV by (tests/spec_decode/test_spec_groups.py)
        with pytest.raises(ValueError, match=r"speculative decoding's 'draft_model' proposer indexes its KV"):
            hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64, kv_cache_groups=True,
                        speculative_config={"method": "draft_model", "num_speculative_tokens": 2, "model": path})
    # None: where possible; a connector without groups keeps one group of every layer
    e = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64, kv_cache_groups=None,
                    kv_connector=one_group(cpu_bytes=1 << 20))
    assert e.config.kv_groups == () and not isinstance(e.kv_cache, GroupedKVCache)
    e.close()
    # offload moves every group's blocks (tests/connectors/test_hybrid_differential.py)
    e = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64, kv_cache_groups=True,
                    kv_connector="offload", kv_connector_config={"cpu_bytes": 1 << 20})
    assert e.config.kv_groups and isinstance(e.kv_cache, GroupedKVCache)
    e.close()


def test_full_attention_model_refuses_groups(tmp_path):
    model = _hf_model("llama")
    model.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no sliding-window layers"):
        hwkv.Engine(str(tmp_path), backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64,
                    kv_cache_groups=True)
    e = hwkv.Engine(str(tmp_path), backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64,
                    kv_cache_groups=None)
    assert e.config.kv_groups == ()


def test_plan_groups_caps_window_groups():
    class Cfg:
        num_layers = 6

        @staticmethod
        def window_of(i):
            return None if i % 3 == 2 else 512

    class M:
        config = Cfg()

    full, win = plan_groups(M(), 10_000, 16, max_num_seqs=8, max_num_batched_tokens=2048)
    assert (full.window, full.layers, full.num_blocks) == (None, (2, 5), 10_000)
    # 8 requests x (ceil(511 / 16) + 2 blocks) + one step's 2048 tokens
    assert (win.window, win.layers, win.num_blocks) == (512, (0, 1, 3, 4), 8 * 34 + 128 + 1)  # + the null block
    assert plan_groups(M(), 100, 16, 8, 2048)[1].num_blocks == 101


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_grouped_graphs_match_hf(window_case, async_scheduling):
    """Decode and short-query graphs (emulated on the CPU) read each group's static block table and
    slot mapping: HF's tokens, served mostly by replays."""
    from hwkv.reference.graphs import GraphCpuBackend

    arch, path, ref = window_case
    if arch == "gpt_oss":
        pytest.skip("GPT-OSS's reference expert loop has data-dependent shapes: not capturable")
    torch.set_num_threads(1)
    e = hwkv.Engine(path, backend=GraphCpuBackend(), dtype="float32", max_model_len=80, num_kv_blocks=64,
                    block_size=4, max_num_seqs=8, fuse_elementwise=False, kv_cache_groups=True,
                    async_scheduling=async_scheduling)
    assert e.config.runtime.graphs and len(e.runner.graphs.dg64) == len(e.config.kv_groups) - 1
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    e.generate(PROMPTS[:1], params, use_tqdm=False)  # cached: later prompts sharing it run their tails
    outs = e.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert e.runner.num_graph_steps > 0
    _whole(e)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_grouped_random_traces_match_one_group(window_case, seed):
    """Differential random traces: prompts over shared prefixes (prefix hits per group), random lengths,
    chunking, a pool small enough to preempt and evict, and random aborts, through the grouped engine
    and a plain one (one group of every layer, no prefix cache): identical tokens for every request
    that finished, and every block of every group free at the end."""
    import random

    arch, path, _ = window_case
    rng = random.Random(seed)
    reqs, aborts, want = make_random_trace(rng, path, 16, 12, max_model_len=64)
    e = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=64, num_kv_blocks=16, block_size=4,
                    max_num_batched_tokens=rng.choice([16, 24, 80]), kv_cache_groups=True)
    run_random_trace(e, reqs, want, aborts, rng)
    st = e.stats()
    assert st["prefix_cache_hits"] > 0
    if arch != "mistral-window":  # the full group's 16 blocks run short (windows alone stop growing)
        assert st["num_preemptions"] > 0
    _whole(e)


@pytest.mark.parametrize("graphs", [False, True])
def test_grouped_ngram_speculation_matches_hf(window_case, graphs):
    """N-gram speculative decoding (no proposer KV) with KV-cache groups: verify steps (eager, and the
    verify graphs emulated on the CPU) write and read each group's blocks; HF's greedy tokens."""
    from hwkv.reference.graphs import GraphCpuBackend

    arch, path, ref = window_case
    if graphs and arch == "gpt_oss":
        pytest.skip("GPT-OSS's reference expert loop has data-dependent shapes: not capturable")
    torch.set_num_threads(1)
    e = hwkv.Engine(path, backend=GraphCpuBackend() if graphs else "cpu", dtype="float32", max_model_len=80,
                    num_kv_blocks=64, block_size=4, max_num_seqs=8, fuse_elementwise=False, kv_cache_groups=True,
                    speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1})
    assert e.config.kv_groups
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = e.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert e.stats()["spec_decode"]["draft_tokens"] > 0
    if graphs:
        assert e.runner.num_verify_graph_steps > 0
    _whole(e)


def test_grouped_fp8_kv_matches_one_group(window_case):
    """An fp8 KV cache with groups: each group's layers keep their scales; the tokens of one group."""
    _, path, _ = window_case
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = []
    for groups in (False, True):
        e = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64,
                        kv_cache_dtype="fp8", kv_cache_scales=0.5, kv_cache_groups=groups)
        assert bool(e.config.kv_groups) == groups
        assert all(float(e.kv_cache.layer_scales(i).min()) == 0.5 for i in range(e.model.config.num_layers))
        outs.append([o.token_ids for o in e.generate(PROMPTS, params, use_tqdm=False)])
    assert outs[0] == outs[1]


def test_fused_elementwise_keeps_each_family_math(window_case):
    """The fused elementwise ops (on with graphs on a GPU) patch only the modules whose math they
    compute: Gemma's (1 + w) norms get their own fused form, GELU MLPs stay as they are. (They once
    replaced Gemma's norms and MLPs by Llama's: wrong from the first token on the H200.) Through
    torch.compile's eager backend: no compiler needed."""
    from hwkv.model.fuse import fuse_elementwise

    _, path, ref = window_case
    torch._dynamo.reset()
    try:
        e = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64)
        assert fuse_elementwise(e.model, backend="eager") > 0
        params = hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        assert [o.token_ids for o in e.generate(PROMPTS, params, use_tqdm=False)] == ref
    finally:
        torch._dynamo.reset()


def test_long_prompt_fits_a_window_group_sized_for_windows(window_case):
    """A prompt far longer than a window group's pool (sized for windows and one step, not contexts)
    is admitted under whole-prompt reservation and prefilled in chunks: the window group is asked for
    one step's blocks (earlier chunks leave the window first). HF's tokens, every pool whole."""
    arch, path, ref = window_case
    i = max(range(len(PROMPTS)), key=lambda j: len(PROMPTS[j]))
    e = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=20, block_size=4,
                    max_num_seqs=1, max_num_batched_tokens=8, kv_cache_groups=True)
    win = e.config.kv_groups[-1]
    assert win.window == WINDOW
    if arch != "mistral-window":  # (windows only: the window group has the whole pool)
        assert (win.num_blocks - 1) * 4 < len(PROMPTS[i])  # the pool holds less than the prompt
    assert e.config.scheduler.reserve_full_prompt
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    assert e.generate([PROMPTS[i]], params, use_tqdm=False)[0].token_ids == ref[i]
    _whole(e)


def test_gpt_oss_runs_eagerly_where_graphs_are_offered(tmp_path):
    """GPT-OSS's reference expert loop cannot be captured (host routing, data-dependent shapes): on a
    backend with graphs the engine turns them off for it (model.graph_capturable) instead of failing
    its capture at start (the H200 run of hybrid_parity did), and gives transformers' tokens."""
    from hwkv.reference.graphs import GraphCpuBackend

    path, ref = _saved_with_reference(_hf_model("gpt_oss"), tmp_path / "oss")
    e = hwkv.Engine(path, backend=GraphCpuBackend(), dtype="float32", max_model_len=80, num_kv_blocks=64)
    assert not e.config.runtime.graphs and e.config.kv_groups
    outs = e.generate(PROMPTS, hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                      use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    _whole(e)


def make_random_trace(rng, path, n: int, max_tokens: int, max_model_len: int) -> tuple[list, set, list]:
    """``n`` greedy requests over three shared prefixes (up to ``max_tokens`` new tokens each), three
    of them to abort, and each one's tokens from a plain engine (one group, no prefix cache)."""
    prefixes = [[rng.randrange(3, 250) for _ in range(rng.randint(8, 30))] for _ in range(3)]
    reqs = [(rng.choice(prefixes) + [rng.randrange(3, 250) for _ in range(rng.randint(1, 20))],
             rng.randint(1, max_tokens)) for _ in range(n)]
    aborts = set(rng.sample(range(n), 3))
    plain = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=max_model_len, num_kv_blocks=128,
                        enable_prefix_caching=False, kv_cache_groups=False)
    want = [o.token_ids for o in plain.generate([p for p, _ in reqs],
                                                [hwkv.SamplingParams(temperature=0.0, max_tokens=k, ignore_eos=True)
                                                 for _, k in reqs], use_tqdm=False)]
    return reqs, aborts, want


def run_random_trace(e, reqs: list, want: list, aborts: set, rng) -> dict[int, list[int]]:
    """Feed ``reqs`` ((prompt, max_tokens) each, greedy) to ``e`` a few at a time between steps, aborting
    requests in ``aborts`` at random; every finished request's tokens must equal ``want`` (a prefix of
    it when aborted). Returns the finished tokens by request index."""
    got: dict[int, list[int]] = {}
    pending = list(range(len(reqs)))
    while pending or e.has_unfinished():
        for _ in range(rng.randint(0, 3)):  # arrivals between steps
            if pending:
                i = pending.pop(0)
                e.add_request(str(i), reqs[i][0], hwkv.SamplingParams(temperature=0.0, max_tokens=reqs[i][1],
                                                                      ignore_eos=True))
        if not e.has_unfinished():
            continue
        for o in e.step():
            if o.finished:
                got[int(o.request_id)] = list(o.token_ids)
            elif int(o.request_id) in aborts and rng.random() < 0.3:
                e.abort(o.request_id)
    for i, toks in got.items():
        assert toks == want[i][: len(toks)] if i in aborts else toks == want[i], i
    assert len(got) >= len(reqs) - len(aborts)
    return got
