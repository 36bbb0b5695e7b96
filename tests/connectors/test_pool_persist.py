"""A pool that outlives its engines: a real mooncake_master plus a memory holder (Mooncake's
``mooncake_client``) hold the values; engines contribute 0 bytes. Engine process 1 fills the pool
and exits, engine process 2 loads the prefix from it with identical tokens; once the holder is
gone, engines recompute (identical tokens, nothing loaded)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import hwkv
from hwkv import SamplingParams
from hwkv.model.tiny import write_tiny_model
from hwkv.stores.mooncake_service import client_binary, master_metrics, mooncake_holder, mooncake_master
from hwkv.testing.mooncake import skip_unless_mooncake

BS = 16
PROMPT = [(11 * i + 3) % 500 + 1 for i in range(150)]  # 9 full blocks before the last token

# One engine's life: generate, then exit through close() (mode "close") or without it: falling off
# the end ("exit"), sys.exit right away ("sys_exit") or after dropping the engine ("del"). Pending
# puts are flushed either way (close(), or the connector's finalizer: collected or at exit).
CHILD = r"""
import json, sys
import torch
import hwkv
from hwkv import SamplingParams
torch.set_num_threads(1)
cfg = json.loads(sys.argv[1])
model, prompt, mode = cfg.pop("model"), cfg.pop("prompt"), cfg.pop("mode")
e = hwkv.Engine(model, num_kv_blocks=64, max_model_len=256, block_size=16, kv_connector="pool",
                kv_connector_config=cfg)
toks = e.generate([prompt], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].token_ids
st = e.stats()["kv_connector"]
print(json.dumps({"tokens": toks, "stats": {k: v for k, v in st.items() if isinstance(v, (int, float, str, bool))}}),
      flush=True)
if mode == "close":
    e.close()
elif mode == "del":
    del e
elif mode == "sys_exit":
    sys.exit(0)
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("pool_persist") / "m", seed=0))


@pytest.fixture(scope="module")
def expected(model_dir):
    e = hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS)
    return e.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].token_ids


def engine_process(m, model_dir: str, mode: str = "close", prompt: list[int] = PROMPT, **kw) -> dict:
    """Run one engine process to its exit (bounded); its JSON result. It must exit 0."""
    cfg = dict(model=model_dir, prompt=prompt, mode=mode, store="mooncake", master=m.master,
               metadata_server=m.metadata_server, global_segment_size=0, timeout_s=3.0, **kw)
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(cfg)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, f"engine process exited with {r.returncode}:\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_pool_survives_engine_restarts(model_dir, expected):
    skip_unless_mooncake()
    if client_binary() is None:
        pytest.skip("the mooncake wheel has no mooncake_client (the pool memory holder)")
    with mooncake_master() as m:
        with mooncake_holder(m, 32 << 20):
            first = engine_process(m, model_dir)
            assert first["tokens"] == expected and first["stats"]["external_hit_tokens"] == 0
            assert master_metrics(m)["master_key_count"] == 9  # flushed by close(), held by the holder
            for _ in range(1):  # a restart finds the prefix: the engine that put it is gone
                again = engine_process(m, model_dir)
                assert again["tokens"] == expected
                assert again["stats"]["external_hit_tokens"] == 9 * BS and again["stats"]["load_failures"] == 0
                assert again["stats"]["stored_bytes"] == 0
        # the holder is gone, and with it every value: engines recompute, tokens unchanged
        after = engine_process(m, model_dir, lookup_timeout_s=1.0)
        assert after["tokens"] == expected
        assert after["stats"]["external_hit_tokens"] == 0 or after["stats"]["load_failures"] > 0


def test_holder_mode_engines_share_through_shared_memory(model_dir, expected):
    """Engines attached to the local holder (``holder=``: Mooncake's dummy client, values copied
    through shared memory, no tcp) fill and load the pool; a tcp client reads the same values."""
    skip_unless_mooncake()
    if client_binary() is None:
        pytest.skip("the mooncake wheel has no mooncake_client (the pool memory holder)")
    with mooncake_master() as m, mooncake_holder(m, 32 << 20) as h:
        local = dict(holder=f"127.0.0.1:{h.port}", staging_bytes=1 << 20)
        first = engine_process(m, model_dir, **local)
        assert first["tokens"] == expected and first["stats"]["external_hit_tokens"] == 0
        assert master_metrics(m)["master_key_count"] == 9
        again = engine_process(m, model_dir, mode="exit", **local)  # a restart, flushed at exit
        assert again["tokens"] == expected
        assert again["stats"]["external_hit_tokens"] == 9 * BS and again["stats"]["load_failures"] == 0
        assert again["stats"]["loaded_bytes"] > 0 and again["stats"]["stored_bytes"] == 0
        remote = engine_process(m, model_dir)  # over tcp: the same keys, the same bytes
        assert remote["tokens"] == expected and remote["stats"]["external_hit_tokens"] == 9 * BS
        # packed loads (one segment per value, scattered into the blocks) read the per-tensor puts' bytes
        packed = engine_process(m, model_dir, pack=True, **local)
        assert packed["tokens"] == expected and packed["stats"]["packed_loads"] is True
        assert packed["stats"]["external_hit_tokens"] == 9 * BS and packed["stats"]["load_failures"] == 0


def test_pool_processes_exit_cleanly_without_close(model_dir, expected):
    """No exit path aborts: before the connector's finalizer, 10 of 12 tcp-client processes exiting
    without close() died with SIGABRT (the Mooncake client torn down by the wheel's destructors),
    2 of 12 in holder mode. Every process here exits 0 with a prompt of its own, so its puts are
    still in flight when it exits, and they all reach the pool (9 chunks each)."""
    skip_unless_mooncake()
    if client_binary() is None:
        pytest.skip("the mooncake wheel has no mooncake_client (the pool memory holder)")
    with mooncake_master() as m, mooncake_holder(m, 32 << 20) as h:
        local = dict(holder=f"127.0.0.1:{h.port}", staging_bytes=1 << 20)
        n = 0
        for mode in ("exit", "del", "sys_exit"):
            for kw in ({}, local):
                n += 1
                prompt = [(11 * i + 7 * n) % 500 + 1 for i in range(150)]
                r = engine_process(m, model_dir, mode=mode, prompt=prompt, **kw)  # asserts exit status 0
                assert r["stats"]["external_hit_tokens"] == 0 and len(r["tokens"]) == 6
                assert master_metrics(m)["master_key_count"] == 9 * n


def test_holder_mode_needs_its_holder(model_dir):
    skip_unless_mooncake()
    with mooncake_master() as m:
        with pytest.raises(hwkv.interfaces.store.StoreError, match="holder .*127.0.0.1:1 does not answer"):
            hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, kv_connector="pool",
                        kv_connector_config=dict(store="mooncake", master=m.master, holder="127.0.0.1:1",
                                                 connect_timeout_s=0.5))
        with pytest.raises(ValueError, match="holder='nohost' is invalid"):
            hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, kv_connector="pool",
                        kv_connector_config=dict(store="mooncake", master=m.master, holder="nohost"))


def test_replicas_outlive_a_holder():
    """``replicas=2`` over two holders: one holder killed, the value is read from the other copy once
    the master dropped the dead holder (client_ttl; 2 s here)."""
    skip_unless_mooncake()
    if client_binary() is None:
        pytest.skip("the mooncake wheel has no mooncake_client (the pool memory holder)")
    import ctypes
    import signal
    import time

    from hwkv.stores.mooncake import MooncakeStore

    n = 1 << 20
    buf = ctypes.create_string_buffer(n)
    ptr = ctypes.addressof(buf)
    with mooncake_master(client_ttl_s=2) as m, mooncake_holder(m, 16 << 20) as h1, mooncake_holder(m, 16 << 20):
        s = MooncakeStore(master=m.master, metadata_server=m.metadata_server, global_segment_size=0, replicas=2)
        try:
            s.register_buffer(ptr, n)
            ctypes.memset(ptr, 7, n)
            assert s.put(["v"], [[(ptr, n)]])[0].ok
            assert master_metrics(m)["master_allocated_bytes"] == 2 * n  # one copy per holder
            os.kill(h1.pid, signal.SIGKILL)
            ctypes.memset(ptr, 0, n)
            deadline = time.monotonic() + 15
            while not s.get(["v"], [[(ptr, n)]])[0].ok:
                assert time.monotonic() < deadline, "the surviving copy was never served"
                time.sleep(0.5)
            assert buf.raw[:4] == b"\x07" * 4
            s.unregister_buffer(ptr)
        finally:
            s.close()


def test_put_prefers_a_holder_and_locate_names_it():
    """``MooncakeStore.put(prefer=)`` places each value on the named holder's segment (through a
    holder-mode client of another holder too); ``locate`` (a plain client) names where each lives,
    ``[]`` for a missing key; a holder-mode client cannot locate; a malformed ``prefer`` is refused."""
    skip_unless_mooncake()
    if client_binary() is None:
        pytest.skip("the mooncake wheel has no mooncake_client (the pool memory holder)")
    from hwkv.stores.mooncake import MooncakeStore

    with mooncake_master() as m, mooncake_holder(m, 16 << 20) as h1, mooncake_holder(m, 16 << 20) as h2:
        s = MooncakeStore(master=m.master, metadata_server=m.metadata_server, global_segment_size=0,
                          holder=f"127.0.0.1:{h1.port}", shm_bytes=16 << 20)
        plain = MooncakeStore(master=m.master, metadata_server=m.metadata_server, global_segment_size=0)
        try:
            ptr = s.host_buffer(1 << 20)
            s.register_buffer(ptr, 1 << 20)
            keys = [f"k{i}" for i in range(6)]
            segs = [h2.segment, h1.segment, None, h2.segment, h2.segment, h1.segment]
            bufs = [[(ptr + i * 8192, 4096), (ptr + i * 8192 + 4096, 4096)] for i in range(6)]
            assert all(r.ok for r in s.put(keys, bufs, segs))
            where = plain.locate([*keys, "missing"])
            assert [w for w, p in zip(where, segs) if p is not None] == [[p] for p in segs if p is not None]
            assert where[2] in ([h1.segment], [h2.segment]) and where[-1] == []
            assert all(r.ok for r in s.get(keys, bufs))
            with pytest.raises(ValueError, match="a holder-mode client cannot ask where values live"):
                s.locate(keys)
            with pytest.raises(ValueError, match=r"prefer must be a list with one segment \(or None\) per key"):
                s.put(keys, bufs, [h1.segment])
        finally:
            s.close()
            plain.close()


def test_replicas_validated():
    from hwkv.stores.mooncake import MooncakeStore

    with pytest.raises(ValueError, match=r"replicas=0 is invalid \(need an int in 1\.\.8"):
        MooncakeStore(master="127.0.0.1:1", replicas=0)


def test_parallel_loads_from_a_real_holder(model_dir, expected):
    """``load_parallel``: a load's get runs as concurrent calls on contiguous shares of its chunks
    (holder mode, a real master + holder with 4 service threads). Tokens as a plain engine's; a
    share whose call fails fails the load only after every other share returned (they write into
    the staging the next load reuses): the request recomputes, no block or pin is held."""
    skip_unless_mooncake()
    if client_binary() is None:
        pytest.skip("the mooncake wheel has no mooncake_client (the pool memory holder)")
    import threading
    import time

    from hwkv.interfaces.store import StoreError

    from .test_pool import _settle

    def engine(h, **kw):
        cfg = dict(store="mooncake", master=m.master, metadata_server=m.metadata_server, global_segment_size=0,
                   timeout_s=5.0, holder=f"127.0.0.1:{h.port}", staging_bytes=1 << 20, **kw)
        return hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, kv_connector="pool",
                           kv_connector_config=cfg)

    def run(e):
        return e.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].token_ids

    with mooncake_master() as m, mooncake_holder(m, 32 << 20, threads=4) as h:
        engines = [engine(h, load_parallel=4) for _ in range(3)]
        try:
            a, b, c = engines
            assert run(a) == expected
            assert _settle(a)["stored_chunks"] == 9
            tr = b.scheduler.connector.worker.transfer
            assert tr.load_parallel == 4 and not tr.direct
            calls: list[tuple[int, float, float]] = []  # (chunks, start, end) of each get call
            orig = tr.handle.call

            def traced(op, *args):
                t0 = time.monotonic()
                out = orig(op, *args)
                if op == "get":
                    calls.append((len(args[0]), t0, time.monotonic()))
                return out

            tr.handle.call = traced
            assert run(b) == expected
            st = _settle(b)
            assert st["external_hit_tokens"] == 9 * BS and st["load_failures"] == 0
            assert sorted(n for n, _, _ in calls) == [2, 2, 2, 3]  # 9 chunks, four shares of one piece
            # one share fails after the others started: the load fails once all have returned
            tc, ended = c.scheduler.connector.worker.transfer, []
            orig_c = tc.handle.call

            def failing(op, *args):
                if op == "get" and len(args[0]) == 3:
                    time.sleep(0.05)
                    raise StoreError("injected: one share's get failed")
                out = orig_c(op, *args)
                if op == "get":
                    ended.append(threading.current_thread().name)
                return out

            tc.handle.call = failing
            assert run(c) == expected  # recomputed
            st = _settle(c)  # asserts every block and pin is back
            assert st["load_failures"] == 1 and "injected: one share's get failed" in st["last_load_error"]
            assert len(ended) == 3  # the other shares' calls had returned before the load ended
        finally:
            for e in engines:
                e.scheduler.connector.shutdown()


def test_loads_spread_over_several_holder_clients(model_dir, expected):
    """``load_clients``: a load's chunks in contiguous shares over several holder-mode clients at
    once (each its own shared memory, staging and connection to the holder). Tokens as a plain
    engine's; a lane whose get fails fails the load once every lane ended; nothing stays held."""
    skip_unless_mooncake()
    if client_binary() is None:
        pytest.skip("the mooncake wheel has no mooncake_client (the pool memory holder)")
    from hwkv.interfaces.store import StoreError

    from .test_pool import _settle

    def engine(h, **kw):
        cfg = dict(store="mooncake", master=m.master, metadata_server=m.metadata_server, global_segment_size=0,
                   timeout_s=5.0, holder=f"127.0.0.1:{h.port}", staging_bytes=1 << 20, **kw)
        return hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, kv_connector="pool",
                           kv_connector_config=cfg)

    def run(e):
        return e.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].token_ids

    with mooncake_master() as m, mooncake_holder(m, 32 << 20, threads=4) as h:
        a = engine(h, load_parallel=1)
        b = engine(h, load_parallel=1, load_clients=3)
        c = engine(h, load_parallel=2, load_clients=3)
        try:
            assert run(a) == expected
            assert _settle(a)["stored_chunks"] == 9
            tb = b.scheduler.connector.worker.transfer
            assert len(tb._lanes) == 2 and tb.lanes_active == 3
            seen: list[tuple[int, int]] = []  # (client handle id, chunks) of each get call
            handles = [tb.handle] + [hh for hh, _ in tb._lanes]
            for hh in handles:
                orig = hh.call

                def traced(op, *args, _orig=orig, _hh=hh):
                    if op == "get":
                        seen.append((handles.index(_hh), len(args[0])))
                    return _orig(op, *args)

                hh.call = traced
            assert run(b) == expected
            st = _settle(b)
            assert st["external_hit_tokens"] == 9 * BS and st["load_failures"] == 0
            assert sorted(seen) == [(0, 3), (1, 3), (2, 3)]  # three clients, a share each
            # the second lane's client fails: the load fails after all lanes ended, the request recomputes
            tc = c.scheduler.connector.worker.transfer
            bad = tc._lanes[0][0]

            def failing(op, *args):
                if op == "get":
                    raise StoreError("injected: lane 1's get failed")
                return bad.__class__.call(bad, op, *args)

            bad.call = failing
            assert run(c) == expected
            st = _settle(c)  # asserts every block and pin is back
            assert st["load_failures"] == 1 and "injected: lane 1's get failed" in st["last_load_error"]
        finally:
            for e in (a, b, c):
                e.scheduler.connector.shutdown()


def test_loads_read_each_value_through_the_holder_that_has_it(model_dir, expected):
    """``holders`` (several holders on this host, as ``hwkv pool master --holders N`` prints them):
    values are spread over the holders' segments; a load asks the master where each lives and reads
    it through a client of that holder (all holders at once); puts place consecutive chunks on the
    holders in turn. Tokens as a plain engine's. A holder
    that dies fails the loads of its values: the request recomputes (same tokens), nothing is held."""
    skip_unless_mooncake()
    if client_binary() is None:
        pytest.skip("the mooncake wheel has no mooncake_client (the pool memory holder)")
    import signal

    from hwkv.stores.mooncake import MooncakeStore

    from .test_pool import _settle

    def engine(hs, **kw):
        cfg = dict(store="mooncake", master=m.master, metadata_server=m.metadata_server, global_segment_size=0,
                   timeout_s=3.0, holders={f"127.0.0.1:{h.port}": h.segment for h in hs}, staging_bytes=1 << 20,
                   load_parallel=1, **kw)
        return hwkv.Engine(model_dir, num_kv_blocks=64, max_model_len=256, block_size=BS, kv_connector="pool",
                           kv_connector_config=cfg)

    def run(e):
        return e.generate([PROMPT], SamplingParams(max_tokens=6, temperature=0), use_tqdm=False)[0].token_ids

    with mooncake_master() as m, mooncake_holder(m, 32 << 20, threads=2) as h1, \
            mooncake_holder(m, 32 << 20, threads=2) as h2:
        a, b, c = engine([h1, h2]), engine([h1, h2]), engine([h1, h2])
        plain = MooncakeStore(master=m.master, metadata_server=m.metadata_server, global_segment_size=0)
        try:
            assert run(a) == expected
            assert _settle(a)["stored_chunks"] == 9
            tb = b.scheduler.connector.worker.transfer
            assert tb.routed and tb.segments == [h1.segment, h2.segment] and len(tb._lanes) == 1
            assert b.scheduler.connector.worker.locator.up  # connected at start, not on the first load
            seen: list[tuple[str, list[str]]] = []  # (the calling client's holder segment, keys) of each get
            for hh, seg in zip([tb.handle] + [x for x, _ in tb._lanes], tb.segments):
                orig = hh.call

                def traced(op, *args, _orig=orig, _seg=seg):
                    if op == "get":
                        seen.append((_seg, list(args[0])))
                    return _orig(op, *args)

                hh.call = traced
            assert run(b) == expected
            st = _settle(b)
            assert st["external_hit_tokens"] == 9 * BS and st["load_failures"] == 0 and st["load_routed_jobs"] == 1
            keys = [k for _, ks in seen for k in ks]
            assert len(keys) == 9 and len(set(keys)) == 9
            where = dict(zip(keys, plain.locate(keys)))
            assert all(where[k] == [seg] for seg, ks in seen for k in ks)  # each through its own holder
            on_h2 = sum(where[k] == [h2.segment] for k in keys)
            assert sum(where[k] == [h1.segment] for k in keys) + on_h2 == 9
            assert on_h2 in (4, 5)  # the engine put consecutive chunks on the holders in turn: spread evenly
            # the second holder dies: loads of its values fail, the request recomputes, nothing is held
            os.kill(h2.pid, signal.SIGKILL)
            assert run(c) == expected
            st = _settle(c)  # asserts every block and pin is back
            assert st["load_failures"] == 1 and st["load_routed_jobs"] == 1
        finally:
            for e in (a, b, c):
                e.scheduler.connector.shutdown()
            plain.close()
