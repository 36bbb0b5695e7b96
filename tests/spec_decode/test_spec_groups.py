"""Model proposers (draft model, EAGLE, EAGLE-3) with KV-cache groups (docs/hybrid-models.md): a hybrid
target runs its window layers in window groups (blocks out of the window freed every step) while the
proposer's own KV follows the full group's block ids. Greedy tokens are HF's under chunked prefill
(the proposer catches up over blocks the window group already dropped), rejected drafts (the window
group keeps what the accepted length needs) and preemption; every block of every group is free at
the end. A model with no full-attention layer is refused by name under ``kv_cache_groups=True``."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hwkv  # noqa: E402
from hwkv.engine.kv_groups import GroupedKVCache  # noqa: E402
from hwkv.model.tiny import write_tiny_model  # noqa: E402
from tests.engine.test_engine_kv_groups import WINDOW, _whole, make_random_trace, run_random_trace  # noqa: E402
from tests.engine.test_engine_parity import NEW_TOKENS, PROMPTS, VOCAB, _hf_model, _saved_with_reference  # noqa: E402

from .conftest import write_tiny_eagle, write_tiny_eagle3  # noqa: E402

K = 3


@pytest.fixture(scope="module", params=["gemma2", "gemma3", "gpt_oss"])
def hybrid_case(request, tmp_path_factory):
    arch = request.param
    return arch, *_saved_with_reference(_hf_model(arch), tmp_path_factory.mktemp(f"spec-groups-{arch}"))


@pytest.fixture(scope="module")
def llama_draft(tmp_path_factory) -> str:
    """A one-layer full-attention draft of the targets' vocabulary (other weights: drafts get rejected)."""
    return str(write_tiny_model(tmp_path_factory.mktemp("spec-groups") / "draft", vocab_size=VOCAB, num_layers=1,
                                seed=1, max_position_embeddings=256, tokenizer=False))


def _spec(method: str, path: str, draft: str, tmp_path) -> dict:
    if method == "draft_self":  # the target drafts for itself: its window layers read the full group's table
        return {"method": "draft_model", "num_speculative_tokens": K, "model": path}
    if method == "draft_llama":
        return {"method": "draft_model", "num_speculative_tokens": K, "model": draft}
    if method == "eagle":
        return {"method": "eagle", "num_speculative_tokens": K, "model": write_tiny_eagle(tmp_path / "eagle",
                                                                                          vocab_size=VOCAB)}
    return {"method": "eagle3", "num_speculative_tokens": K, "model": write_tiny_eagle3(tmp_path / "eagle3",
                                                                                        draft_vocab=64)}


@pytest.mark.parametrize("method", ["draft_self", "draft_llama", "eagle", "eagle3"])
def test_model_proposers_with_groups_give_hf_tokens(hybrid_case, llama_draft, method, tmp_path):
    arch, path, ref = hybrid_case
    spec = _spec(method, path, llama_draft, tmp_path)
    if method == "eagle3":
        _fit_eagle3_vocab(spec["model"])
    torch.set_num_threads(1)
    # 16-token steps: prompts up to 45 tokens prefill in chunks, so a proposer catches up over positions
    # whose window-group blocks are already freed; 40 blocks of 4 for 8 requests: preemption
    e = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=40, block_size=4,
                    max_num_seqs=8, max_num_batched_tokens=16, kv_cache_groups=True, speculative_config=spec)
    assert isinstance(e.kv_cache, GroupedKVCache) and [g.window for g in e.config.kv_groups] == [None, WINDOW]
    kv, bs = e.kv_cache_manager, e.block_size
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        e.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    # a window group's live blocks: the window behind the step's first token, the step's tokens (at most
    # 16) and the K lookahead slots, plus a block of alignment
    bound = -(-(WINDOW - 1 + 16 + K) // bs) + 1
    held = 0
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                outs[o.request_id] = list(o.token_ids)
        for r in e.scheduler.running:
            live = kv.num_live_blocks(r.request_id)
            held = max(held, live[1])
            assert live[1] <= bound, (r.request_id, live, r.num_computed_tokens)
    assert [outs[str(i)] for i in range(len(PROMPTS))] == ref
    st = e.stats()
    assert st["spec_decode"]["draft_tokens"] > 0 and held > 0
    assert st["num_preemptions"] > 0
    if method == "draft_self":  # the same model and tokens on both sides: only rounding can reject
        assert st["spec_decode"]["acceptance_rate"] > 0.97, st["spec_decode"]
    else:
        assert st["spec_decode"]["acceptance_rate"] < 0.97  # rejections happened: rollback was exercised
    _whole(e)


def _fit_eagle3_vocab(head: str) -> None:
    """The tiny EAGLE-3 head is written for a 512-token vocabulary: its 64 draft ids map to target ids
    3 i < 192, inside ours; its config and t2d say so."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    p = Path(head)
    cfg = json.loads((p / "config.json").read_text())
    cfg["vocab_size"] = VOCAB
    (p / "config.json").write_text(json.dumps(cfg))
    w = load_file(str(p / "model.safetensors"))
    w["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    save_file(w, str(p / "model.safetensors"))


def test_model_proposer_graphs_with_groups(tmp_path, llama_draft):
    """The draft model's decode and catch-up graphs (emulated on the CPU) over a grouped target."""
    from hwkv.reference.graphs import GraphCpuBackend

    path, ref = _saved_with_reference(_hf_model("gemma3"), tmp_path / "gemma3")
    torch.set_num_threads(1)
    e = hwkv.Engine(path, backend=GraphCpuBackend(), dtype="float32", max_model_len=80, num_kv_blocks=64,
                    block_size=4, max_num_seqs=8, fuse_elementwise=False, kv_cache_groups=True,
                    speculative_config={"method": "draft_model", "num_speculative_tokens": K, "model": llama_draft})
    assert e.config.kv_groups and e.config.runtime.graphs
    outs = e.generate(PROMPTS, hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                      use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert e.runner.proposer.num_graph_steps > 0 and e.runner.num_verify_graph_steps > 0
    _whole(e)


def test_windowed_only_target_refuses_model_proposer_groups(tmp_path, llama_draft):
    """Every layer windowed: no full group to index a proposer's KV by. True is refused by name; None
    runs one group of every layer (HF's tokens)."""
    path, ref = _saved_with_reference(_hf_model("mistral-window"), tmp_path / "mw")
    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": llama_draft}
    with pytest.raises(ValueError, match=r"kv_cache_groups=True cannot be met: speculative decoding's 'draft_model' "
                                         r"proposer indexes its KV by the full-attention group's block ids"):
        hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64, kv_cache_groups=True,
                    speculative_config=spec)
    e = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64, block_size=4,
                    speculative_config=spec)
    assert e.config.kv_groups == ()
    outs = e.generate(PROMPTS, hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                      use_tqdm=False)
    assert [o.token_ids for o in outs] == ref


def test_pool_sizing_counts_the_proposer_kv(tmp_path, llama_draft, monkeypatch):
    """Sized from memory, each full-group block pays for the draft's KV too (indexed by the same ids)."""
    from hwkv.engine.config import EngineArgs
    from hwkv.model import load_model
    from hwkv.plugins import get_backend

    path = str(tmp_path / "gemma3")
    _hf_model("gemma3").save_pretrained(path)
    backend = get_backend("cpu")
    model, *_ = load_model(path, backend, dtype="float32", load_tokenizer=False)
    draft, *_ = load_model(llama_draft, backend, dtype="float32", load_tokenizer=False)
    budget = 4 << 20
    monkeypatch.setattr(type(backend.device), "memory_info", lambda self: (budget, budget))
    args = EngineArgs(model=path, max_model_len=80, block_size=4, max_num_seqs=256, memory_fraction=1.0,
                      kv_cache_groups=True)
    full = sum(len(g.layers) for g in args.resolve(backend, model).kv_groups if g.window is None)
    layer = model.kv_cache_spec(1, 4).bytes_per_block // model.config.num_layers
    per_draft = draft.kv_cache_spec(1, 4).bytes_per_block
    plain = args.resolve(backend, model)
    spec = args.resolve(backend, model, extra_kv_bytes_per_block=lambda bs: per_draft)
    # the same bytes for the full group's blocks (within one block): each now holds the draft's KV as well
    assert spec.cache.num_kv_blocks < plain.cache.num_kv_blocks
    assert abs(spec.cache.num_kv_blocks * (full * layer + per_draft) - plain.cache.num_kv_blocks * full * layer) \
        < full * layer + per_draft


class _CountingOps:
    """The torch reference decode ops, counting the qkv calls (one per layer of a fused forward)."""

    def __new__(cls):
        from hwkv.model.decode_ops import TorchDecodeOps

        class Counting(TorchDecodeOps):
            calls = 0

            def qkv(self, *args):
                Counting.calls += 1
                return super().qkv(*args)

        return Counting()


@pytest.mark.parametrize("spec", [None, "draft"])
def test_decode_ops_with_groups_give_hf_tokens(tmp_path, monkeypatch, llama_draft, spec):
    """The fused decode ops take each layer's group's metadata and slot mapping (as the plain forward):
    a Qwen2 model with full and window-8 layers runs them with two groups, HF's tokens; a draft model
    on the full group's table runs them too."""
    cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
                                   initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
                                   use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    torch.manual_seed(7)
    model = transformers.Qwen2ForCausalLM(cfg).float().eval()
    path, ref = _saved_with_reference(model, tmp_path / "qwen2-mixed")
    backend = hwkv.plugins.get_backend("cpu")
    ops = _CountingOps()
    monkeypatch.setattr(type(backend), "decode_ops", lambda self: ops)
    e = hwkv.Engine(path, backend=backend, dtype="float32", max_model_len=80, num_kv_blocks=64, block_size=4,
                    max_num_seqs=8, kv_cache_groups=True, decode_ops=True,
                    speculative_config=None if spec is None else {"method": "draft_model", "num_speculative_tokens": K,
                                                                   "model": llama_draft})
    assert [g.window for g in e.config.kv_groups] == [None, WINDOW] and e.model.decode_ops is ops
    outs = e.generate(PROMPTS, hwkv.SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                      use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert type(ops).calls > 0
    _whole(e)


def test_decode_ops_refusal_is_the_familys(hybrid_case, monkeypatch):
    """Groups no longer block the fused decode ops; Gemma and GPT-OSS still refuse them by name."""
    from hwkv.model.decode_ops import TorchDecodeOps

    arch, path, _ = hybrid_case
    backend = hwkv.plugins.get_backend("cpu")
    monkeypatch.setattr(type(backend), "decode_ops", lambda self: TorchDecodeOps())
    with pytest.raises(ValueError, match=r"decode ops TorchDecodeOps cannot serve"):
        hwkv.Engine(path, backend=backend, dtype="float32", max_model_len=80, num_kv_blocks=64,
                    kv_cache_groups=True, decode_ops=True)
    e = hwkv.Engine(path, backend=backend, dtype="float32", max_model_len=80, num_kv_blocks=64, kv_cache_groups=True)
    assert e.config.kv_groups and e.model.decode_ops is None  # None: used only where they serve


def test_window_groups_are_sized_for_lookahead_slots(tmp_path, llama_draft):
    """A model proposer's k lookahead slots are held in every group (the tables grow together), so a
    window group's cap counts them per request: ceil((window - 1 + k) / bs) + 2 blocks each."""
    from hwkv.engine.kv_groups import plan_groups

    class Cfg:
        num_layers = 6

        @staticmethod
        def window_of(i):
            return None if i % 3 == 2 else 512

    class M:
        config = Cfg()

    assert plan_groups(M(), 10_000, 16, 8, 2048)[1].num_blocks == 8 * 34 + 128 + 1
    assert plan_groups(M(), 10_000, 16, 8, 2048, lookahead=4)[1].num_blocks == 8 * 35 + 128 + 1
    path, _ = _saved_with_reference(_hf_model("gemma3"), tmp_path / "gemma3")
    kw = dict(backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=64, block_size=4, max_num_seqs=8,
              max_num_batched_tokens=16, kv_cache_groups=True)
    plain = hwkv.Engine(path, **kw).config.kv_groups[1].num_blocks
    spec = hwkv.Engine(path, **kw, speculative_config={"method": "draft_model", "num_speculative_tokens": 5,
                                                       "model": llama_draft}).config.kv_groups[1].num_blocks
    # window 8, blocks of 4: ceil(7 / 4) + 2 = 4 per request without, ceil(12 / 4) + 2 = 5 with 5 slots
    assert (plain, spec) == (1 + 8 * 4 + 4, 1 + 8 * 5 + 4)


@pytest.mark.parametrize("seed", [0, 1])
def test_model_proposer_random_traces_with_groups(hybrid_case, llama_draft, tmp_path, seed):
    """Random traces through a grouped engine speculating (a draft model or EAGLE, by seed): shared
    prefixes, random arrivals, chunk budgets, a pool that preempts, aborts mid-speculation — every
    finished request has the tokens of a plain engine (one group, no prefix cache, no speculation)
    and every block of every group is free at the end."""
    import random

    arch, path, _ = hybrid_case
    rng = random.Random(seed)
    reqs, aborts, want = make_random_trace(rng, path, 14, 14, max_model_len=80)
    spec = _spec("draft_llama" if seed == 0 else "eagle", path, llama_draft, tmp_path)
    torch.set_num_threads(1)
    e = hwkv.Engine(path, backend="cpu", dtype="float32", max_model_len=80, num_kv_blocks=24, block_size=4,
                    max_num_batched_tokens=rng.choice([16, 24]), kv_cache_groups=True, speculative_config=spec)
    run_random_trace(e, reqs, want, aborts, rng)
    st = e.stats()
    assert st["spec_decode"]["draft_tokens"] > 0 and st["prefix_cache_hits"] > 0
    assert st["num_preemptions"] > 0, st["num_preemptions"]
    _whole(e)
