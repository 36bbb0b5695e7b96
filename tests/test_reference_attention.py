"""Reference backend: paged attention vs an independent naive oracle, write_kv, CPU device."""

from __future__ import annotations

import math
import random
import time
import zlib

import pytest
import torch

from hwkv.interfaces import AttentionMetadata, KVCacheSpec, KVLayoutKind
from hwkv.reference import CpuBackend, CpuDevice, ReferenceAttentionBackend
from hwkv.reference import attention as ref_attn

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def naive_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """One request, float64, explicit causal softmax: q [Q, H, D] at positions ctx.., k/v [S, Hkv, D]."""
    q, k, v = q.double(), k.double(), v.double()
    nq, h, _ = q.shape
    group = h // k.shape[1]
    out = torch.empty_like(q)
    for head in range(h):
        kh, vh = k[:, head // group], v[:, head // group]
        for i in range(nq):
            logits = (kh @ q[i, head]) * scale
            logits = logits[: ctx + i + 1]  # causal: keys at positions <= ctx + i
            w = torch.exp(logits - logits.max())
            out[i, head] = (w / w.sum()) @ vh[: ctx + i + 1]
    return out


def make_case(states: list[str], hkv: int, group: int, bs: int, dtype: torch.dtype, seed: int, d: int = 16):
    """Requests in the given states with ragged lengths and shuffled, non-contiguous block tables."""
    gen = torch.Generator().manual_seed(seed)
    rnd = random.Random(seed)
    q_lens, seq_lens = [], []
    for st in states:
        if st == "prefill":
            n = rnd.randint(2, 23)
            q_lens.append(n), seq_lens.append(n)
        elif st == "chunked":
            c, n = rnd.randint(1, 30), rnd.randint(2, 17)
            q_lens.append(n), seq_lens.append(c + n)
        elif st == "decode":
            q_lens.append(1), seq_lens.append(rnd.randint(1, 40))
        else:
            raise AssertionError(st)
    need = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = sum(need) + 7
    ids = list(range(num_blocks))
    rnd.shuffle(ids)  # out of order and non-contiguous
    tables, pos = [], 0
    for n in need:
        tables.append(ids[pos : pos + n])
        pos += n
    h = hkv * group
    spec = KVCacheSpec(num_layers=1, num_blocks=num_blocks, block_size=bs, num_kv_heads=hkv, head_size=d, dtype=dtype)
    cache = CpuDevice().allocate_kv_cache(spec, KVLayoutKind.PER_LAYER)
    cache.tensors[0].fill_(float("nan"))  # unused slots must never leak into results
    layer = cache.layer(0)
    ks = [torch.randn(s, hkv, d, generator=gen).to(dtype) for s in seq_lens]
    vs = [torch.randn(s, hkv, d, generator=gen).to(dtype) for s in seq_lens]
    qs = [torch.randn(n, h, d, generator=gen).to(dtype) for n in q_lens]
    return q_lens, seq_lens, tables, layer, ks, vs, qs


def slots_for(table: list[int], positions: range, bs: int) -> list[int]:
    return [table[p // bs] * bs + p % bs for p in positions]


def run_reference(states, hkv, group, bs, dtype, seed, budget=None, monkeypatch=None):
    q_lens, seq_lens, tables, layer, ks, vs, qs = make_case(states, hkv, group, bs, dtype, seed)
    d = qs[0].shape[-1]
    scale = d**-0.5
    impl = ReferenceAttentionBackend().make_impl(hkv * group, d, hkv, scale)
    # The cached prefix (written by earlier steps).
    for t, s, ql, k, v in zip(tables, seq_lens, q_lens, ks, vs):
        ctx = s - ql
        if ctx:
            impl.write_kv(k[:ctx], v[:ctx], layer, torch.tensor(slots_for(t, range(ctx), bs)))
    md = AttentionMetadata.build(q_lens, seq_lens, tables, bs)
    new_k = torch.cat([k[s - ql :] for k, s, ql in zip(ks, seq_lens, q_lens)])
    new_v = torch.cat([v[s - ql :] for v, s, ql in zip(vs, seq_lens, q_lens)])
    impl.write_kv(new_k, new_v, layer, md.slot_mapping)
    if budget is not None:
        monkeypatch.setattr(ref_attn, "SCORE_BUDGET", budget)
    out = impl.forward(torch.cat(qs), new_k, new_v, layer, md)
    cases = zip(qs, ks, vs, seq_lens, q_lens)
    expect = torch.cat([naive_attention(q, k, v, s - ql, scale) for q, k, v, s, ql in cases])
    return out, expect


STATES = {
    "prefill": ["prefill", "prefill", "prefill"],
    "chunked": ["chunked", "chunked"],
    "decode": ["decode"] * 5,
    "mixed": ["decode", "chunked", "prefill", "decode", "chunked", "decode", "prefill"],
}
GEOMS = {"mha": (4, 1), "gqa2": (2, 2), "gqa4": (2, 4), "mqa": (1, 8)}  # (H_kv, group)


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("geom", list(GEOMS))
@pytest.mark.parametrize("bs", [1, 4, 16])
def test_attention_states_match_naive(state, geom, bs):
    hkv, group = GEOMS[geom]
    seed = zlib.crc32(f"{state}-{geom}-{bs}".encode())
    out, expect = run_reference(STATES[state], hkv, group, bs, torch.float32, seed=seed)
    assert out.dtype == torch.float32 and out.shape == expect.shape
    torch.testing.assert_close(out.double(), expect, atol=TOL[torch.float32], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_low_precision_output_dtype(dtype):
    out, expect = run_reference(STATES["mixed"], 2, 2, 8, dtype, seed=7)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), expect, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("budget", [1, 300, 5000])
def test_tiling_and_grouping_give_identical_results(budget, monkeypatch):
    # Tiny budgets force one query token per tile and many groups; the result must not change.
    out, expect = run_reference(STATES["mixed"], 2, 2, 4, torch.float32, seed=3, budget=budget, monkeypatch=monkeypatch)
    torch.testing.assert_close(out.double(), expect, atol=TOL[torch.float32], rtol=0)


def test_padding_query_rows_are_zero_and_separate_kv_pair_works():
    q_lens, seq_lens, tables, layer, ks, vs, qs = make_case(["chunked", "decode"], 2, 2, 4, torch.float32, seed=11)
    impl = ReferenceAttentionBackend().make_impl(4, 16, 2, 0.25)
    md = AttentionMetadata.build(q_lens, seq_lens, tables, 4)
    for t, k, v, s in zip(tables, ks, vs, seq_lens):
        impl.write_kv(k, v, layer, torch.tensor(slots_for(t, range(s), 4)))
    q = torch.cat(qs + [torch.randn(3, 4, 16)])  # 3 padding rows (e.g. graph bucket)
    out = impl.forward(q, q, q, layer, md)
    assert torch.equal(out[-3:], torch.zeros(3, 4, 16))
    sep = (layer[:, 0].contiguous(), layer[:, 1].contiguous())  # SEPARATE_KV layout of the same data
    torch.testing.assert_close(ref_attn.paged_attention(q, sep, md.query_start_loc_cpu, md.seq_lens_cpu,
                                                        md.block_tables, 0.25), out, atol=0, rtol=0)


def test_write_kv_skips_minus_one_slots():
    spec = KVCacheSpec(num_layers=1, num_blocks=3, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
    layer = CpuDevice().allocate_kv_cache(spec, KVLayoutKind.PER_LAYER).layer(0)
    impl = ReferenceAttentionBackend().make_impl(2, 8, 2, 1.0)
    k, v = torch.randn(4, 2, 8), torch.randn(4, 2, 8)
    impl.write_kv(k, v, layer, torch.tensor([9, -1, 0, -1]))
    assert torch.equal(layer[2, 0, 1], k[0]) and torch.equal(layer[2, 1, 1], v[0])
    assert torch.equal(layer[0, 0, 0], k[2]) and torch.equal(layer[0, 1, 0], v[2])
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[2, 1] = written[0, 0] = True
    assert torch.count_nonzero(layer.transpose(1, 2)[~written]) == 0  # nothing else touched
    impl.write_kv(k, v, layer, torch.full((4,), -1))  # all padding: no-op
    with pytest.raises(ValueError, match="slot_mapping value 12"):
        impl.write_kv(k, v, layer, torch.tensor([12, -1, -1, -1]))
    with pytest.raises(ValueError, match="slot_mapping value -2"):
        impl.write_kv(k, v, layer, torch.tensor([1, -2, -1, -1]))
    with pytest.raises(ValueError, match="key/value"):
        impl.write_kv(k[:, :1], v[:, :1], layer, torch.tensor([0, 1, 2, 3]))


def test_forward_rejects_bad_inputs():
    spec = KVCacheSpec(num_layers=1, num_blocks=4, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.float32)
    layer = CpuDevice().allocate_kv_cache(spec, KVLayoutKind.PER_LAYER).layer(0)
    impl = ReferenceAttentionBackend().make_impl(4, 8, 2, 1.0)
    md = AttentionMetadata.build([2], [6], [[1, 3]], 4)
    with pytest.raises(ValueError, match="query must be"):
        impl.forward(torch.randn(2, 3, 8), None, None, layer, md)
    with pytest.raises(ValueError, match="block_size"):
        impl.forward(torch.randn(2, 4, 8), None, None, layer, AttentionMetadata.build([2], [6], [[1, 3, 0]], 2))
    bad = AttentionMetadata.build([2], [6], [[1, 9]], 4)
    with pytest.raises(ValueError, match="block ids outside"):
        impl.forward(torch.randn(2, 4, 8), None, None, layer, bad)
    with pytest.raises(ValueError, match="num_kv_heads"):
        ReferenceAttentionBackend().make_impl(6, 8, 4, 1.0)


def test_cpu_backend_and_device():
    b = CpuBackend()
    assert CpuBackend.availability() == (True, "")
    caps = b.capabilities
    assert set(caps.dtypes) == {torch.float32, torch.float16, torch.bfloat16}
    assert caps.supports_block_size(1) and caps.supports_block_size(256) and not caps.supports_block_size(257)
    assert caps.default_block_size == 16 and caps.graph_capture is False and caps.head_sizes is None
    assert caps.kv_layouts == (KVLayoutKind.PER_LAYER,)
    if caps.transfer_protocols == ("cma",):  # same-host direct only: tcp needs the Mooncake wheel
        assert "pip install 'hwkv[mooncake]'" in caps.transfer_reason
    else:
        assert caps.transfer_protocols == ("cma", "tcp")
    dev = b.device
    free, total = dev.memory_info()
    assert 0 < free <= total
    assert dev.dist_backend == "gloo" and dev.torch_device == torch.device("cpu") and dev.description()
    s, e = dev.new_stream(), dev.new_event()
    with dev.stream_context(s):
        e.record(s)
    assert e.query() and s.query()
    s.wait_event(e), s.wait_stream(dev.current_stream()), e.synchronize(), dev.synchronize()
    t0, t1 = dev.new_event(enable_timing=True), dev.new_event(enable_timing=True)
    t0.record(), t1.record()
    assert t0.elapsed_time(t1) >= 0
    spec = KVCacheSpec(num_layers=2, num_blocks=5, block_size=4, num_kv_heads=2, head_size=8, dtype=torch.bfloat16)
    a = dev.allocate_kv_cache(spec, KVLayoutKind.PER_LAYER)
    host = dev.allocate_kv_cache(spec, KVLayoutKind.PER_LAYER, host=True)
    assert all(torch.count_nonzero(t) == 0 for t in a.tensors)
    for t in a.tensors:
        t.copy_(torch.randn(t.shape))
    dev.copy_blocks(a, host, [(0, 3), (4, 1)], stream=s)
    for ta, th in zip(a.tensors, host.tensors):
        assert torch.equal(th[3], ta[0]) and torch.equal(th[1], ta[4])
        assert torch.count_nonzero(th[[0, 2, 4]]) == 0
    assert dev.pinned_empty(64).numel() == 64


def test_decode_cost_does_not_grow_with_the_pool():
    """Only the blocks a step reads are gathered: a 128x larger pool (here 256 MiB per layer) must
    not make a decode step slower (copying the pool per call made it ~100x slower)."""
    bs, hkv, h, d, seq = 16, 2, 4, 16, 100
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, h, d, generator=gen)
    qsl, sl = torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([seq, seq], dtype=torch.int32)
    bt = torch.tensor([[3, 1, 4, 0, 5, 9, 2], [6, 8, 7, 10, 11, 12, 13]], dtype=torch.int32)
    head = torch.randn(16, 2, bs, hkv, d, generator=gen)  # the blocks the tables use

    def best_time(nb: int) -> tuple[float, torch.Tensor]:
        kv = torch.zeros(nb, 2, bs, hkv, d)
        kv[:16] = head
        times, out = [], None
        for _ in range(5):
            t = time.perf_counter()
            out = ref_attn.paged_attention(q, kv, qsl, sl, bt, 0.25)
            times.append(time.perf_counter() - t)
        return min(times), out

    small, out_small = best_time(256)
    large, out_large = best_time(256 * 128)
    assert torch.equal(out_small, out_large)
    assert large < 4 * small + 2e-3, (small, large)


def test_plan_is_shared_by_the_layers_and_follows_buffers_changed_in_place(monkeypatch):
    """The layers of a step plan once; a metadata buffer reused in place with new content re-plans
    (contents are compared, not objects), giving what a fresh call gives."""
    torch.manual_seed(0)
    kv = torch.randn(12, 2, 4, 2, 8)
    q = torch.randn(5, 4, 8)
    qsl, sl = torch.tensor([0, 1, 2, 5]), torch.tensor([9, 5, 7])
    bt = torch.tensor([[3, 4, 5], [6, 7, 0], [8, 9, 0]], dtype=torch.int32)
    calls = []
    real = ref_attn._plan
    monkeypatch.setattr(ref_attn, "_plan", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(ref_attn, "_last_plan", None)
    first = ref_attn.paged_attention(q, kv, qsl, sl, bt, 0.3)
    for _ in range(3):  # the other layers
        assert torch.equal(ref_attn.paged_attention(q, kv, qsl, sl, bt, 0.3), first)
    assert len(calls) == 1
    bt[[0, 2]] = bt[[2, 0]].clone()  # same buffer, same lengths, other blocks
    sl[0], sl[2] = 7, 9
    swapped = ref_attn.paged_attention(q, kv, qsl, sl, bt, 0.3)
    assert len(calls) == 2
    monkeypatch.setattr(ref_attn, "_last_plan", None)
    assert torch.equal(swapped, ref_attn.paged_attention(q, kv, qsl, sl, bt, 0.3))
    assert not torch.equal(swapped, first)
