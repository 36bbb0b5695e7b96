"""Engine with an EAGLE-1 head: greedy identity with non-speculative decoding (random-weight head of
the published shape), the head's inputs aligned (a head that copies the target's state must draft the
token the target just chose), loading errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from hwkv.engine.engine import Engine

from .conftest import write_tiny_eagle
from .test_engine_ngram import GREEDY, _prompts, _run, speculate_like_plain

CASES = {
    "default": {},
    "chunked_small_budget": {"max_num_batched_tokens": 9, "long_prefill_token_threshold": 6},
    "preemption_tiny_pool": {"num_kv_blocks": 26, "max_num_seqs": 6},
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_identity(tiny_model: str, tiny_eagle: str, case: str) -> None:
    spec = {"method": "eagle", "num_speculative_tokens": 3, "model": tiny_eagle}
    eng = speculate_like_plain(tiny_model, _prompts(seed=21), spec, **CASES[case])
    assert eng.stats()["spec_decode"]["draft_tokens"] > 0
    if case == "preemption_tiny_pool":
        assert eng.stats()["num_preemptions"] > 0


def _copy_head(tmp_path, tiny_eagle: str) -> str:
    """fc = [0 | I], o_proj = down_proj = 0: the head's output is the target's state h_p itself, so its
    first draft is lm_head(h_{n-2}) = the target's greedy choice at n-2 = the request's last token."""
    d = tmp_path / "copy"
    d.mkdir()
    w = load_file(f"{tiny_eagle}/model.safetensors")
    h = w["fc.weight"].shape[0]
    w["fc.weight"] = torch.cat([torch.zeros(h, h), torch.eye(h)], 1)
    w["layers.0.self_attn.o_proj.weight"].zero_()
    w["layers.0.mlp.down_proj.weight"].zero_()
    save_file(w, str(d / "model.safetensors"))
    (d / "config.json").write_text(Path(tiny_eagle, "config.json").read_text())
    return str(d)


def _spy_drafts(eng: Engine) -> list[tuple[int, int]]:
    """``(token the target just chose, first draft proposed after it)`` per proposal, filled as ``eng`` runs."""
    seen: list[tuple[int, int]] = []
    orig = eng.proposer.propose_with_hidden

    def spy(runner, states, batch, hidden, valid, sample_rows, caps):
        out = orig(runner, states, batch, hidden, valid, sample_rows, caps)
        for j, i in enumerate(sample_rows):
            st = states[i]
            if out[j]:
                seen.append((int(runner.token_ids[st.slot, st.num_tokens - 1]), out[j][0]))
        return out

    eng.proposer.propose_with_hidden = spy
    return seen


@pytest.mark.parametrize("case", ["default", "chunked_small_budget"])
def test_head_sees_target_state_of_its_position(tiny_model: str, tiny_eagle: str, tmp_path, case: str) -> None:
    spec = {"method": "eagle", "num_speculative_tokens": 2, "model": _copy_head(tmp_path, tiny_eagle)}
    eng = Engine(tiny_model, num_kv_blocks=96, block_size=4, speculative_config=spec, **CASES[case])
    seen = _spy_drafts(eng)
    eng.generate(_prompts(4, seed=22), GREEDY, use_tqdm=False)
    assert len(seen) > 20
    assert all(last == first for last, first in seen), seen[:10]


def test_bad_heads_refused(tiny_model: str, tiny_eagle: str, tmp_path) -> None:
    from hwkv.model.loader import ModelLoadError

    other = write_tiny_eagle(tmp_path / "wide", hidden_size=96)
    with pytest.raises(ValueError, match="hidden_size"):
        Engine(tiny_model, num_kv_blocks=16, block_size=4,
               speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": other})
    nofc = tmp_path / "nofc"
    nofc.mkdir()
    w = load_file(f"{tiny_eagle}/model.safetensors")
    del w["fc.weight"]
    save_file(w, str(nofc / "model.safetensors"))
    (nofc / "config.json").write_text(Path(tiny_eagle, "config.json").read_text())
    with pytest.raises(ModelLoadError, match="fc.weight"):
        Engine(tiny_model, num_kv_blocks=16, block_size=4,
               speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": str(nofc)})
    with pytest.raises(ValueError, match="EAGLE-1 head"):
        Engine(tiny_model, num_kv_blocks=16, block_size=4,
               speculative_config={"method": "eagle3", "num_speculative_tokens": 2, "model": tiny_eagle})


def test_head_with_own_embedding_and_fc_bias(tiny_model: str, tmp_path) -> None:
    head = write_tiny_eagle(tmp_path / "e2", with_embed=True, fc_bias=True, seed=3)
    eng = speculate_like_plain(tiny_model, _prompts(3, seed=23), {"method": "eagle", "num_speculative_tokens": 2,
                                                                  "model": head})
    assert eng.proposer.head.embed is not eng.model.model.embed_tokens.weight


@pytest.mark.parametrize("case", ["default", "preemption_tiny_pool"])
def test_eagle3_greedy_identity_and_vocab_map(tiny_model: str, tmp_path, case: str) -> None:
    from .conftest import write_tiny_eagle3

    head = write_tiny_eagle3(tmp_path / "e3")
    prompts = _prompts(seed=24)
    base, _ = _run(tiny_model, prompts, GREEDY, **CASES[case])
    spec = {"method": "eagle3", "num_speculative_tokens": 3, "model": head}
    eng = Engine(tiny_model, num_kv_blocks=CASES[case].get("num_kv_blocks", 96), block_size=4,
                 max_num_seqs=CASES[case].get("max_num_seqs", 256), speculative_config=spec)
    drafted = []
    orig = eng.proposer.propose_with_hidden

    def spy(*a):
        out = orig(*a)
        drafted.extend(t for d in out for t in d)
        return out

    eng.proposer.propose_with_hidden = spy
    outs = eng.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    assert drafted and all(t % 3 == 0 for t in drafted)  # draft ids mapped through d2t (i -> 3 i)
    assert eng.model.decode_ops is None
    assert eng.kv_cache_manager.num_free_blocks == eng.kv_cache.spec.num_blocks


def test_eagle3_head_refused_under_eagle_and_bad_aux(tiny_model: str, tmp_path) -> None:
    from .conftest import write_tiny_eagle3

    head = write_tiny_eagle3(tmp_path / "e3")
    with pytest.raises(ValueError, match="EAGLE-3 head"):
        Engine(tiny_model, num_kv_blocks=16, block_size=4,
               speculative_config={"method": "eagle", "num_speculative_tokens": 2, "model": head})
    bad = write_tiny_eagle3(tmp_path / "bad", aux=(0, 1, 5))
    with pytest.raises(ValueError, match="aux hidden-state layers"):
        Engine(tiny_model, num_kv_blocks=16, block_size=4,
               speculative_config={"method": "eagle3", "num_speculative_tokens": 2, "model": bad})


@pytest.mark.parametrize("graphs", [False, True])
def test_drafts_fed_from_the_device_equal_drafts_fed_from_the_token_table(tiny_model: str, tiny_eagle: str,
                                                                         monkeypatch, graphs: bool) -> None:
    """Draft j + 1's input token is draft j straight from the device (no host read per draft), with
    graphs through the head's one-token graphs (token and state in their static buffers): every
    proposal equals the one made eagerly with each draft first written into the token table and read
    from there (the head's drafts depend on their input token and state, so a wrong feed changes them)."""
    import numpy as np

    from hwkv.reference.graphs import GraphCpuBackend
    from hwkv.spec_decode.eagle import EagleProposer

    spec = {"method": "eagle", "num_speculative_tokens": 4, "model": tiny_eagle}
    prompts = _prompts(5, seed=33)
    kw = {"backend": GraphCpuBackend(), "fuse_elementwise": False, "max_model_len": 128} if graphs else {}

    def proposals() -> list:
        eng = Engine(tiny_model, num_kv_blocks=96, block_size=4, max_num_seqs=5, speculative_config=spec, **kw)
        got, orig = [], eng.proposer.propose_with_hidden

        def record(*a, **k):
            got.append(orig(*a, **k))
            return got[-1]
        eng.proposer.propose_with_hidden = record
        eng.generate(prompts, GREEDY, use_tqdm=False)
        if graphs and EagleProposer._forward is forward:
            head_graphs = eng.proposer.graphs
            replays = sum(g.replays for g, _, _ in head_graphs.graphs.values())
            assert replays == eng.proposer.num_graph_steps > 0  # the head's draft steps replayed
        return got

    forward = EagleProposer._forward
    fed = proposals()
    def via_table(self, runner, slots, ctx, qlen, hidden, feed=None):
        if feed is not None:  # the pair at p reads token p + 1: write the fed drafts there
            runner.token_ids[slots, ctx + 1] = feed.cpu().numpy().astype(np.int32)
        return forward(self, runner, slots, ctx, qlen, hidden)

    monkeypatch.setattr(EagleProposer, "_forward", via_table)
    table = proposals()
    assert sum(len(d) for step in fed for d in step) > 20
    assert fed == table
