"""P/D (the p2p connector) with KV-cache groups (docs/hybrid-models.md): a Gemma-3-shaped model (two
window-16 layers and a global one) runs with a full and a window group on both engines. The decode
engine continues from the prefill engine's KV with the plain engine's tokens (pull, push, tcp
staging through a host mirror, layerwise push); the window group moves only its live window (bytes
counted, and the loaded blocks compared with what a recompute writes); a failed load touching any
group's blocks recomputes with nothing leaked; engines that group differently are refused at the
handshake, naming both sides. Real ZMQ side channels and Mooncake's tcp transfer engine on loopback."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

import hwkv
from hwkv.connectors.p2p.protocol import group_mismatch, incompatibility, kv_segments, read_pieces, window_start
from hwkv.interfaces.transfer import TransferError
from hwkv.testing.mooncake import skip_unless_mooncake

from .conftest import BS, engine, greedy, group_block_bytes
from .test_p2p_engine import assert_clean, cfg, decode, prefill

skip_unless_mooncake(allow_module_level=True)

WINDOW = 16


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 16, 17, 40, 69, 100)]


@pytest.fixture(scope="module")
def reference(hybrid_dir):  # noqa: F811
    e = engine(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False)
    return [o.token_ids for o in e.generate(prompts(), greedy(6), use_tqdm=False)]


def pd(hybrid_dir: str, mode: str, staging: bool = False, part_tokens: int = 1024,  # noqa: F811
       **consumer_kw) -> tuple[hwkv.Engine, hwkv.Engine]:
    p = engine(hybrid_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config=cfg("producer", mode, staging=staging, part_tokens=part_tokens))
    d = engine(hybrid_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config=cfg("consumer", mode, staging=staging, part_tokens=part_tokens), **consumer_kw)
    return p, d


def expected_bytes(e: hwkv.Engine, prompt_len: int) -> int:
    """Bytes a load of ``[0, prompt_len - 1)`` moves: every token of the full group's layers, the
    window group's layers from the window's first block on."""
    spec, end = e.kv_cache.spec, prompt_len - 1
    per_token_layer = 2 * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize
    out = 0
    for g in e.config.kv_groups:
        lo = 0 if g.window is None else window_start(end, g.window, BS)
        out += len(g.layers) * (end - lo) * per_token_layer
    return out


@pytest.mark.parametrize("mode", ["pull", "push", "push-staged"])
def test_decode_from_remote_prefill_with_groups_moves_only_the_window(hybrid_dir, reference, mode):  # noqa: F811
    p, d = pd(hybrid_dir, mode.split("-")[0], staging=mode.endswith("staged"))
    try:
        for e in (p, d):
            assert [g.window for g in e.config.kv_groups] == [None, WINDOW]
            assert len(e.scheduler.connector.worker.layout.groups) == 2
        got, want_bytes = [], 0
        for q in prompts():
            params = prefill(p, q)
            assert len(params["remote_group_block_ids"]) == 1  # the window group's table travels too
            got.append(decode(d, q, params))
            want_bytes += expected_bytes(d, len(q))
        assert got == reference
        st = d.stats()["kv_connector"]
        assert st["load_failures"] == 0 and st["failed_transfers"] == 0
        assert st["external_hit_tokens"] == sum(len(q) - 1 for q in prompts())
        # the window group moved its window only: a 100-token prompt moves 99 tokens of the global layer
        # and 16..31 of each window layer
        assert st["loaded_bytes"] == want_bytes
        assert_clean(p, d)
        assert p.stats()["kv_connector"]["expired_holds"] == 0
    finally:
        p.close()
        d.close()


@pytest.mark.parametrize("mode", ["pull"])  # push writes through the same per-group plan (bytes: above)
def test_loaded_blocks_of_every_group_equal_a_recompute(hybrid_dir, mode):  # noqa: F811
    """Tokens alone do not show a window group that was never loaded (this tiny model gives the same
    tokens): the consumer's blocks of both groups hold exactly the KV a recompute writes, and its
    window group holds no block before the window."""
    prompt = prompts()[4]  # 69 tokens: 68 loaded, full blocks 0..3, window from block 3
    ref = engine(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False)
    ref.add_request("r", prompt, greedy(4))
    ref.step()
    want = group_block_bytes(ref, next(iter(ref.scheduler.requests)))  # the engine's id for the request
    p, d = pd(hybrid_dir, mode)
    try:
        params = prefill(p, prompt)
        d.add_request("r", prompt, hwkv.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True,
                                                       kv_transfer_params=params))
        rid = next(iter(d.scheduler.requests))
        for _ in range(200):  # until the load landed and the last prompt token was computed
            d.step()
            if d.scheduler.requests[rid].num_output_tokens:
                break
        got = group_block_bytes(d, rid)
        first = window_start(len(prompt) - 1, WINDOW, BS) // BS
        assert all(x is None for x in got[1][:first]) and got[1][first] is not None
        assert d.kv_cache_manager.num_live_blocks(rid)[1] == len(got[1]) - first
        for g, blocks in {0: range(4), 1: range(first, 4)}.items():
            for i in blocks:
                for a, b in zip(got[g][i], want[g][i]):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"group {g} block {i}")
        while d.has_unfinished():
            d.step()
        assert d.stats()["kv_connector"]["load_failures"] == 0
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def _window_ranges(e: hwkv.Engine) -> list[tuple[int, int]]:
    """Address ranges of the window group's KV tensors (where a transfer lands window-group blocks)."""
    g = [i for i, grp in enumerate(e.config.kv_groups) if grp.window is not None][0]
    return [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in e.kv_cache.caches[g].tensors]


@pytest.mark.parametrize("mode", ["pull", "push"])
def test_a_failed_window_group_load_recomputes_without_leaks(hybrid_dir, reference, mode):  # noqa: F811
    """The transfer moves the full group's segments, then fails on the window group's: the request
    recomputes from scratch (its blocks are freed unregistered; the recompute registers its own), tokens
    identical, nothing left pinned or held on either side; the next loads succeed."""
    p, d = pd(hybrid_dir, mode)
    side = d if mode == "pull" else p  # the worker side that issues the copies
    t = side.scheduler.connector.worker.transfer
    name = "read" if mode == "pull" else "write"
    real, windows = getattr(t, name), _window_ranges(d)
    fail = {"on": True, "hits": 0}

    def partial(endpoint, a, b, ln):  # pull: read(ep, local dst, remote src); push: write(ep, local src, remote dst)
        dst = a if mode == "pull" else b
        win = [any(lo <= x < hi for lo, hi in windows) for x in dst]
        if fail["on"] and any(win):
            keep = [i for i, w in enumerate(win) if not w]
            real(endpoint, [a[i] for i in keep], [b[i] for i in keep], [ln[i] for i in keep])
            fail["hits"] += 1
            raise TransferError("injected: the window group's segments failed")
        return real(endpoint, a, b, ln)

    setattr(t, name, partial)
    try:
        got = []
        for i, q in enumerate(prompts()):
            fail["on"] = i % 2 == 1
            got.append(decode(d, q, prefill(p, q)))
        assert got == reference
        st = d.stats()["kv_connector"]
        assert fail["hits"] == 3 and st["load_failures"] == 3
        # the successful loads (prompts 0, 2, 4) only
        assert st["external_hit_tokens"] == sum(len(q) - 1 for q in prompts()[0::2])
        again = decode(d, prompts()[5], prefill(p, prompts()[5]))  # a failed prompt again: its recomputed blocks
        assert again == reference[5]
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_read_pieces_are_in_token_order_on_block_boundaries():
    assert read_pieces(0, 99, 16) == [(0, 32), (32, 64), (64, 96), (96, 99)]
    assert read_pieces(32, 99, 16) == [(32, 64), (64, 96), (96, 99)]  # after a local hit
    assert read_pieces(0, 96, 16, pieces=2) == [(0, 48), (48, 96)]
    assert read_pieces(0, 5, 16) == [(0, 5)] and read_pieces(7, 7, 16) == []
    assert read_pieces(0, 3000, 16, min_tokens=1024) == [(0, 1024), (1024, 2048), (2048, 3000)]
    assert read_pieces(0, 1000, 16, min_tokens=1024) == [(0, 1000)]  # one part: one transfer call
    from hwkv.connectors.p2p.state import P2PConfig

    for bad in (0, -16, 2.5, True, 1 << 25):
        with pytest.raises(ValueError, match=r"part_tokens=.* is invalid \(allowed: an int in 1\.\.16777216"):
            P2PConfig(role="consumer", part_tokens=bad)
    for start, end, n in ((0, 1000, 4), (16, 17, 4), (48, 1000, 7), (0, 2048, 1)):
        parts = read_pieces(start, end, 16, pieces=n)
        assert parts[0][0] == start and parts[-1][1] == end and len(parts) <= n
        assert all(b == c and b % 16 == 0 for (_, b), (c, _) in zip(parts, parts[1:]))


@pytest.mark.parametrize("model, mode, staging, fail_call, kept, cached", [
    ("llama", "pull", False, 3, 64, 64),  # one group: parts [0,32) [32,64) landed, [64,96) failed
    ("llama", "pull", True, 2, 32, 32),  # the same through tcp staging (the landed parts staged to the device)
    ("llama", "push", False, 3, 64, 64),
    ("hybrid", "pull", False, 4, 96, 96),  # [96,99) failed: the window's blocks 80-95 had landed, a 96-token hit
    ("hybrid", "pull", True, 4, 96, 96),
    ("hybrid", "push", False, 4, 96, 96),
    ("hybrid", "pull", False, 3, 64, 0),  # [64,96) failed: kept, but no hit - the window before 64 was never loaded
])
def test_a_load_failing_part_way_keeps_what_landed(model_dir, hybrid_dir, model, mode, staging, fail_call,  # noqa: F811
                                                   kept, cached):
    """A load is copied in parts in token order (`read_pieces`: [0,32) [32,64) [64,96) [96,99) for a
    100-token prompt; pull: the consumer's reads, push: the producer's writes) and the ``fail_call``-th
    copy fails: the parts before it stay in the consumer's prefix cache (``load_kept_tokens``), the
    request re-admits on the hit every group serves from them and recomputes only the rest - the plain
    engine's tokens, nothing left pinned or held."""
    path = model_dir if model == "llama" else hybrid_dir
    q = [random.Random(5).randrange(3, 250) for _ in range(100)]
    want = engine(path, num_kv_blocks=16, enable_prefix_caching=False).generate([q], greedy(6), use_tqdm=False)[0]
    p, d = pd(path, mode, staging=staging, part_tokens=16)  # parts of one block and more (default: 1024 tokens)
    t = (d if mode == "pull" else p).scheduler.connector.worker.transfer
    name = "read" if mode == "pull" else "write"
    real, calls = getattr(t, name), [0]

    def flaky(endpoint, a, b, ln):
        calls[0] += 1
        if calls[0] == fail_call:
            raise TransferError(f"injected: copy {fail_call} failed")
        return real(endpoint, a, b, ln)

    setattr(t, name, flaky)
    try:
        sp = hwkv.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, kv_transfer_params=prefill(p, q))
        out = d.generate([q], sp, use_tqdm=False)[0]
        assert out.token_ids == want.token_ids
        st = d.stats()["kv_connector"]
        assert calls[0] == fail_call and st["load_failures"] == 1 and st["external_hit_tokens"] == 0
        assert st["load_kept_tokens"] == kept and out.metrics.num_cached_tokens == cached
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_engines_that_group_differently_are_refused_naming_both(hybrid_dir, reference):  # noqa: F811
    """A grouped producer and a consumer with one group of every layer (``kv_cache_groups=False``): the
    consumer refuses the offer (recomputes: identical tokens, the producer's hold released), and the
    handshake itself refuses with both engines' groups named."""
    p, d = pd(hybrid_dir, "pull", kv_cache_groups=False)
    try:
        assert d.config.kv_groups is None or len(d.config.kv_groups) <= 1
        q = prompts()[4]
        assert decode(d, q, prefill(p, q)) == reference[4]
        assert d.stats()["kv_connector"]["refused_offers"] == 1
        assert_clean(p, d)
        assert p.stats()["kv_connector"]["expired_holds"] == 0
        mine, theirs = d.scheduler.connector.worker.layout, p.scheduler.connector.worker.layout
        why = incompatibility(mine, theirs)
        assert why.startswith("the KV-cache groups differ: one KV-cache group of every layer at engine "
                              f"{mine.engine_id}, KV-cache groups full: layers 2; window 16: layers 0,1 at engine "
                              f"{theirs.engine_id}")
        with pytest.raises(RuntimeError, match="refused: the KV-cache groups differ"):
            d.scheduler.connector.worker._handshake(theirs.side_channel)
    finally:
        p.close()
        d.close()


def test_group_mismatches_and_window_segments():
    """The handshake's group check (windows, layer map) and the per-group segment plan, on layouts."""
    from hwkv.connectors.p2p.protocol import KVGroup, Layout

    def lay(eid: str, groups: list[KVGroup], bs: int = 4) -> Layout:
        n = sum(g.tensors for g in groups)
        return Layout(eid, "ep", "tcp", "per_layer", 3, bs, 8, 1, 2, "float32",
                      [1 << 20 * (i + 1) for i in range(n)], [2 * bs * 2 * 4] * n, groups=groups)

    full, win = KVGroup(0, [2], 8, 1), KVGroup(8, [0, 1], 5, 2)
    a = lay("A", [full, win])
    assert group_mismatch(a, lay("B", [full, win], bs=8)) == ""  # block sizes may differ
    why = group_mismatch(a, lay("B", [full, KVGroup(4, [0, 1], 5, 2)]))
    assert "window 8: layers 0,1 at engine A" in why and "window 4: layers 0,1 at engine B" in why
    why = group_mismatch(a, lay("B", [KVGroup(0, [0], 8, 1), KVGroup(8, [1, 2], 5, 2)]))
    assert "full: layers 2; window 8: layers 0,1 at engine A" in why and "full: layers 0" in why
    b = lay("B", [full, win])
    # tokens [0, 14): the full group moves all of them, the window group from window_start(14) = 4 on
    src_ids, dst_ids = [[1, 2, 3, 4], [0, 3, 4, 1]], [[5, 6, 7, 0], [0, 2, 1, 3]]
    sp, dp, ln = kv_segments(a, b, src_ids, dst_ids, 0, 14)
    unit = 2 * 4  # one token of one layer's K (or V): 1 head x 2 floats
    assert sum(ln) == 2 * unit * (14 + 2 * (14 - window_start(14, 8, 4)))
    assert window_start(14, 8, 4) == 4
    with pytest.raises(ValueError, match="engine A no longer holds window-8 group blocks of tokens"):
        kv_segments(a, b, [[1, 2, 3, 4], [0, 0, 4, 1]], dst_ids, 0, 14)
    # a layerwise write of layer 2 (the full group's only layer) moves the full group only
    sp, dp, ln = kv_segments(a, b, src_ids, dst_ids, 0, 14, layers=range(2, 3))
    assert sum(ln) == 2 * unit * 14
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(a), type=Layout) == a  # travels in the Hello


@pytest.mark.parametrize("chunk", [16])  # chunked prefill: every chunk's layers written as they are computed
def test_layerwise_push_with_groups(hybrid_dir, reference, chunk):  # noqa: F811
    """Consumer first: the producer writes each layer's KV as its forward writes it (every chunk of a
    chunked prefill), the window layers only the consumer's window; tokens equal the plain engine's."""
    from .test_p2p_layerwise import run_pair

    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    p = engine(hybrid_dir, num_kv_blocks=16, kv_connector="p2p", **kw, kv_connector_config={
        "role": "producer", "mode": "push", "layerwise": True, "transfer_timeout_s": 3.0})
    d = engine(hybrid_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config={"role": "consumer", "mode": "push", "transfer_timeout_s": 3.0})
    try:
        assert [g.window for g in p.config.kv_groups] == [None, WINDOW]
        got = [run_pair(p, d, q, f"t{i}") for i, q in enumerate(prompts())]
        assert got == reference
        st = d.stats()["kv_connector"]
        assert st["load_failures"] == 0 and st["external_hit_tokens"] == sum(len(q) - 1 for q in prompts())
        assert p.stats()["kv_connector"]["layer_writes"] >= len(prompts())
        assert st["loaded_bytes"] == sum(expected_bytes(d, len(q)) for q in prompts())  # window layers: the window
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


@pytest.fixture(scope="module")
def long_dir(tmp_path_factory):
    """The hybrid model's shape with room for 1024 positions."""
    import transformers

    cfg = transformers.Gemma3TextConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=512, max_position_embeddings=1024, initializer_range=0.2, bos_token_id=1,
        eos_token_id=2, query_pre_attn_scalar=16, sliding_window=WINDOW, sliding_window_pattern=3)
    torch.manual_seed(11)
    path = tmp_path_factory.mktemp("hybrid-long")
    transformers.Gemma3ForCausalLM(cfg).float().eval().save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("mode", ["pull"])  # the consumer's allocation, the same in either mode
def test_a_prompt_longer_than_the_window_groups_pool(long_dir, mode):
    """600 prompt tokens into a window group of 8 blocks (2 seats, 32-token steps): the consumer's window
    group allocates only the window of the loaded prompt (null entries before it), instead of refusing
    an allocation it was checked for; tokens of the plain engine, every pool whole."""
    kw = dict(num_kv_blocks=64, max_model_len=1024, max_num_seqs=2, max_num_batched_tokens=32)
    rng = random.Random(1)
    q = [rng.randrange(3, 500) for _ in range(600)]
    want = engine(long_dir, enable_prefix_caching=False, **kw).generate([q], greedy(4), use_tqdm=False)[0].token_ids
    p = engine(long_dir, kv_connector="p2p", kv_connector_config=cfg("producer", mode), **kw)
    d = engine(long_dir, kv_connector="p2p", kv_connector_config=cfg("consumer", mode), **kw)
    try:
        assert [(g.window, g.num_blocks) for g in d.config.kv_groups] == [(None, 64), (WINDOW, 9)]
        assert decode(d, q, prefill(p, q), n=4) == want
        st = d.stats()["kv_connector"]
        assert st["load_failures"] == 0 and st["external_hit_tokens"] == len(q) - 1
        assert st["loaded_bytes"] == expected_bytes(d, len(q))
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_a_local_prefix_hit_loads_only_the_rest(hybrid_dir):  # noqa: F811
    """The consumer already holds a 4-block prefix in both groups (an earlier request): the offer starts
    after it, the full group loads the rest of the prompt and the window group its window; the plain
    engine's tokens, nothing leaked."""
    rng = random.Random(8)
    prefix = [rng.randrange(3, 500) for _ in range(4 * BS)]
    first = prefix + [rng.randrange(3, 500) for _ in range(3)]
    second = prefix + [rng.randrange(3, 500) for _ in range(40)]
    plain = engine(hybrid_dir, num_kv_blocks=64, enable_prefix_caching=False)
    want = [plain.generate([q], greedy(6), use_tqdm=False)[0].token_ids for q in (first, second)]
    p, d = pd(hybrid_dir, "pull")
    try:
        assert decode(d, first, prefill(p, first)) == want[0]
        before = d.stats()["kv_connector"]["loaded_bytes"]
        assert decode(d, second, prefill(p, second)) == want[1]
        st = d.stats()
        assert st["prefix_cache_hits"] >= 4 * BS  # the consumer's own blocks of the prefix (both groups)
        spec, end = d.kv_cache.spec, len(second) - 1
        per = 2 * spec.num_kv_heads * spec.head_size * spec.dtype.itemsize
        full = (end - 4 * BS) * per  # one global layer, from the hit on
        window = 2 * (end - max(4 * BS, window_start(end, WINDOW, BS))) * per  # two window layers
        assert st["kv_connector"]["loaded_bytes"] - before == full + window
        assert st["kv_connector"]["load_failures"] == 0
        assert_clean(p, d)
    finally:
        p.close()
        d.close()
