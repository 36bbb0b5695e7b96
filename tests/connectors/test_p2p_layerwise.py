"""Layerwise push, consumer first (vllm-ascend's layerwise flow): the decode engine announces its
blocks under a transfer id before the prefill runs, and the prefill engine writes each layer's KV
as its forward writes it (chunked prefill: every chunk). Tokens equal one engine's with layerwise
on and off (off: one write when the prefill ends), and with the announcement arriving late."""

from __future__ import annotations

import time

import pytest

import hwkv
from hwkv.testing.mooncake import skip_unless_mooncake

from .conftest import engine, greedy
from .test_p2p_engine import assert_clean, prompts

skip_unless_mooncake(allow_module_level=True)


@pytest.fixture(scope="module")
def reference(model_dir):
    e = engine(model_dir, num_kv_blocks=16)
    return [o.token_ids for o in e.generate(prompts(), greedy(6), use_tqdm=False)]


def run_pair(p: hwkv.Engine, d: hwkv.Engine, prompt: list[int], tid: str, consumer_first: bool = True) -> list[int]:
    host, port = p.scheduler.connector.worker.channel.address.split(":")
    d.add_request(tid, prompt, hwkv.SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, kv_transfer_params={
        "do_remote_prefill": True, "mode": "push", "remote_host": host, "remote_port": int(port), "transfer_id": tid}))
    pre = hwkv.SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                              kv_transfer_params={"do_remote_decode": True, "transfer_id": tid})
    if consumer_first:  # the announcement reaches the producer before its prefill is scheduled
        deadline = time.monotonic() + 10
        while not p.scheduler.connector.scheduler.state.targets:
            assert time.monotonic() < deadline
            d.step()
        p.add_request(tid, prompt, pre)
    else:
        p.add_request(tid, prompt, pre)
        p.step()  # admitted and (partly) prefilled before the consumer announces
        p.step()
    out: dict[str, list[int]] = {}
    deadline = time.monotonic() + 20
    while d.has_unfinished() or p.has_unfinished():
        assert time.monotonic() < deadline, "no progress"
        for o in p.step():
            assert o.request_id == tid
        out.update((o.request_id, o.token_ids) for o in d.step() if o.finished)
    return out[tid]


@pytest.mark.parametrize("layerwise", [True, False])
@pytest.mark.parametrize("chunk", [None, 16])
def test_layerwise_on_and_off_give_one_engines_tokens(model_dir, reference, layerwise, chunk):
    kw = {"max_num_batched_tokens": chunk} if chunk else {}
    p = engine(model_dir, num_kv_blocks=16, kv_connector="p2p", **kw, kv_connector_config={
        "role": "producer", "mode": "push", "layerwise": layerwise, "transfer_timeout_s": 3.0})
    d = engine(model_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config={"role": "consumer", "mode": "push", "transfer_timeout_s": 3.0})
    try:
        got = [run_pair(p, d, q, f"t{i}") for i, q in enumerate(prompts())]
        assert got == reference
        pst, dst = p.stats()["kv_connector"], d.stats()["kv_connector"]
        assert dst["load_failures"] == 0 and dst["external_hit_tokens"] == sum(len(q) - 1 for q in prompts())
        n_layers = p.kv_cache.spec.num_layers
        if layerwise:  # every layer of every forward chunk that held prompt tokens was written on its own
            assert pst["layer_writes"] >= n_layers * len(prompts())
        else:
            assert pst["layer_writes"] == 0
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_late_announcement_falls_back_to_one_write(model_dir, reference):
    p = engine(model_dir, num_kv_blocks=16, max_num_batched_tokens=16, kv_connector="p2p", kv_connector_config={
        "role": "producer", "mode": "push", "layerwise": True, "transfer_timeout_s": 3.0})
    d = engine(model_dir, num_kv_blocks=16, kv_connector="p2p",
               kv_connector_config={"role": "consumer", "mode": "push", "transfer_timeout_s": 3.0})
    try:
        assert run_pair(p, d, prompts()[4], "late", consumer_first=False) == reference[4]
        assert p.stats()["kv_connector"]["layer_writes"] == 0
        assert d.stats()["kv_connector"]["load_failures"] == 0
        assert_clean(p, d)
    finally:
        p.close()
        d.close()


def test_layerwise_config_is_checked(model_dir):
    with pytest.raises(ValueError, match="layerwise=True applies to a producer in mode 'push'"):
        engine(model_dir, kv_connector="p2p", kv_connector_config={"role": "consumer", "layerwise": True})
