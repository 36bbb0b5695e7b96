"""The per-rank kernel profile's arithmetic (hwkv.engine.tp.profile) and its message."""

import msgspec

from hwkv.engine.tp import messages as m
from hwkv.engine.tp.profile import kind_of, summarize, table


def test_summarize_charges_overlap_once_and_counts_idle():
    # two steps: a GEMM, an overlapping push all-reduce (PDL-style tail overlap), a gap, an NCCL gather
    k = []
    for t0 in (0.0, 100.0):
        k += [(t0, t0 + 40, "dense_kernel"), (t0 + 30, t0 + 50, "push_all_reduce_kernel"),
              (t0 + 60, t0 + 70, "ncclDevKernel_AllGather_RING_LL")]
    s = summarize(k, steps=2)
    assert s["span_us_per_step"] == 85.0  # 0..170 over two steps
    assert s["idle_us_per_step"] == 25.0  # 50..60, 70..100 (between the steps), 150..160: 50 / 2
    assert s["busy_us_per_step"] == 60.0
    kinds = s["kinds"]
    assert kinds["gemm"] == {"critical_us": 40.0, "raw_us": 40.0, "calls": 1.0}
    assert kinds["push_allreduce"]["critical_us"] == 10.0 and kinds["push_allreduce"]["raw_us"] == 20.0
    assert kinds["nccl"]["critical_us"] == 10.0
    top = {r["name"]: r for r in s["top"]}
    assert top["push_all_reduce_kernel"]["us_per_call"] == 20.0
    assert top["dense_kernel"]["calls_per_step"] == 1.0
    assert "push_allreduce" in table(s, "rank 0")


def test_kinds_and_empty_window():
    assert kind_of("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "gemm"
    assert kind_of("attention_kernel") == "attention"
    assert kind_of("decode_heads_kernel") == "attention"  # the cuda backend's all-heads fp8 decode
    assert kind_of("Memcpy DtoD (Device -> Device)") == "memcpy"
    assert kind_of("triton_poi_fused_add_0") == "other"
    assert summarize([], steps=3) == {"steps": 3, "kernels": 0}
    assert "no kernels" in table({"steps": 3, "kernels": 0}, "rank 1")


def test_decode_gemvs_named_by_their_order():
    # two steps of a two-layer decode: qkv, o_proj, gate_up, down twice, then the LM head
    k, t = [], 0.0
    for _ in range(2):
        for _ in range(9):
            k.append((t, t + 1, "dense_kernel"))
            k.append((t + 1, t + 2, "attention_kernel"))
            t += 2
    s = summarize(k, steps=2)
    top = {r["name"]: r for r in s["top"]}
    assert top["dense_kernel:qkv"]["calls_per_step"] == 2.0
    assert top["dense_kernel:lm_head"]["calls_per_step"] == 1.0
    assert set(top) == {"attention_kernel"} | {f"dense_kernel:{n}" for n in ("qkv", "o_proj", "gate_up", "down",
                                                                              "lm_head")}
    assert s["kinds"]["gemm"]["calls"] == 9.0
    # a count that is not 4 x layers + 1 per step stays unnamed
    assert summarize(k[:4], steps=1)["top"][0]["name"] in ("dense_kernel", "attention_kernel")
    # the persistent variant (dense_kernel_stream: the 1B's gate_up, qkv, o_proj, LM head) counts in the same order
    mixed = [(a, b, "dense_kernel" if i % 8 == 6 else n.replace("dense_kernel", "dense_kernel_stream"))
             for i, (a, b, n) in enumerate(k)]
    assert {r["name"] for r in summarize(mixed, steps=2)["top"]} == set(top)


def test_profile_message_round_trip():
    enc, dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(m.ToWorker)
    assert dec.decode(enc.encode(m.Profile())) == m.Profile("")
    assert dec.decode(enc.encode(m.Profile("/tmp/x"))).path == "/tmp/x"
