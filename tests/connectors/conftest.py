import random

import pytest
import torch

import hwkv
from hwkv.model.tiny import write_tiny_model

BS = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", max_position_embeddings=256))


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory):
    """A Mistral with a 16-token window in every layer: most keys of the connector tests' prompts fall
    out of it."""
    return str(write_tiny_model(tmp_path_factory.mktemp("windowed") / "mistral", arch="mistral", sliding_window=16,
                                max_position_embeddings=512))


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    """A Gemma-3-shaped model: two window-16 layers (one block) and a global one (two KV-cache groups)."""
    transformers = pytest.importorskip("transformers")
    import torch

    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, max_position_embeddings=256, initializer_range=0.2, bos_token_id=1,
        eos_token_id=2, query_pre_attn_scalar=16, sliding_window=16, sliding_window_pattern=3)
    torch.manual_seed(11)
    path = tmp_path_factory.mktemp("hybrid-diff")
    transformers.Gemma3ForCausalLM(cfg).float().eval().save_pretrained(path)
    return str(path)


def workload(seed: int = 0) -> list[list[int]]:
    """Three prompts sharing a 4-block prefix, each after a filler that needs the whole device pool
    (8 blocks): the prefix is evicted from the device every time and must come from elsewhere."""
    rng = random.Random(seed)
    prefix = [rng.randrange(1, 500) for _ in range(4 * BS)]
    out = []
    for _ in range(3):
        out.append([rng.randrange(1, 500) for _ in range(118)])
        out.append(prefix + [rng.randrange(1, 500) for _ in range(rng.randint(3, 20))])
    return out


def greedy(n: int = 6) -> hwkv.SamplingParams:
    return hwkv.SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def engine(model_dir: str, **kw) -> hwkv.Engine:
    kw = {"num_kv_blocks": 8, "block_size": BS, "max_model_len": 128, **kw}
    return hwkv.Engine(model_dir, **kw)


def run_one_by_one(e: hwkv.Engine, prompts: list[list[int]], n: int = 6) -> list[list[int]]:
    return [e.generate([p], greedy(n), use_tqdm=False)[0].token_ids for p in prompts]


def settle(e: hwkv.Engine) -> None:
    """Step until the connector's transfers ended (they finish on the steps after a request does)."""
    for _ in range(50):
        if not e.scheduler.connector.has_pending_transfers():
            return
        e.step()
    raise AssertionError("connector transfers never completed")


def assert_no_leak(e: hwkv.Engine) -> None:
    settle(e)
    assert not e.has_unfinished()
    assert e.kv_cache_manager.num_free_blocks == e.kv_cache.spec.num_blocks
    for m in getattr(e.kv_cache_manager, "managers", ()):  # KV-cache groups: every group's pool
        assert m.block_pool.num_free_blocks == m.block_pool.num_usable_blocks
    assert not e.runner.reqs and not e.scheduler.requests and not e.scheduler.loading
    sched = getattr(e.scheduler.connector, "scheduler", None)
    if getattr(sched, "cpu", None) is not None:  # the offload connector's scheduler side
        for cpu in sched.cpus:  # one host tier per KV-cache group
            assert cpu.num_free_blocks == cpu.num_blocks  # no host block pinned
            assert all(b.ref_cnt == 0 for b in cpu.blocks)
        assert not sched._jobs and not sched._pending_hits and not sched._reqs and not sched._storing
    if hasattr(sched, "_pending") and hasattr(sched, "_recent"):  # the pool connector's scheduler side
        assert not sched._jobs and not sched._pending and not sched._reqs and not sched._storing
        worker = e.scheduler.connector.worker
        assert not worker._flights and not worker._ending


def group_block_bytes(e: hwkv.Engine, rid: str) -> list[list[list[torch.Tensor] | None]]:
    """Per group, per block of the request's table, the block's data in every KV tensor of the group
    (``None`` for a null entry)."""
    out = []
    for cache, ids, m in zip(e.kv_cache.caches, e.kv_cache_manager.get_group_block_ids(rid),
                             e.kv_cache_manager.managers):
        out.append([None if b == 0 and m.block_pool.null_block is not None else [t[b].clone() for t in cache.tensors]
                    for b in ids])
    return out


def move_head_slices(prod: list, cons: list, total_heads: int, p_tp: int, d_tp: int, sb: list[int], db: list[int],
                     n: int) -> None:
    """Copy tokens ``[0, n)`` of blocks ``sb`` of the producer ranks' caches ``prod`` into blocks ``db`` of the
    consumer ranks' ``cons``, one ``pair_segments`` list per head slice (``map_kv_heads``), as the p2p
    connector's transfer would (a memmove per segment)."""
    import ctypes

    from hwkv.connectors.p2p.protocol import layout_of, pair_segments
    from hwkv.parallel.kv_mapping import map_kv_heads

    for sl in map_kv_heads(total_heads, p_tp, d_tp):
        a = layout_of(prod[sl.src_rank], "p", "x", "tcp", tp_rank=sl.src_rank, tp_size=p_tp)
        b = layout_of(cons[sl.dst_rank], "d", "y", "tcp", tp_rank=sl.dst_rank, tp_size=d_tp)
        for s, d, k in zip(*pair_segments(a, b, sb, db, 0, n, heads=sl)):
            ctypes.memmove(d, s, k)
