"""Sharding rules and the sharded loader, in one process (no collectives run while loading)."""

from __future__ import annotations

import pytest
import torch

from hwkv.model import load_model
from hwkv.model.config import ModelConfig
from hwkv.model.tiny import write_tiny_model
from hwkv.parallel.sharding import TPShard, check_tp, kv_head_start, vocab_range
from tests.parallel.conftest import add_biases


class _NoComm:  # loading runs no collective
    def __getattr__(self, name):
        raise AssertionError(f"collective {name} called while loading")


@pytest.mark.parametrize("heads,kv,tp,ok", [(4, 2, 2, True), (4, 2, 4, True), (4, 1, 4, True), (4, 4, 2, True),
                                            (4, 2, 3, False), (6, 3, 3, True), (6, 2, 3, False), (6, 3, 2, False)])
def test_check_tp(tmp_path, heads, kv, tp, ok):
    p = write_tiny_model(tmp_path, num_heads=heads, num_kv_heads=kv, hidden_size=8 * heads, tokenizer=False)
    cfg = ModelConfig.from_dir(p)
    if ok:
        check_tp(cfg, tp)
    else:
        with pytest.raises(ValueError, match=r"cannot be split over .*allowed tensor_parallel_size: 1"):
            check_tp(cfg, tp)


def test_kv_heads_and_vocab_ranges():
    assert [kv_head_start(8, r, 4) for r in range(4)] == [0, 2, 4, 6]
    assert [kv_head_start(2, r, 4) for r in range(4)] == [0, 0, 1, 1]  # replicated
    assert [kv_head_start(1, r, 2) for r in range(2)] == [0, 0]
    assert [vocab_range(515, r, 2) for r in range(2)] == [(0, 258, 258), (258, 515, 258)]
    assert [vocab_range(5, r, 4) for r in range(4)] == [(0, 2, 2), (2, 4, 2), (4, 5, 2), (5, 5, 2)]


@pytest.mark.parametrize("arch,kv,tie", [("llama", 2, False), ("qwen3", 1, True), ("qwen3_moe", 4, False)])
def test_shards_reassemble_the_checkpoint(tmp_path, arch, kv, tie):
    """Each rank's parameters are exactly its slices of the full ones (the loader read only those)."""
    p = write_tiny_model(tmp_path, arch=arch, num_heads=4, num_kv_heads=kv, vocab_size=515, tokenizer=False,
                         tie_word_embeddings=tie)
    if arch == "llama":
        add_biases(p)
    full, cfg, *_ = load_model(p, "cpu", load_tokenizer=False)
    fp = dict(full.named_parameters())
    n, d = 2, cfg.head_dim
    shards = [load_model(p, "cpu", load_tokenizer=False, tp=TPShard(r, n, _NoComm()))[0] for r in range(n)]
    q, kvs = cfg.num_heads * d, cfg.num_kv_heads * d
    for name, w in fp.items():
        parts = [dict(s.named_parameters())[name] for s in shards]
        if name.endswith("qkv_proj.weight"):
            wq, wk, wv = w.split([q, kvs, kvs])
            for r, s in enumerate(parts):
                lkv = max(1, cfg.num_kv_heads // n) * d
                lq, lk, lv = s.split([q // n, lkv, lkv])
                k0 = kv_head_start(cfg.num_kv_heads, r, n) * d
                assert torch.equal(lq, wq[r * q // n:(r + 1) * q // n])
                assert torch.equal(lk, wk[k0:k0 + lk.shape[0]]) and torch.equal(lv, wv[k0:k0 + lv.shape[0]])
        elif name.endswith("qkv_proj.bias"):
            bq, bk, bv = w.split([q, kvs, kvs])
            assert torch.equal(torch.cat([s[: q // n] for s in parts]), bq)
            assert torch.equal(parts[1][q // n:], torch.cat([bk, bv])[[*range(d, 2 * d), *range(3 * d, 4 * d)]])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, 1), w)
        elif name.endswith(("o_proj.bias", "down_proj.bias")):  # row-parallel: added once, by rank 0
            assert torch.equal(parts[0], w) and not parts[1].any()
        elif name.endswith("gate_up_proj.bias"):
            g, u = w.chunk(2)
            assert torch.equal(torch.cat([s.chunk(2)[0] for s in parts]), g)
        elif name.endswith("gate_up_proj.weight"):
            g, u = w.chunk(2)
            assert torch.equal(torch.cat([s.chunk(2)[0] for s in parts]), g)
            assert torch.equal(torch.cat([s.chunk(2)[1] for s in parts]), u)
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            rows = torch.cat(parts)
            assert torch.equal(rows[:515], w) and not rows[515:].any()  # padding rows stay zero
        else:  # norms, the router: replicated
            assert all(torch.equal(s, w) for s in parts), name
    assert shards[0].kv_cache_spec(4, 16).num_kv_heads == max(1, cfg.num_kv_heads // n)
