"""The pool's sending and receiving threads (the worker side's I/O; the forward never waits on them).

Sending: a batch of chunks is put after the device event recorded behind the forward that wrote
them, deduplicated first (one batched ``exists``; chunks already in the pool are skipped, so a
second put of the same prefix moves no bytes). Receiving: batched ``get`` into the request's blocks,
after an event recorded on the compute stream before the load was issued (a reused block's last
writer). Both report ``(job_id, ok, ...)`` completions that the connector hands to the scheduler.

Zero-copy: when the KV cache is host memory (the CPU backend), the store reads and writes the KV
tensors themselves — they are registered with the store once (``register_buffer``) and every
put/get passes ``KVCache.addresses`` of the chunk's blocks. On an accelerator the chunks go through
a registered host staging cache (``staging_bytes`` per thread): device → staging on a private
stream then put; get into staging then staging → device. A chunk's bytes are the same either way.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from hwkv.connectors.base.copy import copy_block_pairs
from hwkv.connectors.pool.store import StoreHandle
from hwkv.interfaces.layout import KVCache
from hwkv.interfaces.store import StoreError


@dataclass
class PutJob:
    job_id: int
    keys: list[str]
    chunks: list[list[int]]  # device block ids per chunk
    event: Any  # recorded behind the forward that wrote them


@dataclass
class GetJob:
    job_id: int
    req_id: str
    keys: list[str]
    chunks: list[list[int]]
    event: Any  # recorded before the load was issued
    t0: float = 0.0


@dataclass
class Done:
    job_id: int
    load: bool
    ok: bool
    req_id: str = ""
    nbytes: int = 0  # bytes moved
    skipped: int = 0  # chunks found in the pool already (puts)
    error: str = ""
    landed: int = 0  # a failed get: its leading chunks that did land in their blocks (copies ended)


def host_addressable(kv: Any) -> bool:
    """The store may read and write the KV tensors themselves (host memory)."""
    return kv.tensors[0].device.type == "cpu"


class _Staging:
    """A host KV cache of ``n`` blocks in the device cache's layout, plus a stream to fill it; in
    the store's own memory when it has some (``alloc``: a holder-mode client's shared memory,
    page-locked here so device copies run at DMA speed), else pinned memory of the device."""

    def __init__(self, dev: Any, kv: Any, nbytes: int, alloc: Callable[[int], int] | None = None):
        n = max(1, nbytes // kv.spec.bytes_per_block)
        spec = replace(kv.spec, num_blocks=n)
        if alloc is None:
            self.kv = dev.allocate_kv_cache(spec, kv.layout, host=True)
        else:
            self.kv = _kv_at(alloc, spec, kv.layout, dev)
        self.kv.scales = kv.scales  # fp8 KV: the mirror's codes mean what the device's do
        self.stream, self.num_blocks = dev.new_stream(), n

    def buffers(self) -> list[tuple[int, int]]:
        base = getattr(self.kv, "_base", None)
        if base is not None:  # the store's memory: registered whole, as it was handed out
            return [(base.data_ptr(), base.numel())]
        return [(t.data_ptr(), t.numel() * t.element_size()) for t in self.kv.tensors]


def _kv_at(alloc: Callable[[int], int], spec: Any, layout: Any, dev: Any) -> Any:
    """A host KVCache over ``alloc``-ed memory (one range for all its tensors), pinned in place
    where the device can pin (else its copies stage through pageable memory: slower, correct)."""
    import ctypes
    import math

    import torch

    shapes = spec.tensor_shapes(layout)
    item = torch.empty((), dtype=spec.dtype).element_size()
    sizes = [-(-math.prod(s) * item // 256) * 256 for s in shapes]  # 256-byte aligned tensors
    total = sum(sizes)
    ptr = alloc(total)
    base = torch.frombuffer((ctypes.c_uint8 * total).from_address(ptr), dtype=torch.uint8)
    base.zero_()  # fault the pages in now, not during the first measured transfer
    if dev.async_copies and dev.pins_host_in_place:
        dev.pin_host_memory(base)
    tensors, off = [], 0
    for s, n in zip(shapes, sizes):
        tensors.append(base[off:off + math.prod(s) * item].view(spec.dtype).view(s))
        off += n
    kv = KVCache(spec, layout, tensors)
    kv._base = base  # keeps the mapping (and its pinning) alive with the cache
    return kv


def _first_error(res: list[Any]) -> str:
    bad = next((r for r in res if not r.ok), None)
    return "" if bad is None else f"{type(bad.error).__name__}: {bad.error}"[:300]


def _leading_ok(res: list[Any]) -> int:
    return next((i for i, r in enumerate(res) if not r.ok), len(res))


class _Packed:
    """Packed loads (``pack=True``, one block per chunk): each value is got as ONE segment — the
    block's bytes of every KV tensor in tensor order, the same bytes as the per-tensor segments of
    :class:`_Staging` — into a flat host buffer, copied to the device in one piece per half, and
    scattered into the blocks there (one ``index_copy_`` per KV tensor). The store then moves one
    segment per value instead of one per KV tensor (2 x layers of 16-32 KiB each)."""

    def __init__(self, dev: Any, kv: Any, nbytes: int, alloc: Callable[[int], int] | None):
        import ctypes

        import torch

        self.bpb = kv.spec.bytes_per_block
        self.num_blocks = max(2, nbytes // self.bpb)
        total = self.num_blocks * self.bpb
        if alloc is None:
            self.flat = dev.pinned_empty(total)
        else:
            self.flat = torch.frombuffer((ctypes.c_uint8 * total).from_address(alloc(total)), dtype=torch.uint8)
            self.flat.zero_()  # fault the pages in now
            if dev.async_copies and dev.pins_host_in_place:
                dev.pin_host_memory(self.flat)
        half = self.num_blocks // 2
        where = kv.tensors[0].device
        self.scratch = [torch.empty(half * self.bpb, dtype=torch.uint8, device=where) for _ in range(2)]
        self.widths = [kv.block_nbytes(i) for i in range(len(kv.tensors))]
        self.rows = [t.view(-1).view(torch.uint8).view(t.shape[0], -1) for t in kv.tensors]  # blocks as byte rows
        self.stream = dev.new_stream()

    @staticmethod
    def usable(kv: Any, chunk_blocks: int) -> bool:
        return chunk_blocks == 1 and all(t.is_contiguous() for t in kv.tensors) and \
            sum(kv.block_nbytes(i) for i in range(len(kv.tensors))) == kv.spec.bytes_per_block

    def buffers(self) -> list[tuple[int, int]]:
        return [(self.flat.data_ptr(), self.flat.numel())]

    def value(self, block: int) -> list[tuple[int, int]]:
        return [(self.flat.data_ptr() + block * self.bpb, self.bpb)]

    def scatter(self, dev: Any, h: int, first: int, dev_ids: list[int]) -> None:
        """Queue on this stream: staging blocks ``first...`` -> the device in one copy, then into ``dev_ids``."""
        import torch

        m = len(dev_ids)
        with dev.stream_context(self.stream):
            buf = self.scratch[h][:m * self.bpb]
            buf.copy_(self.flat[first * self.bpb:(first + m) * self.bpb], non_blocking=True)
            ids = torch.tensor(dev_ids, dtype=torch.long).to(buf.device, non_blocking=True)
            rows, off = buf.view(m, self.bpb), 0
            for dst, w in zip(self.rows, self.widths):
                dst.index_copy_(0, ids, rows[:, off:off + w])
                off += w


class PoolTransfer:
    """Owns the two threads; ``submit_put`` / ``submit_get`` enqueue, ``drain`` collects completions."""

    def __init__(self, handle: StoreHandle, dev: Any, kv: Any, chunk_blocks: int, staging_bytes: int,
                 alloc: Callable[[int], int] | None = None, pack: bool = False, load_parallel: int = 1,
                 lanes: list[tuple[StoreHandle, Callable[[int], int] | None]] | None = None,
                 segments: list[str] | None = None, locate: Callable[[list[str]], list[list[str]]] | None = None):
        self.handle, self.dev, self.kv, self.chunk_blocks = handle, dev, kv, chunk_blocks
        # several holders (``segments``: the holder each load client is attached to, this client's first):
        # a load asks where its values live (``locate``) and reads each through a client of the holder
        # that has it - a holder copies only its own memory at memcpy speed (another's goes over its
        # transport), and one holder serves ~5.5 GB/s however many clients call (H200 host)
        self.segments, self.locate = segments, locate
        self.routed = bool(segments and locate)  # may be turned off (a bench's A/B)
        # a load spread over several clients: the clients' threads only read (store calls, GIL released)
        # and hand each piece to the receiving thread, which queues every piece's copies to the device. H200,
        # 8B fp8, 8 holders, same run: 46.0-47.8 ms vs 87.8-96.6 with each client's thread landing its own
        # pieces (they took turns on the GIL). A client's share is read in the staging's pieces (piece_plan):
        # pieces of one chunk, so that landing overlaps reading, took 59.8-67.9 ms - ~1.3 ms of host work
        # per piece on the landing thread outweighed the overlap (docs/connectors.md)
        # staging -> device copies: runs of >= 2 MiB per KV tensor as a memcpy per tensor (copy engines), the
        # rest through Device.copy_blocks (connectors/base/copy.py); HWKV_POOL_LAND_MEMCPY=0: every block
        # through copy_blocks (hwkv-cuda: one launch a piece instead of a memcpy per tensor and run - less host
        # time on the landing thread; the A/B of `hwkv bench pool-restart`, suffix k)
        # (a memcpy per run of ANY length took 926 ms for an 8B load from 8 holders: scattered blocks)
        # puts: consecutive chunks go to the holders in turn (a preference the master honours while there
        # is room), so a prefix's chunks are spread evenly and its load reads every holder equally long
        # (the master's own random placement gave 8/6/7/11 of 32 values on four holders)
        self._holder_ring = list(dict.fromkeys(segments)) if segments and len(set(segments)) > 1 else []
        self._next_holder = 0
        # concurrent get calls per piece, each on a contiguous share of its keys (disjoint destinations):
        # one call is served by one holder thread (one memcpy stream, ~6 GB/s measured on the H200 host)
        self.load_parallel = load_parallel
        self._pool: ThreadPoolExecutor | None = None  # the extra callers (the receiving thread is one)
        self._pool_size = 0
        self._pool_lock = threading.Lock()
        self.direct = host_addressable(kv) and alloc is None  # a store with its own memory needs staging
        self.chunk_bytes = chunk_blocks * kv.spec.bytes_per_block
        staging_bytes = max(staging_bytes, 2 * self.chunk_bytes)  # gets alternate between two halves
        pack = pack and not self.direct and _Packed.usable(kv, chunk_blocks)
        ops = ("put",) if pack else ("put", "get")  # packed loads have their own staging
        self._stage = {} if self.direct else {op: _Staging(dev, kv, staging_bytes, alloc) for op in ops}
        self._packed = _Packed(dev, kv, staging_bytes, alloc) if pack else None
        # more store clients for loads (holder mode: one shared memory and one connection each, served
        # by a holder thread of their own): each with a get staging of staging_bytes / clients; a load
        # splits its chunks into contiguous shares over the first ``lanes_active`` (this client first)
        self._lanes: list[tuple[StoreHandle, _Staging]] = []
        if lanes and not self.direct and not pack:
            per_lane = max(staging_bytes // (len(lanes) + 1), 2 * self.chunk_bytes)
            self._lanes = [(h, _Staging(dev, kv, per_lane, a)) for h, a in lanes]
        self.lanes_active = len(self._lanes) + 1
        self._lane_pool = ThreadPoolExecutor(len(self._lanes) + 1, thread_name_prefix="hwkv-pool-lane") \
            if self._lanes else None
        # direct loads: where a chunk's leading blocks that the device cache had (-1 ids) are got into
        # (a chunk is got whole); the receiving thread's alone
        self._scratch = dev.allocate_kv_cache(replace(kv.spec, num_blocks=chunk_blocks), kv.layout, host=True) \
            if self.direct and chunk_blocks > 1 else None
        self._done: queue.SimpleQueue[Done] = queue.SimpleQueue()
        # where a load's time goes (seconds, summed over gets; read by stats()): waiting for the
        # compute stream's event, the store's get calls, waiting for the copies to the device, and
        # the whole get from dequeue to completion
        # (load_routed_jobs: loads read through the holders that have their values, ``holders``)
        # (load_land_s: queueing the staging -> device copies; load_locate_s: asking where values live)
        self.timing = dict.fromkeys(("load_jobs", "load_routed_jobs", "load_event_s", "load_store_s",
                                     "load_copy_wait_s", "load_land_s", "load_locate_s", "load_wall_s",
                                     "put_store_s", "put_copy_s"), 0.0)
        self._puts: queue.Queue[PutJob | None] = queue.Queue()
        self._gets: queue.Queue[GetJob | None] = queue.Queue()
        self._threads = [threading.Thread(target=self._send_loop, daemon=True, name="hwkv-pool-send"),
                         threading.Thread(target=self._recv_loop, daemon=True, name="hwkv-pool-recv")]
        for t in self._threads:
            t.start()

    @property
    def packed(self) -> bool:
        return self._packed is not None

    def buffers(self) -> list[tuple[int, int]]:
        """The memory every put/get touches: register it with the store."""
        if self.direct:
            scratch = self._scratch.tensors if self._scratch is not None else []
            return [(t.data_ptr(), t.numel() * t.element_size()) for t in [*self.kv.tensors, *scratch]]
        extra = self._packed.buffers() if self._packed is not None else []
        return [b for s in self._stage.values() for b in s.buffers()] + extra

    def lane_buffers(self, j: int) -> list[tuple[int, int]]:
        """What load client ``j`` (1...: the ``lanes`` given) reads into: register it with that client."""
        return self._lanes[j - 1][1].buffers() if self._lanes else []

    def submit_put(self, job: PutJob) -> None:
        self._puts.put(job)

    def submit_get(self, job: GetJob) -> None:
        self._gets.put(job)

    def drain(self) -> list[Done]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    # ---- sending ---------------------------------------------------------------------------
    def _send_loop(self) -> None:
        while (job := self._puts.get()) is not None:
            batch = [job]
            while True:  # everything queued meanwhile goes in the same exists/put calls
                try:
                    nxt = self._puts.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._puts.put(None)
                    break
                batch.append(nxt)
            try:
                self._put_batch(batch)
            except Exception as e:  # never a dead thread: blocks stay pinned and the engine waits forever
                for j in batch:
                    self._done.put(Done(j.job_id, False, False, error=f"{type(e).__name__}: {e}"[:300]))

    def _put_batch(self, jobs: list[PutJob]) -> None:
        keys = [k for j in jobs for k in j.keys]
        try:
            present = self.handle.call("exists", keys)
        except StoreError as e:
            for j in jobs:
                self._done.put(Done(j.job_id, False, False, error=str(e)))
            return
        todo: list[tuple[PutJob, str, list[int]]] = []
        skipped: dict[int, int] = {}
        it = iter(present)
        for j in jobs:
            for key, ids in zip(j.keys, j.chunks):
                if next(it):
                    skipped[j.job_id] = skipped.get(j.job_id, 0) + 1
                else:
                    todo.append((j, key, ids))
        moved: dict[int, int] = {}
        error = item_error = ""  # a whole-batch failure; the first chunk the store refused (e.g. full)
        try:
            for j in {id(j): j for j, _, _ in todo}.values():
                j.event.synchronize()  # the forward that wrote these blocks is done
            for piece in self._pieces(todo, "put"):
                for (j, _, _), r in zip(piece, self._put_piece(piece)):
                    if r.ok:
                        moved[j.job_id] = moved.get(j.job_id, 0) + r.nbytes
                    elif not item_error:
                        item_error = _first_error([r])
        except StoreError as e:
            error = str(e)
        except Exception as e:  # e.g. a device -> staging copy that failed: the put drops, nothing leaks
            error = f"{type(e).__name__}: {e}"[:300]
        for j in jobs:
            self._done.put(Done(j.job_id, False, not error, nbytes=moved.get(j.job_id, 0),
                                skipped=skipped.get(j.job_id, 0), error=error or item_error))

    def _pieces(self, items: list, op: str) -> list[list]:
        per = len(items) if self.direct else max(1, self._stage[op].num_blocks // self.chunk_blocks)
        return [items[i:i + per] for i in range(0, len(items), per)] if items else []

    def _put_piece(self, piece: list[tuple[PutJob, str, list[int]]]) -> list[Any]:
        keys = [k for _, k, _ in piece]
        if self.direct:
            return self.handle.call("put", keys, [self.kv.addresses(ids) for _, _, ids in piece])
        st, cb, tm = self._stage["put"], self.chunk_blocks, self.timing
        t0 = time.perf_counter()
        dev_ids = [b for _, _, ids in piece for b in ids]
        copy_block_pairs(self.dev, self.kv, st.kv, dev_ids, list(range(len(dev_ids))), st.stream)
        ev = self.dev.new_event()
        ev.record(st.stream)
        ev.synchronize()
        t1 = time.perf_counter()
        dests = [st.kv.addresses(list(range(i * cb, (i + 1) * cb))) for i in range(len(piece))]
        if self._holder_ring:
            ring, n = self._holder_ring, self._next_holder
            self._next_holder = (n + len(piece)) % len(ring)
            out = self.handle.call("put", keys, dests, [ring[(n + i) % len(ring)] for i in range(len(piece))])
        else:
            out = self.handle.call("put", keys, dests)
        tm["put_copy_s"] += t1 - t0
        tm["put_store_s"] += time.perf_counter() - t1
        return out

    # ---- receiving -------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        tm = self.timing
        while (job := self._gets.get()) is not None:
            try:
                t0 = time.perf_counter()
                job.event.synchronize()  # a reused block's last writer is done
                tm["load_event_s"] += time.perf_counter() - t0
                landed = [0]
                err = self._get(job, landed)
                ok = not err
                tm["load_jobs"] += 1
                tm["load_wall_s"] += time.perf_counter() - t0
            except StoreError as e:
                ok, err = False, str(e)
            except Exception as e:  # never a wrong token: the request recomputes
                ok, err = False, f"{type(e).__name__}: {e}"
            n = len(job.keys) if ok else landed[0]
            self._done.put(Done(job.job_id, True, ok, job.req_id, n * self.chunk_bytes, error=err, landed=n))

    def _get(self, job: GetJob, landed: list[int]) -> str:
        """'' when every chunk landed in its blocks, else why not (the first failed item);
        ``landed[0]``: the leading chunks whose bytes are in their blocks (copies ended) either way.

        Through staging, pieces take turns in its slots (:meth:`piece_plan`): the store fills one
        while the copies of the others to the device run on the staging stream."""
        items, tm = list(zip(job.keys, job.chunks)), self.timing
        if self.direct:
            for piece in self._pieces(items, "get"):
                t0 = time.perf_counter()
                res = self._get_call([k for k, _ in piece], [self._direct_dest(ids) for _, ids in piece])
                tm["load_store_s"] += time.perf_counter() - t0
                landed[0] += _leading_ok(res)
                if bad := _first_error(res):
                    return bad
            return ""
        if self._packed is not None:
            pk = self._packed

            def land_packed(h: int, first: int, piece: list) -> None:
                pk.scatter(self.dev, h, first, [b for _, ids in piece for b in ids])

            half = pk.num_blocks // 2  # its device scratch has two halves
            return self._get_slots(items, half, 2, lambda first, piece: [
                pk.value(first + i) for i in range(len(piece))], land_packed, pk.stream, landed)
        # routed: one call per client - every holder is read at once already, and more calls per client were
        # slower on the H200 (8B fp8, 4 holders, same run: x4.22 with one call, x3.25 with four; 8 holders:
        # x4.06 with one, x3.47 with two); load_parallel applies to loads from one holder
        if self.routed and self._lanes and len(items) > 1:
            shares = self._route([k for k, _ in items])
            if shares is not None:
                self.timing["load_routed_jobs"] += 1
                return self._get_shares(items, shares, landed, par=1)
        lanes = min(self.lanes_active, len(self._lanes) + 1, len(items))
        if lanes > 1:
            cuts = [len(items) * i // lanes for i in range(lanes + 1)]
            return self._get_shares(items, [list(range(a, b)) for a, b in zip(cuts, cuts[1:])], landed)
        return self._get_staged(items, self._stage["get"], self.handle, landed, self.timing)

    def _get_staged(self, items: list, st: _Staging, handle: StoreHandle, landed: list[int],
                    tm: dict[str, float], lander: queue.SimpleQueue | None = None, par: int | None = None) -> str:
        cb = self.chunk_blocks

        def copy(h: int, first: int, piece: list) -> None:  # blocks the device cache had (-1) stay as they are
            pairs = [(first * cb + i, b) for i, b in enumerate(b for _, ids in piece for b in ids) if b >= 0]
            copy_block_pairs(self.dev, st.kv, self.kv, [s for s, _ in pairs], [d for _, d in pairs], st.stream,
                             None if os.environ.get("HWKV_POOL_LAND_MEMCPY", "1") != "0" else 1 << 62)

        def land(h: int, first: int, piece: list) -> Any:
            if lander is None:
                copy(h, first, piece)
                return None
            job = _Landing(partial(copy, h, first, piece), st.stream, self.dev)
            lander.put(job)
            return job

        per, slots = self.piece_plan(st.num_blocks // cb, par)
        return self._get_slots(items, per, slots, lambda first, piece: [
            st.kv.addresses(list(range((first + i) * cb, (first + i + 1) * cb))) for i in range(len(piece))],
            land, st.stream, landed, handle, tm, par)

    def _route(self, keys: list[str]) -> list[list[int]] | None:
        """Per load client, the indices of ``keys`` it reads: each value through a client of a holder
        that has a replica of it (a holder's values split into contiguous runs over its clients), a
        value no holder of ours has (or ``locate`` failing: ``None``, contiguous shares then) through
        the least-loaded client."""
        t0 = time.perf_counter()
        try:
            where = self.locate(keys)  # type: ignore[misc]
        except (StoreError, ValueError):
            return None
        finally:
            self.timing["load_locate_s"] += time.perf_counter() - t0
        segs = self.segments or []
        by_seg: dict[str, list[int]] = {}
        for j, s in enumerate(segs):
            by_seg.setdefault(s, []).append(j)
        per_seg: dict[str, list[int]] = {s: [] for s in by_seg}
        stray = []
        for i, reps in enumerate(where):
            s = next((r for r in reps if r in per_seg), None)
            if s is None:
                stray.append(i)
            else:
                per_seg[s].append(i)
        shares: list[list[int]] = [[] for _ in segs]
        for s, idx in per_seg.items():
            clients = by_seg[s]
            cuts = [len(idx) * c // len(clients) for c in range(len(clients) + 1)]
            for c, a, b in zip(clients, cuts, cuts[1:]):
                shares[c] = idx[a:b]
        for i in stray:
            min(shares, key=len).append(i)
        for sh in shares:
            sh.sort()
        return shares

    def _get_shares(self, items: list, shares: list[list[int]], landed: list[int], par: int | None = None) -> str:
        """``shares[j]``: the indices of ``items`` load client ``j`` reads (in order; disjoint, all of
        them), all clients at once, each through its own staging and stream, in ``par`` calls at once
        (None: ``load_parallel``); returns once every client ended (none still writes). ``landed``: the
        leading chunks of the whole job that landed (an item landed when its client landed every item of
        its share before it); the error: the first failing client's (in client order)."""
        parts = [(self.handle, self._stage["get"]), *self._lanes]
        use = [j for j, sh in enumerate(shares) if sh]
        got = {j: [0] for j in use}
        tms = {j: dict.fromkeys(("load_store_s", "load_copy_wait_s", "load_land_s"), 0.0) for j in use}
        lander: queue.SimpleQueue = queue.SimpleQueue()
        runs, land_s = _with_lander(self._lane_pool, [  # type: ignore[arg-type]
            partial(self._get_staged, [items[i] for i in shares[j]], parts[j][1], parts[j][0], got[j], tms[j], lander,
                    par) for j in use], lander)
        errs = [r if e is None else f"{type(e).__name__}: {e}"[:300] for r, e in runs]
        for k in ("load_store_s", "load_copy_wait_s"):  # side by side: the slowest one's time
            self.timing[k] += max(t[k] for t in tms.values())
        self.timing["load_land_s"] += land_s  # the landing thread's
        ok = [False] * len(items)
        for j in use:
            for i in shares[j][:got[j][0]]:
                ok[i] = True
        landed[0] = next((i for i, x in enumerate(ok) if not x), len(items))
        return next((e for e in errs if e), "")

    def piece_plan(self, chunks: int, par: int | None = None) -> tuple[int, int]:
        """``(chunks per piece, pieces in flight)`` for a staging buffer of ``chunks`` chunks. One
        caller: two halves (the store fills one while the other goes to the device). ``load_parallel``
        P > 1: pieces of a multiple of P chunks (every caller gets as many), at least two in flight
        and as many as fit, so the copy of the last piece, which nothing overlaps, is short. ``par``:
        instead of ``load_parallel``."""
        p = self.load_parallel if par is None else par
        if p <= 1 or chunks < 2 * p:
            per = max(1, chunks // 2)
        else:
            per = p * max(1, chunks // (4 * p))  # up to four pieces in flight
        return per, max(1, chunks // per)

    def _get_call(self, keys: list[str], dests: list[Any], handle: StoreHandle | None = None,
                  par: int | None = None) -> list[Any]:
        """One ``get`` of ``keys`` into ``dests``, as ``load_parallel`` concurrent calls on contiguous
        shares (results in key order). Returns only once every share's call has returned, so no
        store write into the destinations is still running; a whole-call error of any share is
        raised then (the first)."""
        handle = handle or self.handle
        n = min(self.load_parallel if par is None else par, len(keys))
        if n <= 1:
            return handle.call("get", keys, dests)
        with self._pool_lock:  # lanes call at once: room for every client's extra calls
            size = max(4, len(self._lanes) + 1) * (n - 1)
            if self._pool is None or self._pool_size < size:
                if self._pool is not None:
                    self._pool.shutdown(wait=False)
                self._pool_size = size
                self._pool = ThreadPoolExecutor(self._pool_size, thread_name_prefix="hwkv-pool-get")
            pool = self._pool
        cuts = [len(keys) * i // n for i in range(n + 1)]
        runs = _side_by_side(pool, [partial(handle.call, "get", keys[a:b], dests[a:b]) for a, b in zip(cuts, cuts[1:])])
        if err := next((e for _, e in runs if e is not None), None):
            raise err
        return [x for r, _ in runs for x in r]

    def _direct_dest(self, ids: list[int]) -> list[tuple[int, int]]:
        """A chunk's segments in the KV tensors themselves; its blocks the device cache had (-1 ids,
        leading) go to the scratch blocks instead, so the value's bytes land in order."""
        if ids[0] >= 0:
            return self.kv.addresses(ids)
        out = []
        for ti, (t, sc) in enumerate(zip(self.kv.tensors, self._scratch.tensors)):  # type: ignore[union-attr]
            nb = self.kv.block_nbytes(ti)
            out += [(sc.data_ptr() + j * nb, nb) if b < 0 else (t.data_ptr() + b * nb, nb) for j, b in enumerate(ids)]
        return out

    def _get_slots(self, items: list, per: int, slots: int, dests: Any, land: Any, stream: Any,
                   landed: list[int], handle: StoreHandle | None = None, tm: dict[str, float] | None = None,
                   par: int | None = None) -> str:
        """Pieces of ``per`` chunks take turns in ``slots`` slots of a staging buffer: the store fills
        one slot (``dests(first, piece)``: each value's destination, ``first`` the slot's first chunk)
        while ``land(h, first, piece)``, queued on ``stream``, takes the earlier ones to the device.
        Staging (one segment per KV tensor) and packed (one segment per value) differ only there.
        A piece with a failed item still lands its leading good chunks (``landed``)."""
        tm = self.timing if tm is None else tm
        copies: list[Any] = [None] * slots  # the event of each slot's last copy out
        done = 0  # chunks whose copies to the device are queued
        try:
            for n, piece in enumerate(items[i:i + per] for i in range(0, len(items), per)):
                h = n % slots
                t0 = time.perf_counter()
                if copies[h] is not None:
                    copies[h].synchronize()  # this slot's previous copy to the device has read it
                t1 = time.perf_counter()
                first = h * per
                res = self._get_call([k for k, _ in piece], dests(first, piece), handle, par)
                tm["load_copy_wait_s"] += t1 - t0
                tm["load_store_s"] += time.perf_counter() - t1
                good = _leading_ok(res)
                if good:
                    t2 = time.perf_counter()
                    ev = land(h, first, piece[:good])  # None: queued here on ``stream``; else its landing
                    tm["load_land_s"] += time.perf_counter() - t2
                    if ev is None:
                        ev = self.dev.new_event()
                        ev.record(stream)
                    copies[h] = ev
                    done += good
                if bad := _first_error(res):
                    return bad
        finally:
            t0 = time.perf_counter()
            for ev in copies:  # never return while a copy still reads staging or writes the blocks
                if ev is not None:
                    ev.synchronize()
            tm["load_copy_wait_s"] += time.perf_counter() - t0
            landed[0] = done  # every queued copy has ended (an exception in one: none counted past it)
        return ""

    def close(self, timeout_s: float = 5.0) -> None:
        self._puts.put(None)
        self._gets.put(None)
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
        for pool in (self._pool, self._lane_pool):
            if pool is not None:
                pool.shutdown(wait=False)


def _side_by_side(pool: ThreadPoolExecutor, calls: list[Callable[[], Any]]) -> list[tuple[Any, Exception | None]]:
    """``calls[0]`` on this thread and the rest on ``pool`` at once; ``(result, error)`` of each in call
    order, returned only once every call has returned (they write into shared destinations, so none
    may still run when the caller reuses them or raises)."""
    futs = [pool.submit(c) for c in calls[1:]]
    out: list[tuple[Any, Exception | None]] = []
    for run in (calls[0], *(f.result for f in futs)):
        try:
            out.append((run(), None))
        except Exception as e:
            out.append((None, e))
    return out


class _Landing:
    """A piece's copies to the device, queued by the landing thread (:func:`_with_lander`) on the
    reading client's stream; ``synchronize`` (the client, before reusing the piece's staging slot, and
    before it returns) waits until they were queued, then until they ran - or raises what queueing raised."""

    def __init__(self, copy: Callable[[], None], stream: Any, dev: Any):
        self.copy, self.stream, self.dev = copy, stream, dev
        self.queued = threading.Event()
        self.event: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.copy()
            self.event = self.dev.new_event()
            self.event.record(self.stream)
        except BaseException as e:  # handed to the client that read the piece
            self.error = e
        finally:
            self.queued.set()

    def synchronize(self) -> None:
        self.queued.wait()
        if self.error is not None:
            raise self.error
        self.event.synchronize()


def _with_lander(pool: ThreadPoolExecutor, calls: list[Callable[[], Any]],
                 lander: queue.SimpleQueue) -> tuple[list[tuple[Any, Exception | None]], float]:
    """Every call on ``pool`` while this thread queues the pieces' copies they hand over on ``lander``
    (:class:`_Landing`), until every call returned; ``(result, error)`` of each in call order and the
    seconds spent queueing copies. A call waits for its landings before it returns, so none is left."""
    futs = [pool.submit(c) for c in calls]
    for f in futs:
        f.add_done_callback(lambda _: lander.put(None))
    left, land_s = len(futs), 0.0
    while left:
        job = lander.get()
        if job is None:
            left -= 1
            continue
        t0 = time.perf_counter()
        job.run()
        land_s += time.perf_counter() - t0
    out: list[tuple[Any, Exception | None]] = []
    for f in futs:
        try:
            out.append((f.result(), None))
        except Exception as e:
            out.append((None, e))
    return out, land_s
