"""The forward on a CUDA device: no host synchronisation, CUDA-graph capturable, matches the CPU
reference; seeded sampling on the device. Uses a small static-shape torch attention (not the CUDA
backend's kernels) so only the model code is under test."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hwkv.interfaces.attention import AttentionBackend, AttentionImpl, AttentionMetadata
from hwkv.model import SamplingBatch, load_model, make_generator, sample
from hwkv.model.tiny import write_tiny_model
from hwkv.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


class _StaticImpl(AttentionImpl):
    """Paged attention with shapes fixed by the metadata tensors' shapes: graph-safe, sync-free."""

    def write_kv(self, key, value, layer_kv, slot_mapping):
        bs = layer_kv.shape[2]
        blk, off = slot_mapping // bs, slot_mapping % bs
        layer_kv[blk, 0, off] = key.to(layer_kv.dtype)
        layer_kv[blk, 1, off] = value.to(layer_kv.dtype)

    def forward(self, query, key, value, layer_kv, md):
        t, bs = query.shape[0], layer_kv.shape[2]
        tok = torch.arange(t, device=query.device)
        req = torch.searchsorted(md.query_start_loc[1:], tok.to(md.query_start_loc.dtype), right=True)
        pos = md.seq_lens[req] - (md.query_start_loc[req + 1] - tok)
        blocks = md.block_tables[req].long()  # [T, max_blocks]
        k = layer_kv[blocks, 0].flatten(1, 2).float()  # [T, S, Hk, D]
        v = layer_kv[blocks, 1].flatten(1, 2).float()
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        scores = torch.einsum("thd,tshd->ths", query.float(), k) * self.scale
        s = torch.arange(blocks.shape[1] * bs, device=query.device)
        scores = scores.masked_fill((s[None, :] > pos[:, None]).unsqueeze(1), float("-inf"))
        return torch.einsum("ths,tshd->thd", scores.softmax(-1), v).to(query.dtype)


class _StaticAttention(AttentionBackend):
    def make_impl(self, num_heads, head_size, num_kv_heads, scale):
        return _StaticImpl(num_heads, head_size, num_kv_heads, scale)


CUDA = SimpleNamespace(device=SimpleNamespace(torch_device=torch.device("cuda", 0)), attention=_StaticAttention(),
                       capabilities=SimpleNamespace(dtypes=(torch.float32, torch.bfloat16, torch.float16)))
BS, PROMPTS = 16, [[0] + list(range(5, 5 + n)) for n in (40, 3, 77, 18)]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("cuda") / "m", arch="qwen2", hidden_size=256, num_layers=3,
                            num_heads=8, num_kv_heads=2, intermediate_size=512, vocab_size=1024)


def _setup(model, dev):
    from hwkv.interfaces.layout import KVCache

    tables = [[r * 8 + b for b in range(8)] for r in range(len(PROMPTS))]
    spec = model.kv_cache_spec(8 * len(PROMPTS), BS)
    return tables, KVCache.allocate(spec, CUDA.attention.kv_layout, dev)


def _step(model, cache, tables, work, dev):
    qlens = [e - s for _, _, s, e in work]
    md = AttentionMetadata.build(qlens, [e for *_, e in work], [tables[r] for r, *_ in work], BS, device=dev)
    ids = torch.tensor([t for _, toks, s, e in work for t in toks[s:e]], device=dev)
    pos = torch.cat([torch.arange(s, e) for _, _, s, e in work]).to(dev)
    idx = (torch.cumsum(torch.tensor(qlens), 0) - 1).to(dev)
    return ids, pos, md, idx


def test_cuda_forward_matches_cpu_and_has_no_host_sync(ckpt, cpu_backend, paged_runner):
    dev = torch.device("cuda", 0)
    model, cfg, _, _ = load_model(ckpt, CUDA)
    assert all(p.device == dev for p in model.parameters()) and model.rotary_emb.cos.device == dev
    cpu_model = load_model(ckpt, cpu_backend)[0]
    prefill = [(i, p, 0, len(p)) for i, p in enumerate(PROMPTS)]
    want = paged_runner(cpu_model, cpu_backend, len(PROMPTS), 128).step(prefill)
    tables, cache = _setup(model, dev)
    ids, pos, md, idx = _step(model, cache, tables, prefill, dev)
    with torch.inference_mode():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any device->host sync in the forward raises
        try:
            got = model(ids, pos, cache, md, idx)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(got.cpu(), want, atol=2e-3, rtol=0)


def test_decode_step_captures_in_a_cuda_graph(ckpt):
    dev = torch.device("cuda", 0)
    model = load_model(ckpt, CUDA, dtype="bfloat16")[0]
    tables, cache = _setup(model, dev)
    seqs = [list(p) for p in PROMPTS]

    def decode_inputs():
        return _step(model, cache, tables, [(i, s, len(s) - 1, len(s)) for i, s in enumerate(seqs)], dev)

    with torch.inference_mode():
        ids, pos, md, idx = _step(model, cache, tables, [(i, p, 0, len(p)) for i, p in enumerate(seqs)], dev)
        for s, t in zip(seqs, model(ids, pos, cache, md, idx).argmax(-1).tolist()):
            s.append(t)
        s_ids, s_pos, s_md, s_idx = decode_inputs()  # the graph's static buffers
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # warm up outside the graph
                model(s_ids, s_pos, cache, s_md, s_idx)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = model(s_ids, s_pos, cache, s_md, s_idx)
        for _ in range(3):  # each decode step: refill the static buffers, replay, compare with eager
            ids, pos, md, idx = decode_inputs()
            s_ids.copy_(ids)
            s_pos.copy_(pos)
            s_md.seq_lens.copy_(md.seq_lens)
            s_md.slot_mapping.copy_(md.slot_mapping)
            graph.replay()
            replayed = out.clone()
            eager = model(ids, pos, cache, md, idx)
            torch.testing.assert_close(replayed, eager, atol=0, rtol=0)
            for s, t in zip(seqs, eager.argmax(-1).tolist()):
                s.append(t)


def test_seeded_sampling_on_cuda():
    dev = torch.device("cuda", 0)
    logits = torch.randn(4, 5000, device=dev)
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    alone = sample(logits[:1], SamplingBatch([sp], [[]], generators=[make_generator(3, dev)])).token_ids
    mixed = [SamplingParams(), sp, SamplingParams(temperature=0), SamplingParams(seed=9)]
    rows = torch.cat([logits[1:2], logits[:1], logits[2:]])
    gens = [None, make_generator(3, dev), None, make_generator(9, dev)]
    got = sample(rows, SamplingBatch(mixed, [[]] * 4, generators=gens)).token_ids
    assert got[1] == alone[0] and got[2] == int(logits[2].argmax())
