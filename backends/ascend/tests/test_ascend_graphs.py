"""ACL graph decode on the emulator: the task-update path (vllm-ascend's ``update_attn_params``)
gives the eager tokens, and the emulated graph freezes host lengths so that a missing update fails.
(Emulation on the CPU: no claim about NPU hardware.)"""

from __future__ import annotations

import sys

import pytest
import torch

import hwkv
from hwkv.model import tiny

A3 = 252


@pytest.fixture
def a3(monkeypatch, emulator):
    from hwkv.plugins import reset

    mod = emulator.make_module(soc_version=A3)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    reset()
    yield mod
    reset()


def _fia(mod, q, k, v, lens, **kw):
    return dict(query=q, key=k, value=v, input_layout="TND", actual_seq_lengths=[1, 2],
                actual_seq_lengths_kv=lens, atten_mask=torch.triu(torch.ones(2048, 2048, dtype=torch.int8), 1),
                block_table=kw["bt"], block_size=128, num_heads=2, num_key_value_heads=2, scale=0.125, sparse_mode=3)


def test_emulated_graph_freezes_host_lengths_until_a_task_update(a3):
    rt = a3.npu
    torch.manual_seed(0)
    q = torch.randn(2, 2, 64, dtype=torch.float16)
    kv = torch.randn(2, 128, 128, dtype=torch.float16), torch.randn(2, 128, 128, dtype=torch.float16)
    bt = torch.tensor([[0], [1]], dtype=torch.int32)
    args = _fia(a3, q, *kv, [100, 100], bt=bt)
    out, lse = torch.empty(2, 2, 64, dtype=torch.float16), torch.empty(1, dtype=torch.float16)
    ws = a3._npu_fused_infer_attention_score_get_max_workspace(**args)
    g, stream = rt.NPUGraph(), rt.Stream()
    ev = rt.ExternalEvent()
    with torch.inference_mode(), rt.graph(g, pool=rt.graph_pool_handle(), stream=stream):
        ev.wait(stream)
        ev.reset(stream)
        rt.graph_task_group_begin(stream)
        a3.npu_fused_infer_attention_score.out(**args, workspace=ws, out=[out, lse])
        handle = rt.graph_task_group_end(stream)

    def eager(lens):
        return a3.npu_fused_infer_attention_score(**{**args, "actual_seq_lengths_kv": lens})[0]

    with pytest.raises(RuntimeError, match="ExternalEvent nobody recorded"):
        g.replay()  # no update: the real replay would block on the event
    ev.record()
    q.mul_(-1)  # device tensors are read at replay...
    g.replay()
    assert torch.equal(out, eager([100, 100]))  # ...host lengths stay the captured ones
    assert not torch.equal(out, eager([7, 30]))
    rt.graph_task_update_begin(stream, handle)
    a3.npu_fused_infer_attention_score.out(**{**args, "actual_seq_lengths_kv": [7, 30]}, workspace=ws, out=[out, lse])
    rt.graph_task_update_end(stream)
    ev.record()
    g.replay()
    assert torch.equal(out, eager([7, 30]))
    rt.graph_task_update_begin(stream, handle)
    with pytest.raises(RuntimeError, match="'out' is not the tensor the task captured"):
        a3.npu_fused_infer_attention_score.out(**args, workspace=ws, out=[out.clone(), lse])


def _model(tmp_path, head_dim):
    return str(tiny.write_tiny_model(tmp_path / f"m{head_dim}", hidden_size=128, num_heads=2, num_kv_heads=1,
                                     head_dim=head_dim, num_layers=2, vocab_size=512, max_position_embeddings=512))


PROMPTS = [[5, 9, 13, 2], list(range(20, 47)), [7], list(range(100, 111))]


def _generate(model, **extra):
    e = hwkv.Engine(model, backend="ascend", dtype=torch.float16, block_size=128, num_kv_blocks=12,
                    max_model_len=256, max_num_batched_tokens=64, max_num_seqs=4, fuse_elementwise=False, **extra)
    params = [hwkv.SamplingParams(temperature=0.0, max_tokens=6 + 3 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    out = [list(o.token_ids) for o in e.generate(PROMPTS, params, use_tqdm=False)]
    assert e.kv_cache_manager.num_free_blocks == 12 and not e.runner.reqs
    return e, out


@pytest.mark.parametrize("head_dim", [64, 192])  # 64: ATB paged attention in the graph; 192: FIA
def test_graph_decode_matches_eager_through_task_updates(a3, tmp_path, head_dim):
    from hwkv_ascend.attention import AscendMetadataBuilder

    torch.set_num_threads(1)
    model = _model(tmp_path, head_dim)
    _, want = _generate(model, enforce_eager=True)
    updates = []
    real = AscendMetadataBuilder.before_replay

    def spy(self, captured, common):
        updates.append(len(captured.graph_tasks))
        real(self, captured, common)

    AscendMetadataBuilder.before_replay = spy
    try:
        e, got = _generate(model)
    finally:
        AscendMetadataBuilder.before_replay = real
    assert e.backend.capabilities.graph_capture
    assert got == want
    assert e.runner.num_graph_steps == len(updates) > 5
    assert set(updates) == {2}  # one attention task per layer, re-bound every replay


def test_without_the_update_the_frozen_lengths_give_wrong_tokens(a3, tmp_path, monkeypatch):
    from hwkv_ascend.attention import AscendMetadataBuilder

    torch.set_num_threads(1)
    model = _model(tmp_path, 64)
    _, want = _generate(model, enforce_eager=True)

    def events_only(self, captured, common):  # the ordering is kept, the lengths are not re-bound
        for task in captured.graph_tasks:
            task.event.record()

    monkeypatch.setattr(AscendMetadataBuilder, "before_replay", events_only)
    e, got = _generate(model)
    assert e.runner.num_graph_steps > 5
    assert got != want
    monkeypatch.setattr(AscendMetadataBuilder, "before_replay", lambda self, captured, common: None)
    with pytest.raises(RuntimeError, match="ExternalEvent nobody recorded"):
        _generate(model)


def test_graphs_declared_only_where_padding_writes_are_safe(monkeypatch, emulator):
    from hwkv_ascend.backend import AscendBackend

    from hwkv.plugins import reset

    for soc, cann, on in ((A3, "9.0.0", True), (222, "9.0.0", False)):
        monkeypatch.setitem(sys.modules, "torch_npu", emulator.make_module(soc_version=soc, cann=cann))
        reset()
        caps = AscendBackend().capabilities
        assert caps.graph_capture is on
        why = caps.extras["graphs"]
        assert why == "acl (task update)" if on else "only on A3 with CANN >= 9" in why, why
    mod = emulator.make_module(soc_version=A3)
    del mod.npu.graph_task_update_begin
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    reset()
    caps = AscendBackend().capabilities
    assert not caps.graph_capture and "torch_npu.npu.graph_task_update_begin" in caps.extras["graphs"]
    reset()


def test_graph_serves_a_batch_of_one_token_prompts(a3, tmp_path):
    """A first step of one-token prompts is pure-decode shaped (no request has context yet): the
    decode graph serves it with the lengths re-bound, and the tokens match eager."""
    torch.set_num_threads(1)
    model = _model(tmp_path, 64)
    prompts = [[7], [9], [11]]
    params = hwkv.SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = []
    for extra in ({"enforce_eager": True}, {}):
        e = hwkv.Engine(model, backend="ascend", dtype=torch.float16, block_size=128, num_kv_blocks=12,
                        max_model_len=256, max_num_seqs=4, fuse_elementwise=False, **extra)
        outs.append([list(o.token_ids) for o in e.generate(prompts, params, use_tqdm=False)])
    assert e.runner.num_graph_steps == 5  # the first step too
    assert outs[1] == outs[0]


def test_graph_decode_of_window_layers_matches_eager(a3, tmp_path):
    """A Qwen2 model with a full and a window-8 layer (two KV-cache groups): the window layer's decode
    is FIA's band mode inside the graph, re-bound every replay like the full layer's PA task."""
    import json

    torch.set_num_threads(1)
    path = tiny.write_tiny_model(tmp_path / "qw", arch="qwen2", hidden_size=128, num_heads=2, num_kv_heads=1,
                                 head_dim=64, num_layers=2, vocab_size=512, max_position_embeddings=512,
                                 sliding_window=8)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "max_window_layers": 1}))
    e, want = _generate(str(path), enforce_eager=True)
    assert [g.window for g in e.config.kv_groups] == [None, 8]
    e, got = _generate(str(path))
    assert e.backend.capabilities.graph_capture and e.runner.num_graph_steps > 5
    assert got == want
