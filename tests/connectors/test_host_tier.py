"""The offload connector's host tier against a model: capacity holds, eviction is LRU over the same
block hashes as the device prefix cache, pins never outlive an operation, bytes survive the trip."""

from __future__ import annotations

from collections import OrderedDict

import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from hwkv.connectors.offload import OffloadConnector
from hwkv.connectors.offload.tier import HostTier
from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_cache_manager import KVCacheManager
from hwkv.core.request import Request
from hwkv.core.sched_output import CachedRequestData, SchedulerOutput
from hwkv.interfaces.layout import KVCache, KVCacheSpec, KVLayoutKind
from hwkv.reference.device import CpuDevice

BS, DEVICE_BLOCKS = 4, 64
SPEC = KVCacheSpec(num_layers=2, num_blocks=DEVICE_BLOCKS, block_size=BS, num_kv_heads=1, head_size=2,
                   dtype=torch.float32)
hasher = make_block_hasher(BS)


class Tier:
    def __init__(self, capacity: int):
        self.kv = KVCacheManager(DEVICE_BLOCKS, BS)
        self.conn = OffloadConnector(cpu_bytes=capacity * SPEC.bytes_per_block + SPEC.bytes_per_block // 2,
                                     min_run_blocks=2, store_batch_blocks=1)
        self.conn.bind_kv_cache_manager(self.kv)
        self.conn.bind_device(CpuDevice())
        self.device = KVCache.allocate(SPEC, KVLayoutKind.PER_LAYER)
        self.conn.register_kv_caches(self.device)
        self.n = 0

    def request(self, family: int, nblocks: int) -> Request:
        self.n += 1
        toks = [family * 1000 + i for i in range(nblocks * BS)] + [7]
        return Request(f"r{self.n}", toks, block_hasher=hasher)

    def step(self, req: Request, scheduled: bool) -> None:
        so = SchedulerOutput([], CachedRequestData(), {req.request_id: 1} if scheduled else {}, 1, set(), set())
        c = self.conn
        c.bind_connector_metadata(c.build_connector_meta(so))
        c.start_load_kv()
        for t in self.device.tensors:  # the forward: reuses (and overwrites) every free device block
            for b in self.kv.block_pool.free_block_queue:
                t[b.block_id] = -1.0
        c.wait_for_save()
        out = c.get_finished(set())
        if out is not None:
            c.update_connector_output(out)

    def store(self, family: int, nblocks: int, preempt: bool = False) -> None:
        """A request computes ``nblocks`` full blocks, then finishes (stored by the steps of a batch of
        one) or is preempted before any step stored them (stored by the preemption)."""
        req = self.request(family, nblocks)
        self.kv.allocate_slots(req, req.num_tokens)
        for b, h in zip(self.kv.get_blocks(req.request_id), req.block_hashes):
            for t in self.device.tensors:
                t[b.block_id] = _fill(h)  # the forward's KV
        req.num_computed_tokens = req.num_tokens
        self.conn.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), 0)
        if preempt:
            self.conn.request_preempted(req)
            self.kv.free(req)  # its device blocks are reused by the next step's forward
            self.step(req, False)
            return
        self.step(req, True)
        self.finish(req)

    def lookup(self, family: int, nblocks: int, admit: bool) -> list[bytes]:
        req = self.request(family, nblocks)
        n_ext, is_async = self.conn.get_num_new_matched_tokens(req, 0)
        assert n_ext % BS == 0 and n_ext <= req.num_tokens - 1 and not is_async
        hits = req.block_hashes[: n_ext // BS]
        if admit:
            self.kv.allocate_slots(req, req.num_tokens)
            for t in self.device.tensors:
                t.zero_()
            self.conn.update_state_after_alloc(req, self.kv.get_block_ids(req.request_id), n_ext)
            self.step(req, False)
            for b, h in zip(self.kv.get_blocks(req.request_id), hits):  # the bytes came back
                assert all(torch.equal(t[b.block_id], _fill(h)) for t in self.device.tensors)
        self.finish(req)
        return hits

    def finish(self, req: Request) -> None:
        self.conn.request_finished(req, self.kv.get_block_ids(req.request_id))
        self.kv.free(req)


def _fill(h: bytes) -> torch.Tensor:
    return torch.full(SPEC.tensor_shapes(KVLayoutKind.PER_LAYER)[0][1:], float(int.from_bytes(h[:2], "little")))


ops = st.lists(st.tuples(st.sampled_from(["store", "preempt", "hit", "peek"]), st.integers(0, 3), st.integers(1, 6)),
               max_size=25)


@settings(max_examples=60, deadline=None)
@given(capacity=st.integers(1, 8), ops=ops)
def test_tier_is_an_lru_of_block_hashes_with_bounded_capacity(capacity, ops):
    tier = Tier(capacity)
    model: OrderedDict[bytes, None] = OrderedDict()  # LRU first
    for op, family, nblocks in ops:
        if op in ("store", "preempt"):
            hashes = tier.request(family, nblocks).block_hashes
            new = [h for h in hashes if h not in model]
            for h in hashes:
                if h in model:
                    model.move_to_end(h)  # already there: refreshed
            stored = []
            for h in new:  # each new block takes a free host block, else evicts the LRU one
                if len(model) + len(stored) >= capacity:
                    if not model:
                        break  # every host block holds a block of this very store
                    model.popitem(last=False)
                stored.append(h)
            for h in stored:
                model[h] = None
            tier.store(family, nblocks, preempt=op == "preempt")
        else:
            req_hashes = tier.request(family, nblocks).block_hashes
            want = []
            for h in req_hashes[:nblocks]:
                if h not in model:
                    break
                want.append(h)
            assert tier.lookup(family, nblocks, admit=op == "hit") == want
            for h in want:
                model.move_to_end(h)
        cpu = tier.conn.scheduler.cpu
        assert len(cpu.cached_block_hash_to_block) <= capacity == cpu.num_blocks
        assert [b.block_hash for b in cpu.free_block_queue if b.block_hash is not None] == list(model)
        assert cpu.num_free_blocks == capacity and tier.kv.num_free_blocks == DEVICE_BLOCKS  # no pins left
        assert not tier.conn.has_pending_transfers()


@settings(max_examples=80, deadline=None)
@example(capacity=3, ops=[("store", 0, 1), ("store", 0, 1), ("land", 0, 1), ("land", 0, 1), ("store", 1, 3)])
@given(capacity=st.integers(1, 6), ops=st.lists(st.tuples(st.sampled_from(["store", "land", "fail", "hit", "done"]),
                                                         st.integers(0, 9), st.integers(1, 4)), max_size=40))
def test_host_tier_pins_and_lru_invariants(capacity, ops):
    """HostTier alone, against a model: stores reserve (pin) blocks and publish on landing, hits pin
    a consecutive match, every pin is released once; pinned blocks are never evicted nor capacity,
    unpinned registered blocks are in LRU order, and nothing is registered before it landed."""
    tier = HostTier(capacity)
    lru: OrderedDict[bytes, None] = OrderedDict()  # registered, unpinned or pinned alike; LRU first
    stores: list[tuple[list, list[bytes]]] = []  # in flight: (blocks, hashes)
    reads: list[list] = []  # pinned hits
    key = [bytes([k]) * 32 for k in range(10)]

    def pinned() -> set[int]:
        return {id(b) for bs, _ in stores for b in bs} | {id(b) for r in reads for b in r}

    for op, k, n in ops:
        if op == "store":
            hs = key[k:k + n]  # both forms: one call for all, or one per hash
            hits = tier.refresh_all(hs) if k % 2 else [tier.refresh(h) for h in hs]
            want = [h for h, hit in zip(hs, hits) if not hit]
            for h in key[k:k + n]:
                if h in lru:
                    lru.move_to_end(h)
            pins = pinned()
            idle = [h for h in lru if id(tier.cached_block_hash_to_block[h]) not in pins]  # evictable, LRU first
            free = capacity - len(pins)
            blocks = tier.reserve(len(want))
            assert len(blocks) == min(len(want), free)
            for h in idle[:max(0, len(blocks) - (free - len(idle)))]:  # empty blocks go first, then the LRU
                del lru[h]
            stores.append((blocks, want[:len(blocks)]))
        elif op in ("land", "fail") and stores:
            blocks, hashes = stores.pop(k % len(stores))
            if op == "land":
                new = [h for h in hashes if h not in lru]  # another store may have landed it meanwhile
                tier.publish(blocks, hashes)
                lru.update(dict.fromkeys(new))
            tier.free_blocks(blocks)
        elif op == "hit":
            hits = tier.match(key[k:k + n])
            want = []
            for h in key[k:k + n]:
                if h not in lru:
                    break
                want.append(h)
            assert [b.block_hash for b in hits] == want
            tier.touch(hits)
            reads.append(hits)
        elif op == "done" and reads:
            hits = reads.pop(k % len(reads))
            tier.free_blocks(hits)
            for b in hits:
                lru.move_to_end(b.block_hash)
        # invariants
        pins = pinned()
        queue = list(tier.free_block_queue)
        assert {id(b) for b in queue}.isdisjoint(pins) and len(queue) + len(pins) == capacity
        assert all(b.ref_cnt > 0 for b in tier.blocks if id(b) in pins)
        assert all(b.block_hash is None for bs, _ in stores for b in bs)  # nothing in flight is visible
        assert {h: b.block_hash for h, b in tier.cached_block_hash_to_block.items()} == {h: h for h in lru}
        assert all(tier.cached_block_hash_to_block[b.block_hash] is b for b in tier.blocks if b.block_hash)
        unpinned = [b.block_hash for b in queue if b.block_hash is not None]
        assert unpinned == [h for h in lru if id(tier.cached_block_hash_to_block[h]) not in pins]
    for bs, _ in stores:
        tier.free_blocks(bs)
    for r in reads:
        tier.free_blocks(r)
    assert tier.num_free_blocks == capacity and all(b.ref_cnt == 0 for b in tier.blocks)


def test_copy_threshold_follows_where_the_copy_runs():
    """Host to host a memcpy per run wins from 4 blocks; across a host link only from 2 MiB per
    tensor (the gather beats small memcpys there), whatever the block size."""
    from types import SimpleNamespace

    from hwkv.connectors.base.copy import auto_min_run_blocks

    def cache(device: str, block_bytes: int) -> SimpleNamespace:
        t = torch.empty((8, block_bytes // 2), dtype=torch.bfloat16, device=device)
        return SimpleNamespace(tensors=[t], block_nbytes=lambda i: block_bytes)

    host, dev = cache("cpu", 32 << 10), cache("meta", 32 << 10)
    assert auto_min_run_blocks(host, host) == 4
    assert auto_min_run_blocks(dev, host) == auto_min_run_blocks(host, dev) == 64  # 2 MiB of 32 KiB blocks
    assert auto_min_run_blocks(cache("meta", 1 << 20), host) == 4  # huge blocks: never fewer than 4


def test_refresh_all_equals_refresh_one_by_one():
    """Same hits, same LRU order (eviction order of the next reservations), pins untouched."""
    keys = [bytes([k]) * 32 for k in range(8)]

    def tier_with_all() -> HostTier:
        t = HostTier(8)
        t.publish(t.reserve(8), keys)
        t.free_blocks(list(t.cached_block_hash_to_block.values()))
        t.touch([t.cached_block_hash_to_block[keys[5]]])  # pinned (a load reads it)
        return t

    a, b = tier_with_all(), tier_with_all()
    ask = [keys[3], keys[5], bytes([99]) * 32, keys[0]]
    assert a.refresh_all(ask) == [b.refresh(h) for h in ask] == [True, True, False, True]
    order = lambda t: [blk.block_hash for blk in t.free_block_queue]  # noqa: E731 (LRU first)
    assert order(a) == order(b) == [keys[1], keys[2], keys[4], keys[6], keys[7], keys[3], keys[0]]
    assert a.cached_block_hash_to_block[keys[5]].ref_cnt == b.cached_block_hash_to_block[keys[5]].ref_cnt == 1
