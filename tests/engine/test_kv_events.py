"""KV events over real ZMQ sockets: a subscriber that knows nothing but the events rebuilds the
engine's prefix cache exactly (random traffic with evictions, salts and a reset), late and gapped
subscribers resynchronise (replay, snapshot), and the wire format is vLLM's."""

from __future__ import annotations

import random
import time
from typing import Any

import msgspec
import pytest
import zmq

import hwkv
from hwkv import SamplingParams
from hwkv.engine.kv_events import KVEventPublisher, KVEventSubscriber
from hwkv.model.tiny import write_tiny_model

BS = 16
ANY = "tcp://127.0.0.1:*"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("kv_events") / "m", seed=0))


def _engine(model_dir: str, **kw) -> hwkv.Engine:
    return hwkv.Engine(model_dir, num_kv_blocks=40, max_model_len=256, block_size=BS, kv_events_endpoint=ANY,
                       kv_events_replay_endpoint=ANY, **kw)


def _traffic(e: hwkv.Engine, rng: random.Random, n: int) -> None:
    """Multi-tenant prompts: shared system prompts, unique suffixes, some salted; 40 blocks evict."""
    systems = [[rng.randrange(1, 500) for _ in range(48)] for _ in range(3)]
    for _ in range(n):
        suffix = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 40))]
        prompt = rng.choice(systems)[: rng.choice((16, 32, 48))] + suffix
        sp = SamplingParams(max_tokens=rng.randrange(1, 20), temperature=0, cache_salt=rng.choice([None, None, "t-a"]))
        e.generate([prompt], sp, use_tqdm=False)


def _settled(sub: KVEventSubscriber, pub: KVEventPublisher, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while sub.next_seq != pub._seq:
        assert time.monotonic() < deadline, f"subscriber at seq {sub.next_seq}, publisher at {pub._seq}"
        time.sleep(0.01)


def _cached(e: hwkv.Engine) -> set[bytes]:
    return set(e.kv_cache_manager.block_pool.cached_block_hash_to_block)


def test_subscriber_rebuilds_the_prefix_cache(model_dir):
    e = _engine(model_dir)
    sub = KVEventSubscriber(e.kv_events.endpoint, e.kv_events.replay_endpoint)
    try:
        assert sub.wait_ready()
        rng = random.Random(0)
        for rnd in range(4):
            _traffic(e, rng, 12)
            _settled(sub, e.kv_events)
            assert sub.index.hashes("GPU") == _cached(e) and _cached(e), f"round {rnd}"
        assert e.kv_cache_manager.stats.evictions > 0  # the traffic evicted: removals were exercised
        assert e.kv_cache_manager.reset_prefix_cache()
        e.step()  # the reset's event goes out with the next step
        _settled(sub, e.kv_events)
        assert sub.index.hashes("GPU") == set()
        _traffic(e, rng, 5)
        _settled(sub, e.kv_events)
        assert sub.index.hashes("GPU") == _cached(e)
        assert sub.stats["snapshots"] == 0 and sub.stats["restarts"] == 0
    finally:
        sub.close()
        e.close()


def test_kv_cache_groups_report_the_first_groups_prefix_cache(tmp_path):
    """With KV-cache groups (a windowed Mistral: one window group; with offload, its host tier too) the
    events are the first group's: the subscriber's GPU set is that group's cached hashes, CPU its tier's."""
    path = str(write_tiny_model(tmp_path / "mistral", arch="mistral", sliding_window=16, max_position_embeddings=512))
    e = _engine(path, kv_cache_groups=True, kv_connector="offload",
                kv_connector_config={"cpu_bytes": 24 * _block_bytes(path)})
    sub = KVEventSubscriber(e.kv_events.endpoint, e.kv_events.replay_endpoint)
    try:
        assert [g.window for g in e.config.kv_groups] == [16]
        assert sub.wait_ready()
        rng = random.Random(3)
        pool = e.kv_cache_manager.managers[0].block_pool
        cpu = e.connector.scheduler.cpus[0]
        for rnd in range(2):
            _traffic(e, rng, 10)
            _drain(e)
            _settled(sub, e.kv_events)
            assert sub.index.hashes("GPU") == set(pool.cached_block_hash_to_block) and sub.index.hashes("GPU"), rnd
            assert sub.index.hashes("CPU") == set(cpu.cached_block_hash_to_block) and sub.index.hashes("CPU"), rnd
        snap = {ev.medium: set(ev.block_hashes) for ev in e._kv_snapshot()}
        assert snap == {"GPU": set(pool.cached_block_hash_to_block), "CPU": set(cpu.cached_block_hash_to_block)}
    finally:
        sub.close()
        e.close()


def _drain(e: hwkv.Engine, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while e.connector.has_pending_transfers():
        assert time.monotonic() < deadline, "connector transfers never completed"
        e.step()
        time.sleep(0.005)
    e.step()  # the completions' events go out with a step


def test_host_tier_events_track_the_offload_tier(model_dir):
    """medium "CPU": the subscriber's index is the host tier's registered hashes (stores land,
    LRU evictions of a small tier remove), and a snapshot carries both tiers."""
    e = _engine(model_dir, kv_connector="offload",
                kv_connector_config={"cpu_bytes": 24 * _block_bytes(model_dir), "store_batch_blocks": 1})
    sub = KVEventSubscriber(e.kv_events.endpoint, e.kv_events.replay_endpoint)
    try:
        assert sub.wait_ready()
        rng = random.Random(2)
        cpu = e.connector.scheduler.cpu
        for rnd in range(3):
            _traffic(e, rng, 10)
            _drain(e)
            _settled(sub, e.kv_events)
            assert sub.index.hashes("CPU") == set(cpu.cached_block_hash_to_block) and sub.index.hashes("CPU"), rnd
            assert sub.index.hashes("GPU") == _cached(e)
        assert cpu.stats.evictions > 0  # the tier evicted: removals were exercised
        snap = {ev.medium: set(ev.block_hashes) for ev in e._kv_snapshot()}
        assert snap == {"GPU": _cached(e), "CPU": set(cpu.cached_block_hash_to_block)}
    finally:
        sub.close()
        e.close()


def test_pool_tier_events_report_what_the_instance_knows_the_pool_holds(model_dir):
    """medium "POOL": chunks an instance put are stored; a second (load-only) instance learns them
    from its loads, and a lookup that finds a known chunk gone removes it and the chunks after it."""
    from hwkv.connectors.pool.store import drop_embedded, embedded_store

    cfg = {"store": "embedded", "store_name": "kv-events-pool"}
    a = _engine(model_dir, kv_connector="pool", kv_connector_config=cfg)
    b = _engine(model_dir, kv_connector="pool", kv_connector_config={**cfg, "save": False})
    sa = KVEventSubscriber(a.kv_events.endpoint, a.kv_events.replay_endpoint)
    sb = KVEventSubscriber(b.kv_events.endpoint, b.kv_events.replay_endpoint)
    try:
        assert sa.wait_ready() and sb.wait_ready()
        prompt = [random.Random(3).randrange(1, 500) for _ in range(5 * BS + 3)]
        chunks = _ordered_hashes(a, prompt)
        sp = SamplingParams(max_tokens=2, temperature=0)
        a.generate([prompt], sp, use_tqdm=False)
        _drain(a)
        _settled(sa, a.kv_events)
        assert sa.index.hashes("POOL") == set(chunks) == set(a.connector.scheduler._recent)
        b.generate([prompt], sp, use_tqdm=False)  # loads all 5 chunks
        _drain(b)
        _settled(sb, b.kv_events)
        assert sb.index.hashes("POOL") == set(chunks) and b.stats()["kv_connector"]["load_jobs"] == 1
        store = embedded_store("kv-events-pool")
        store.remove([k for k in list(store._values) if k.endswith(chunks[2].hex())])  # evicted behind b's back
        assert b.kv_cache_manager.reset_prefix_cache()
        b.generate([prompt], sp, use_tqdm=False)  # its lookup now ends at chunk 2
        _drain(b)
        _settled(sb, b.kv_events)
        assert sb.index.hashes("POOL") == set(chunks[:2]) == set(b.connector.scheduler._recent)
    finally:
        sa.close()
        sb.close()
        a.close()
        b.close()
        drop_embedded("kv-events-pool")


def _block_bytes(model_dir: str) -> int:
    e = hwkv.Engine(model_dir, num_kv_blocks=4, max_model_len=64, block_size=BS)
    try:
        return e.kv_cache.spec.bytes_per_block
    finally:
        e.close()


def test_late_subscriber_replays_and_a_gap_past_the_buffer_takes_a_snapshot(model_dir):
    e = _engine(model_dir)
    try:
        rng = random.Random(1)
        _traffic(e, rng, 10)
        late = KVEventSubscriber(e.kv_events.endpoint, e.kv_events.replay_endpoint)
        try:  # joins after the traffic: replays the whole history from seq 0
            assert late.wait_ready()
            _settled(late, e.kv_events)
            assert late.index.hashes("GPU") == _cached(e) and late.stats["replayed"] > 1
        finally:
            late.close()
        e.kv_events._buffer = type(e.kv_events._buffer)(e.kv_events._buffer, maxlen=2)  # history lost
        _traffic(e, rng, 10)
        gap = KVEventSubscriber(e.kv_events.endpoint, e.kv_events.replay_endpoint)
        try:
            assert gap.wait_ready()
            assert gap.stats["snapshots"] == 1 and gap.awaiting_snapshot
            deadline = time.monotonic() + 10
            while not e.kv_events.snapshot_wanted:
                assert time.monotonic() < deadline, "the snapshot request never reached the publisher"
                time.sleep(0.01)
            e.step()  # an idle step publishes the snapshot
            _settled(gap, e.kv_events)
            assert not gap.awaiting_snapshot and gap.index.hashes("GPU") == _cached(e)
            _traffic(e, rng, 4)
            _settled(gap, e.kv_events)
            assert gap.index.hashes("GPU") == _cached(e)
        finally:
            gap.close()
    finally:
        e.close()


def test_restarted_publisher_is_followed(model_dir):
    pub = KVEventPublisher(ANY, ANY)
    ep, rp = pub.endpoint, pub.replay_endpoint
    sub = KVEventSubscriber(ep, rp)
    try:
        assert sub.wait_ready()
        from hwkv.core.kv_events import BlockStored

        for i in range(5):
            pub.publish([BlockStored([bytes([i]) * 32], None, [], BS, None, "GPU")])
        _settled(sub, pub)
        assert len(sub.index.hashes()) == 5
        pub.close()
        pub = KVEventPublisher(ep, rp)  # same addresses, seq from 0, holds nothing
        pub.publish([BlockStored([b"\xff" * 32], None, [], BS, None, "GPU")])
        deadline = time.monotonic() + 10
        while sub.index.hashes() != {b"\xff" * 32}:
            assert time.monotonic() < deadline, f"stale view after a restart: {sub.stats}"
            time.sleep(0.02)
    finally:
        sub.close()
        pub.close()


# vLLM's subscriber-side types (examples/online_serving/kv_events_subscriber.py), declared here
# independently: hwkv's messages must decode with them.
class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]


class _KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    pass


class BlockStored(_KVCacheEvent):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(_KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(_KVCacheEvent):
    pass


class _KVEventBatch(_EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def test_wire_format_is_vllms(model_dir):
    e = _engine(model_dir)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(e.kv_events.endpoint)
    replay = ctx.socket(zmq.DEALER)
    replay.connect(e.kv_events.replay_endpoint)
    try:
        time.sleep(0.2)  # a SUB socket misses what is sent before it is connected
        prompt = list(range(1, 50))
        e.generate([prompt], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        dec = msgspec.msgpack.Decoder(_KVEventBatch)
        assert sub.poll(5000)
        topic, seq, payload = sub.recv_multipart()
        batch = dec.decode(payload)
        if int.from_bytes(seq, "big") == 0:  # the engine's first batch, sent up to send_interval_s late
            assert batch.events == [AllBlocksCleared()] and sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            batch = dec.decode(payload)
        assert topic == b"" and int.from_bytes(seq, "big") >= 1 and batch.ts > 0
        stored = [ev for ev in batch.events if isinstance(ev, BlockStored)]
        assert stored and stored[0].block_hashes[0] == _ordered_hashes(e, prompt)[0]
        assert stored[0].parent_block_hash is None and stored[0].token_ids[:BS] == prompt[:BS]
        assert stored[0].block_size == BS and stored[0].medium == "GPU" and stored[0].lora_id is None
        replay.send_multipart((b"", (0).to_bytes(8, "big")))  # vLLM's replay request
        frames = []
        while True:
            assert replay.poll(5000)
            _, seq_b, data = replay.recv_multipart()
            if seq_b == (-1).to_bytes(8, "big", signed=True):
                break
            frames.append((int.from_bytes(seq_b, "big"), dec.decode(data)))
        assert frames[0][0] == 0 and isinstance(frames[0][1].events[0], AllBlocksCleared)
        assert [s for s, _ in frames] == list(range(len(frames)))
    finally:
        sub.close(0)
        replay.close(0)
        ctx.term()
        e.close()


def _ordered_hashes(e: hwkv.Engine, prompt: list[int]) -> list[bytes]:
    from hwkv.core.hashing import hash_token_blocks

    return hash_token_blocks(prompt, BS)


def test_bad_configuration(model_dir):
    with pytest.raises(ValueError, match="kv_events_endpoint must be None or a ZMQ endpoint"):
        hwkv.Engine(model_dir, num_kv_blocks=8, max_model_len=64, kv_events_endpoint="localhost:5557")
    with pytest.raises(ValueError, match="kv_events_replay_endpoint needs kv_events_endpoint"):
        hwkv.Engine(model_dir, num_kv_blocks=8, max_model_len=64, kv_events_replay_endpoint=ANY)
    pub = KVEventPublisher(ANY)
    try:
        with pytest.raises(ValueError, match="cannot bind"):
            KVEventPublisher(pub.endpoint)  # taken
    finally:
        pub.close()


def test_options_group_and_serve_flags():
    """The endpoints are the KVEventsOptions group's fields, so ``hwkv serve`` has their flags."""
    import argparse
    from dataclasses import fields

    from hwkv.commands.serve import add_engine_arguments
    from hwkv.engine.config import KVEventsOptions

    assert [f.name for f in fields(KVEventsOptions)] == ["kv_events_endpoint", "kv_events_replay_endpoint"]
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    a = p.parse_args(["--kv-events-endpoint", "tcp://127.0.0.1:5557", "--kv-events-replay-endpoint",
                      "tcp://127.0.0.1:5558"])
    assert (a.kv_events_endpoint, a.kv_events_replay_endpoint) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")
    assert p.parse_args([]).kv_events_endpoint is None


EXIT_CHILD = r"""
import sys, time
import hwkv
from hwkv.engine.kv_events import KVEventSubscriber
model = sys.argv[1]
kw = dict(num_kv_blocks=40, max_model_len=256, block_size=16, kv_events_replay_endpoint="tcp://127.0.0.1:*")
e = hwkv.Engine(model, kv_events_endpoint="tcp://127.0.0.1:*", **kw)
off = hwkv.Engine(model, kv_events_endpoint="tcp://127.0.0.1:*", kv_connector="offload",
                  kv_connector_config={"cpu_bytes": 1 << 20}, **kw)
pool = hwkv.Engine(model, kv_events_endpoint="tcp://127.0.0.1:*", kv_connector="pool",
                   kv_connector_config={"store": "embedded"}, **kw)
sub = KVEventSubscriber(off.kv_events.endpoint, off.kv_events.replay_endpoint)  # never closed either
assert sub.wait_ready()
print(e.kv_events.endpoint, flush=True)
sys.stdin.readline()  # the parent's SUB is connected
for x in (e, off, pool):
    x.generate([list(range(1, 70))], hwkv.SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
print(e.kv_events._seq - 1, flush=True)
# no close(): the interpreter exit stops publishers, subscriber, connectors
"""


def test_interpreter_exit_without_close_flushes_and_exits_cleanly(model_dir):
    """Engines with events (plain, offload, pool) and a subscriber, none closed: the process exits
    with status 0 (no SIGABRT from a ZMQ context torn down under a live socket), and the batches
    of its last steps reach a subscriber in another process (the exit's bounded flush)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-c", EXIT_CHILD, model_dir], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ctx = zmq.Context()
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        endpoint = p.stdout.readline().strip()
        assert endpoint.startswith("tcp://"), p.stderr.read() if p.poll() is not None else endpoint
        s.connect(endpoint)
        time.sleep(0.5)  # the subscription reaches the PUB socket (a slow joiner misses what comes before)
        p.stdin.write("go\n")
        p.stdin.flush()
        last = int(p.stdout.readline())
        rc = p.wait(60)
        err = p.stderr.read()
        assert rc == 0, f"exit status {rc}: {err[-2000:]}"
        got = []
        while s.poll(2000):
            got.append(int.from_bytes(s.recv_multipart()[1], "big"))
        assert got and got[-1] == last, (got, last)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        s.close()
        ctx.term()
