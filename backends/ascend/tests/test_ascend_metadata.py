"""Metadata conversion: cumulative vs per-request lengths, the op arguments, dummy-request padding,
block-size refusal, host-only reads."""

from __future__ import annotations

import pytest
import torch

from hwkv.interfaces import AttentionMetadata, KVCacheSpec, KVLayoutKind


def spy(mod, name):
    """Record the keyword arguments of every call of ``mod.name`` and forward them."""
    calls, real = [], getattr(mod, name)

    def wrapper(*args, **kwargs):
        assert not args, f"{name} must be called with keyword arguments only"
        calls.append(kwargs)
        return real(**kwargs)

    setattr(mod, name, wrapper)
    return calls


def setup(num_heads=4, num_kv_heads=2, head_size=64, num_blocks=8, dtype=torch.float16):
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    spec = KVCacheSpec(1, num_blocks, 128, num_kv_heads, head_size, dtype)
    kv = backend.device.allocate_kv_cache(spec, KVLayoutKind.SEPARATE_KV).layer(0)
    impl = backend.attention.make_impl(num_heads, head_size, num_kv_heads, head_size**-0.5)
    return backend, kv, impl


def qkv(n, num_heads=4, num_kv_heads=2, head_size=64, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, num_heads, head_size, generator=g).to(dtype),
            torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype),
            torch.randn(n, num_kv_heads, head_size, generator=g).to(dtype))


def test_cumulative_query_ends_and_per_request_kv_lengths(npu):
    backend, kv, impl = setup()
    md = AttentionMetadata.build([3, 1, 5], [3, 10, 133], [[0], [1], [2, 3]], 128)
    amd = backend.attention.metadata_builder().build(md)
    assert amd.state.value == "chunked_prefill"
    assert amd.actual_seq_lengths_q == [3, 4, 9]  # cumulative query ends (TND)
    assert amd.seq_lens_list == [3, 10, 133]  # per-request KV lengths
    assert amd.seq_lens.dtype == torch.int32 and amd.seq_lens.device.type == "cpu"
    assert amd.num_tokens == amd.num_actual_tokens == 9

    calls = spy(npu, "npu_fused_infer_attention_score")
    q, k, v = qkv(9)
    impl.write_kv(k, v, kv, md.slot_mapping)
    impl.forward(q, k, v, kv, amd)
    (c,) = calls
    assert c["input_layout"] == "TND" and c["sparse_mode"] == 3 and c["block_size"] == 128
    assert c["actual_seq_lengths"] == [3, 4, 9] and c["actual_seq_lengths_kv"] == [3, 10, 133]
    assert c["block_table"].dtype == torch.int32 and c["block_table"].shape == (3, 2)
    assert c["key"].shape == (8, 128, 2 * 64) and c["value"].shape == (8, 128, 2 * 64)  # (blocks, bs, H_kv*D)
    assert c["num_heads"] == 4 and c["num_key_value_heads"] == 2 and c["scale"] == pytest.approx(64**-0.5)
    mask = c["atten_mask"]
    assert mask.shape == (2048, 2048) and mask.dtype == torch.int8
    assert mask[0, 1] == 1 and mask[1, 0] == 0 and mask[5, 5] == 0  # 1 = masked, strictly above the diagonal


def test_prefill_without_cache_reads_raw_kv_with_cumulative_kv_ends(npu):
    backend, kv, impl = setup()
    md = AttentionMetadata.build([4, 6], [4, 6], [[0], [1]], 128)
    amd = backend.attention.metadata_builder().build(md)
    assert amd.state.value == "prefill_no_cache"
    calls = spy(npu, "npu_fused_infer_attention_score")
    q, k, v = qkv(10)
    impl.write_kv(k, v, kv, md.slot_mapping)
    impl.forward(q, k, v, kv, amd)
    (c,) = calls
    assert c["block_table"] is None
    assert c["key"] is k or torch.equal(c["key"], k)  # this step's K, TND [T, H_kv, D]
    assert c["actual_seq_lengths"] == [4, 10] and c["actual_seq_lengths_kv"] == [4, 10]


def test_decode_only_uses_atb_paged_attention(npu):
    backend, kv, impl = setup()
    md = AttentionMetadata.build([1, 1], [7, 129], [[0], [1, 2]], 128)
    amd = backend.attention.metadata_builder().build(md)
    assert amd.state.value == "decode_only"
    pa = spy(npu, "_npu_paged_attention")
    fia = spy(npu, "npu_fused_infer_attention_score")
    q, k, v = qkv(2)
    impl.write_kv(k, v, kv, md.slot_mapping)
    out = impl.forward(q, k, v, kv, amd)
    assert fia == [] and len(pa) == 1
    c = pa[0]
    assert c["context_lens"].tolist() == [7, 129] and c["context_lens"].dtype == torch.int32
    assert c["block_table"].dtype == torch.int32 and c["num_kv_heads"] == 2 and c["num_heads"] == 4
    assert c["out"] is out and c["scale_value"] == pytest.approx(64**-0.5)


def padded(md: AttentionMetadata, pad: int) -> AttentionMetadata:
    """Core metadata whose token dimension is padded with ``pad`` unwritten (-1) slots."""
    sm = md.slot_mapping
    md.slot_mapping = torch.cat([sm, torch.full((pad,), -1, dtype=sm.dtype, device=sm.device)])
    return md


@pytest.mark.parametrize("reqs", [[(0, 5), (0, 3)], [(10, 4), (130, 1)]], ids=["no_cache", "mixed"])
def test_dummy_request_pads_query_lengths_to_token_count(npu, reqs):
    backend, kv, impl = setup()
    qlens, slens = [q for _, q in reqs], [c + q for c, q in reqs]
    md = AttentionMetadata.build(qlens, slens, [[0, 1], [2, 3]], 128)
    n = sum(qlens)
    q, k, v = qkv(n + 3, seed=1)
    impl.write_kv(k[:n], v[:n], kv, md.slot_mapping)  # unpadded run first: the expected rows
    builder = backend.attention.metadata_builder()
    want = impl.forward(q[:n], k[:n], v[:n], kv, builder.build(md))

    kv_before = [t.clone() for t in kv]
    md = padded(md, 3)
    amd = builder.build(md)
    assert amd.num_actual_tokens == n and amd.num_tokens == n + 3
    assert amd.actual_seq_lengths_q[-1] == n + 3 and len(amd.actual_seq_lengths_q) == len(reqs) + 1
    assert amd.seq_lens_list[-1] == 1 and amd.block_tables.shape[0] == len(reqs) + 1
    assert amd.block_tables[-1].tolist() == [0, 0]
    writes = spy(npu, "npu_scatter_pa_kv_cache")
    impl.write_kv(k, v, kv, md.slot_mapping)  # sliced to the real tokens: the kernel never sees -1
    assert all(torch.equal(a, b) for a, b in zip(kv, kv_before))
    (w,) = writes
    assert w["slot_mapping"].shape == (n,) and w["key"].shape[0] == n and bool((w["slot_mapping"] >= 0).all())
    got = impl.forward(q, k, v, kv, amd)
    assert got.shape == (n + 3, 4, 64)
    torch.testing.assert_close(got[:n], want, atol=0, rtol=0)


def test_decode_only_padding_adds_one_row_per_padded_token(npu):
    backend, kv, impl = setup()
    md = padded(AttentionMetadata.build([1, 1], [9, 3], [[0], [1]], 128), 2)
    amd = backend.attention.metadata_builder().build(md)
    assert amd.state.value == "decode_only"
    assert amd.actual_seq_lengths_q == [1, 2, 3, 4] and amd.seq_lens_list == [9, 3, 1, 1]
    q, k, v = qkv(4)
    writes = spy(npu, "npu_scatter_pa_kv_cache")
    impl.write_kv(k, v, kv, md.slot_mapping)
    assert writes[0]["slot_mapping"].tolist() == md.slot_mapping[:2].tolist()
    assert impl.forward(q, k, v, kv, amd).shape == (4, 4, 64)


def test_builder_reads_only_host_tensors(npu):
    """Device tensors on the meta device have no data: any read of them (a device sync) fails."""
    backend, _, _ = setup()
    md = AttentionMetadata.build([3, 1], [3, 200], [[0], [1, 2]], 128, device="meta")
    amd = backend.attention.metadata_builder().build(padded(md, 2))
    assert amd.actual_seq_lengths_q == [3, 4, 6] and amd.block_tables.device.type == "meta"


def test_block_size_other_than_128_is_refused(npu):
    from hwkv_ascend.backend import AscendBackend

    caps = AscendBackend().capabilities
    for bs in (16, 64, 256):
        reasons = caps.validate(KVCacheSpec(2, 8, bs, 2, 64, torch.float16))
        assert reasons == [f"block_size {bs} not supported (allowed: exactly 128)"]
    assert caps.validate(KVCacheSpec(2, 8, 128, 2, 64, torch.bfloat16), layout=KVLayoutKind.SEPARATE_KV) == []
    assert caps.default_block_size == 128 and caps.test_block_sizes() == (128,)
    md = AttentionMetadata.build([2], [2], [[0]], 16)
    with pytest.raises(ValueError, match="block_size 16 not supported.*exactly 128"):
        AscendBackend().attention.metadata_builder().build(md)


def test_capabilities_refuse_what_the_ops_do_not_take(npu):
    from hwkv_ascend.backend import AscendBackend

    caps = AscendBackend().capabilities
    (r,) = caps.validate(KVCacheSpec(1, 4, 128, 2, 64, torch.float32))
    assert r.startswith("dtype float32 not supported (allowed: float16, bfloat16)")
    (r,) = caps.validate(KVCacheSpec(1, 4, 128, 2, 256, torch.float16))
    assert r.startswith("head_size 256 not supported")
    (r,) = caps.validate(KVCacheSpec(1, 4, 128, 2, 64, torch.float16), layout=KVLayoutKind.PER_LAYER)
    assert "KV layout per_layer not supported" in r


def test_padding_slots_never_reach_the_kernel(npu):
    """The emulated A2 rejects negative slots (the skip is confirmed on A3 with CANN 9 only): a KV
    write that handed the kernel the -1 padding would fail here."""
    backend, kv, impl = setup()
    md = padded(AttentionMetadata.build([3, 2], [3, 2], [[0], [1]], 128), 4)
    q, k, v = qkv(9)
    with pytest.raises(RuntimeError, match="negative slots are skipped only on A3"):
        npu.npu_scatter_pa_kv_cache(key=k, value=v, key_cache=kv[0], value_cache=kv[1],
                                    slot_mapping=md.slot_mapping, cache_mode="Norm")
    backend.attention.metadata_builder().build(md)  # the step: 5 real tokens, 4 padding
    impl.write_kv(k, v, kv, md.slot_mapping)
    slots = md.slot_mapping[:5]
    assert torch.equal(kv[0].view(-1, 2, 64)[slots], k[:5]) and torch.equal(kv[1].view(-1, 2, 64)[slots], v[:5])


def test_write_outside_a_step_skips_negative_slots_anywhere(npu):
    """A direct write (no step metadata: e.g. the conformance KV-write probes) with -1 in the middle."""
    _, kv, impl = setup()
    _, k, v = qkv(4)
    slots = torch.tensor([7, -1, 130, -1])
    writes = spy(npu, "npu_scatter_pa_kv_cache")
    impl.write_kv(k, v, kv, slots)
    assert writes[0]["slot_mapping"].tolist() == [7, 130]
    assert torch.equal(kv[0].view(-1, 2, 64)[[7, 130]], k[[0, 2]])
    assert int(kv[0].view(-1, 2 * 64).any(dim=1).sum()) == 2
    impl.write_kv(k, v, kv, torch.full((4,), -1))  # nothing to write: no call at all
    assert len(writes) == 1


@pytest.mark.parametrize("head_size", [16, 32, 80, 96, 256])
def test_head_sizes_outside_fia_tnd_are_refused(npu, head_size):
    from hwkv_ascend.backend import AscendBackend

    backend = AscendBackend()
    with pytest.raises(ValueError, match=rf"head_size {head_size} not supported .*TND .*64/128/192"):
        backend.attention.make_impl(4, head_size, 2, 1.0)
    (r,) = backend.capabilities.validate(KVCacheSpec(1, 4, 128, 2, head_size, torch.float16))
    assert r == f"head_size {head_size} not supported (allowed: [64, 128, 192])"


def test_head_192_decodes_through_fia(npu):
    """ATB paged attention takes block_size * head_size <= 128 * 128: 192 at block 128 goes to FIA."""
    backend, kv, impl = setup(head_size=192)
    md = AttentionMetadata.build([1, 1], [7, 129], [[0], [1, 2]], 128)
    amd = backend.attention.metadata_builder().build(md)
    pa, fia = spy(npu, "_npu_paged_attention"), spy(npu, "npu_fused_infer_attention_score")
    q, k, v = qkv(2, head_size=192)
    impl.write_kv(k, v, kv, md.slot_mapping)
    impl.forward(q, k, v, kv, amd)
    assert pa == [] and len(fia) == 1 and fia[0]["actual_seq_lengths"] == [1, 2]
    assert fia[0]["actual_seq_lengths_kv"] == [7, 129] and fia[0]["block_table"] is not None


def test_more_than_256_heads_is_refused(npu, emulator):
    from hwkv_ascend.backend import AscendBackend

    with pytest.raises(ValueError, match=r"num_heads 512 not supported .*at most 256"):
        AscendBackend().attention.make_impl(512, 64, 8, 1.0)
    q = torch.zeros(2, 512, 64, dtype=torch.float16)
    k = torch.zeros(2, 8, 64, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="num_heads 512 must be <= 256"):
        emulator.npu_fused_infer_attention_score(
            query=q, key=k, value=k, input_layout="TND", num_heads=512, num_key_value_heads=8,
            actual_seq_lengths=[2], actual_seq_lengths_kv=[2])
