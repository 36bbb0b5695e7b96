"""Adversarial audit (session 7): broken backends written as vendors would ship them, each ONE
subtle bug, written before reading the other mutant modules (so they test the suite, not the
mutants). Each one that certified before this audit was a hole; its killer is named in ``first``.
"""

from __future__ import annotations

from typing import Any

import torch

from conformance.mutants.base import mutant
from hwkv.interfaces import KeyNotFound, StoreFull
from hwkv.interfaces.store import ItemResult
from hwkv.reference import ReferenceAttentionImpl
from hwkv.reference.device import CpuDevice
from hwkv.stores.embedded import EmbeddedStore

# ---------------------------------------------------------------- attention / KV write


class Int16Slots(ReferenceAttentionImpl):
    """Vendor A: the write kernel takes its slot index as int16 (a 'compact' slot tensor)."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slot_mapping: torch.Tensor) -> None:
        s = slot_mapping.to(torch.int16).to(slot_mapping.dtype)  # wraps past 32,767
        neg = s < 0
        s = torch.where(neg & (slot_mapping >= 0), s + 65536, s)  # the 'unsigned fix' the vendor shipped
        s = torch.where(s >= 0, s % 65536, s)
        super().write_kv(key, value, layer_kv, s)


class U16Blocks(ReferenceAttentionImpl):
    """Vendor B: block ids packed as uint16 in the kernel's table (fine under 65,536 blocks)."""

    def forward(self, query, key, value, layer_kv, metadata):
        bt = metadata.block_tables
        metadata.block_tables = torch.where(bt >= 0, bt & 0xFFFF, bt)
        try:
            return super().forward(query, key, value, layer_kv, metadata)
        finally:
            metadata.block_tables = bt


class Past2048(ReferenceAttentionImpl):
    """Vendor C: the table is read in chunks of 2,048 columns; past the first chunk the column
    index is off by one (reads the previous block)."""

    def forward(self, query, key, value, layer_kv, metadata):
        bt = metadata.block_tables
        if bt.shape[1] > 2048:
            nb = bt.clone()
            nb[:, 2048:] = bt[:, 2047:-1]
            metadata.block_tables = nb
        try:
            return super().forward(query, key, value, layer_kv, metadata)
        finally:
            metadata.block_tables = bt


class TailPadding(ReferenceAttentionImpl):
    """Vendor D: the write kernel assumes -1 slots are only at the tail (CUDA-graph padding):
    it writes the first count(slot >= 0) rows."""

    def write_kv(self, key, value, layer_kv, slot_mapping):
        n = int((slot_mapping >= 0).sum())
        s = slot_mapping.clone()
        s[n:] = -1
        super().write_kv(key, value, layer_kv, s)


class NoCausalShortQuery(ReferenceAttentionImpl):
    """Vendor E: the 'decode' kernel handles query_len <= 8 (spec verify k+1) and sees the whole
    context from every query row (no causal mask inside the query)."""

    def forward(self, query, key, value, layer_kv, metadata):
        out = super().forward(query, key, value, layer_kv, metadata)
        qsl, sl = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for r in range(len(sl)):
            a, b = int(qsl[r]), int(qsl[r + 1])
            if 1 < b - a <= 8:
                # every row attends like the last row of the request
                md = _one_row(metadata, r)
                q = query[a:b]
                rows = []
                for i in range(b - a):
                    md.query_start_loc_cpu = torch.tensor([0, 1], dtype=qsl.dtype)
                    rows.append(super().forward(q[i:i + 1], key[a:b][i:i + 1], value[a:b][i:i + 1], layer_kv, md))
                out[a:b] = torch.cat(rows)
        return out


def _one_row(metadata, r):
    import copy

    md = copy.copy(metadata)
    md.seq_lens_cpu = metadata.seq_lens_cpu[r:r + 1].clone()
    md.block_tables = metadata.block_tables[r:r + 1]
    return md


class EmptyPartition(ReferenceAttentionImpl):
    """Vendor F: split-KV in 512-key partitions sizes the last one as ``seq_len % 512``: when the
    length is a multiple of 512 (>= 2 partitions) the last partition is empty and its keys are lost
    (for the decode row, the request's last query row)."""

    P = 512

    def forward(self, query, key, value, layer_kv, metadata):
        out = super().forward(query, key, value, layer_kv, metadata)
        qsl, sl = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for r in range(len(sl)):
            n = int(sl[r])
            if n < 2 * self.P or n % self.P:
                continue
            i = int(qsl[r + 1]) - 1
            md = _one_row(metadata, r)
            md.query_start_loc_cpu = torch.tensor([0, 1], dtype=qsl.dtype)
            md.seq_lens_cpu = torch.tensor([n - self.P], dtype=sl.dtype)
            out[i:i + 1] = super().forward(query[i:i + 1], key[i:i + 1], value[i:i + 1], layer_kv, md)
        return out


class PerTensorScale(ReferenceAttentionImpl):
    """Vendor G: fp8 KV written with one per-tensor scale (head 0's) instead of per-head scales."""

    def write_kv(self, key, value, layer_kv, slot_mapping):
        from hwkv.reference.attention import split_kv, write_kv

        self._check_cache(layer_kv)
        sc = self._scales(layer_kv)
        if sc is not None:
            sc = sc[:, :1].expand_as(sc).contiguous()
        write_kv(key, value, layer_kv, slot_mapping, sc)
        del split_kv


mutant("audit-int16-slots", "kv_write", "write kernel narrows slots to 16 bits (wraps past 65,535)",
       ("test_kv_write", "test_long_context"), impl=Int16Slots)
mutant("audit-u16-blocks", "attention", "block ids packed as uint16 in the kernel's table",
       ("test_long_context", "test_attention"), impl=U16Blocks)
mutant("audit-past-2048", "attention", "table columns past 2,048 read one block early",
       ("test_long_context",), impl=Past2048)
mutant("audit-tail-padding", "kv_write", "write kernel assumes -1 slots only at the tail",
       ("test_kv_write",), impl=TailPadding)
mutant("audit-no-causal-short-query", "attention", "k+1 verify queries see the whole context (no causal mask)",
       ("test_attention", "test_spec_decode"), impl=NoCausalShortQuery)
mutant("audit-empty-partition", "attention",
       "split-KV sizes the last 512-key partition as seq_len % 512 (multiples of 512 lose it)",
       ("test_long_context",), impl=EmptyPartition)
mutant("audit-per-tensor-scale", "kv_write", "fp8 KV written with head 0's scale for every head",
       ("test_fp8_kv",), impl=PerTensorScale)

# ---------------------------------------------------------------- device


class ChunkedCopy(CpuDevice):
    """Vendor H: copy_blocks launches chunks of 128 pairs and drops the remainder past the first chunk."""

    def copy_blocks(self, src, dst, pairs, stream=None):
        pairs = list(pairs)
        if len(pairs) > 128:
            pairs = pairs[: len(pairs) // 128 * 128]
        return super().copy_blocks(src, dst, pairs, stream)


mutant("audit-chunked-copy", "device", "copy_blocks drops the pairs past the last full chunk of 128",
       ("test_copy_blocks",), device=ChunkedCopy)

# ---------------------------------------------------------------- store


class StaleCache(EmbeddedStore):
    """Vendor I: a client-side read cache of the last values got, not invalidated by put."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._cache: dict[str, bytes] = {}

    def get(self, keys, buffers):
        import ctypes

        res = super().get(keys, buffers)
        out = []
        for k, segs, r in zip(keys, buffers, res):
            if r.ok and k in self._cache:
                data, off = self._cache[k], 0
                for p, n in segs:
                    ctypes.memmove(p, data[off:off + n], n)
                    off += n
            elif r.ok:
                self._cache[k] = b"".join(ctypes.string_at(p, n) for p, n in segs)
            out.append(r)
        return out

    def remove(self, keys):
        for k in keys:
            self._cache.pop(k, None)
        return super().remove(keys)


class AsciiKeys(EmbeddedStore):
    """Vendor J: keys normalised to ASCII (non-ASCII characters become '?')."""

    @staticmethod
    def _n(keys):
        return [k.encode("ascii", "replace").decode() for k in keys] if isinstance(keys, (list, tuple)) else keys

    def put(self, keys, buffers):
        return [ItemResult(k, r.nbytes, r.error) for k, r in zip(keys, super().put(self._n(keys), buffers))]

    def get(self, keys, buffers):
        return [ItemResult(k, r.nbytes, r.error) for k, r in zip(keys, super().get(self._n(keys), buffers))]

    def exists(self, keys):
        return super().exists(self._n(keys))

    def remove(self, keys):
        return [ItemResult(k, r.nbytes, r.error) for k, r in zip(keys, super().remove(self._n(keys)))]


class TruncKeys(AsciiKeys):
    """Vendor K: keys cut to 128 bytes (a fixed-size key field)."""

    @staticmethod
    def _n(keys):
        return [k[:128] for k in keys] if isinstance(keys, (list, tuple)) else keys


class HalfWritten(EmbeddedStore):
    """Vendor L: put creates the index entry before it allocates; a put that fails (StoreFull)
    leaves the key listed, so ``exists`` says True for a value that was never written."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._listed: set[str] = set()

    def put(self, keys, buffers):
        res = super().put(keys, buffers)
        for r in res:
            (self._listed.add if isinstance(r.error, StoreFull) else self._listed.discard)(r.key)
        return res

    def remove(self, keys):
        for k in keys if isinstance(keys, (list, tuple)) else ():
            self._listed.discard(k)
        return super().remove(keys)

    def exists(self, keys):
        return [e or k in self._listed for k, e in zip(keys, super().exists(keys))]


class GetNotUse(EmbeddedStore):
    """Vendor M: eviction is FIFO by insertion (get does not refresh)."""

    def get(self, keys, buffers):
        with self._lock:
            order = list(self._values.keys())
        res = super().get(keys, buffers)
        with self._lock:
            for k in order:
                if k in self._values:
                    self._values.move_to_end(k)
        return res


class BreakOnMiss(EmbeddedStore):
    """Vendor N: a batched get stops at the first miss; the rest report KeyNotFound."""

    def get(self, keys, buffers):
        res = super().get(keys, buffers)
        out, missed = [], False
        for r in res:
            if missed:
                out.append(ItemResult(r.key, 0, KeyNotFound(f"key {r.key!r} not found")))
                continue
            missed = not r.ok
            out.append(r)
        return out


class ShortGet(EmbeddedStore):
    """Vendor O: get into smaller buffers copies a prefix instead of SizeMismatch."""

    def get(self, keys, buffers):
        import ctypes

        res = super().get(keys, buffers)
        out = []
        for k, segs, r in zip(keys, buffers, res):
            if r.error is not None and type(r.error).__name__ == "SizeMismatch":
                out.append(ItemResult(k, sum(n for _, n in segs)))
                for p, n in segs:
                    ctypes.memset(p, 0, n)
            else:
                out.append(r)
        return out


mutant("audit-stale-cache", "store", "client read cache not invalidated by an overwrite",
       ("test_store",), store=StaleCache)
mutant("audit-ascii-keys", "store", "non-ASCII key characters normalised to '?'", ("test_store",), store=AsciiKeys)
mutant("audit-trunc-keys", "store", "keys truncated to 128 characters", ("test_store",), store=TruncKeys)
mutant("audit-half-written", "store", "exists() is True for a key whose put failed (StoreFull)",
       ("test_store",), store=HalfWritten)
mutant("audit-get-not-use", "store", "eviction ignores gets (FIFO, not LRU)", ("test_store",), store=GetNotUse)
mutant("audit-break-on-miss", "store", "batched get reports every key after a miss as missing",
       ("test_store",), store=BreakOnMiss)
mutant("audit-short-get", "store", "get into a smaller buffer succeeds (zero-filled) instead of SizeMismatch",
       ("test_store",), store=ShortGet)

# ---------------------------------------------------------------- transfer


class _Wrap:
    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)

    def _fix(self, a, b, n):
        return a, b, n

    def submit_write(self, peer, src, dst, lengths, **kw):
        return self._t.submit_write(peer, *self._fix(src, dst, lengths), **kw)

    def submit_read(self, peer, local, remote, lengths, **kw):
        return self._t.submit_read(peer, *self._fix(local, remote, lengths), **kw)

    def write(self, peer, src, dst, lengths):
        self.wait(self.submit_write(peer, src, dst, lengths))

    def read(self, peer, local, remote, lengths):
        self.wait(self.submit_read(peer, local, remote, lengths))

    def wait(self, batch, timeout_s=30.0):
        return self._t.wait(batch, timeout_s)


class DropPartialPage(_Wrap):
    """Vendor P: segments longer than a 4 KiB page move whole pages only (the tail is dropped)."""

    def _fix(self, a, b, n):
        n = list(n)
        if any(x > 4096 and x % 4096 for x in n):
            keep = [i for i, x in enumerate(n) if x > 4096 and x % 4096]
            for i in keep:
                n[i] -= n[i] % 4096
        return a, b, n


class AlignDown(_Wrap):
    """Vendor Q: remote addresses aligned down to 8 bytes (the NIC wants aligned descriptors)."""

    def _fix(self, a, b, n):
        return a, [p & ~7 for p in b], n


class Ring1024(_Wrap):
    """Vendor R: a descriptor ring of 1,024 entries: a bigger batch moves its first 1,024 segments."""

    def _fix(self, a, b, n):
        return list(a)[:1024], list(b)[:1024], list(n)[:1024]


mutant("audit-drop-partial-page", "transfer", "segments > 4 KiB lose their last partial page",
       ("test_transfer",), transfer=DropPartialPage)
mutant("audit-align-down", "transfer", "remote addresses aligned down to 8 bytes", ("test_transfer",),
       transfer=AlignDown)
mutant("audit-ring-1024", "transfer", "batches beyond 1,024 segments silently truncated", ("test_transfer",),
       transfer=Ring1024)

# ---------------------------------------------------------------- device runtime (lazy-stream emulator)

from conformance.mutants.runtime import LazyEvent, LazyStream, LazyStreamDevice, lazy_backend  # noqa: E402


class _WaitStreamNoop(LazyStream):
    """Vendor S: ``wait_stream`` is a no-op (the vendor thought ``wait_event`` was enough)."""

    def wait_stream(self, stream):
        return None


class _QueryLies(LazyEvent):
    """Vendor T: ``Event.query`` is True once recorded (checks the record, not the work)."""

    def query(self):
        return True


class _FirstRecordSticks(LazyEvent):
    """Vendor U: an event keeps the position of its FIRST record; re-recording it (every step)
    does not move it, so a wait orders only the first step's work."""

    def record(self, stream=None):
        if self.mark is None:
            super().record(stream)


class _SyncCurrentOnly(LazyStreamDevice):
    """Vendor V: ``Device.synchronize`` waits for the current stream only, not side streams."""

    def synchronize(self):
        return None


def _dev(name, **attrs):
    return type(f"LazyStreamDevice_{name}", (LazyStreamDevice,), attrs)


def _side_wait_stream_noop_device():
    class S(LazyStreamDevice):
        def new_stream(self):
            s = _WaitStreamNoop(self)
            self.streams.append(s)
            return s

    S._default_stream_cls = _WaitStreamNoop
    return type("LazyStreamDevice_waitstream", (S,), {"default_stream_cls": _WaitStreamNoop})


mutant("audit-wait-stream-noop", "device", "Stream.wait_stream orders nothing", ("test_stream_ordering",),
       device=_side_wait_stream_noop_device())
mutant("audit-event-query-lies", "device", "Event.query is True as soon as recorded", ("test_stream_ordering",),
       device=_dev("querylies", event_cls=_QueryLies))
mutant("audit-event-first-record", "device", "a re-recorded event keeps its first position", ("test_stream_ordering",),
       device=_dev("firstrecord", event_cls=_FirstRecordSticks))
mutant("audit-sync-current-only", "device", "Device.synchronize leaves side streams running", ("test_stream_ordering",),
       device=_SyncCurrentOnly)
del lazy_backend

# ---------------------------------------------------------------- second round


class GqaModulo(ReferenceAttentionImpl):
    """Vendor W: query head h reads KV head h % H_kv (interleaved grouping) instead of h // group."""

    def forward(self, query, key, value, layer_kv, metadata):
        g = self.num_heads // self.num_kv_heads
        if g == 1:
            return super().forward(query, key, value, layer_kv, metadata)
        # h % H_kv == the reference on heads permuted so that head h lands where h // g would read it
        perm = torch.arange(self.num_heads).view(self.num_kv_heads, g).t().reshape(-1)
        inv = torch.argsort(perm)
        out = super().forward(query[:, perm.to(query.device)], key, value, layer_kv, metadata)
        return out[:, inv.to(out.device)]


class WholeLastBlock(ReferenceAttentionImpl):
    """Vendor X: the decode kernel masks keys per block, not per token: a decode row reads its last
    block whole (keys past seq_len - stale KV of an earlier owner - included)."""

    def forward(self, query, key, value, layer_kv, metadata):
        from hwkv.reference.attention import split_kv

        out = super().forward(query, key, value, layer_kv, metadata)
        bs = split_kv(layer_kv)[0].shape[1]
        qsl, sl = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for r in range(len(sl)):
            n = int(sl[r])
            a, b = int(qsl[r]), int(qsl[r + 1])
            if b - a != 1 or n % bs == 0 or n < 1:
                continue
            md = _one_row(metadata, r)
            md.query_start_loc_cpu = torch.tensor([0, 1], dtype=qsl.dtype)
            md.seq_lens_cpu = torch.tensor([-(-n // bs) * bs], dtype=sl.dtype)
            out[a:b] = super().forward(query[a:b], key[a:b], value[a:b], layer_kv, md)
        return out


mutant("audit-gqa-modulo", "attention", "query head h reads KV head h % H_kv instead of h // group",
       ("test_attention",), impl=GqaModulo)
mutant("audit-whole-last-block", "attention", "decode rows read their last block whole (keys past seq_len)",
       ("test_attention",), impl=WholeLastBlock)


class StridedHostCopy(CpuDevice):
    """Vendor Y: to_host_async DMA-copies the tensor's storage bytes, ignoring its strides."""

    def to_host_async(self, t):
        flat = torch.as_strided(t, (t.numel(),), (1,), t.storage_offset())
        return flat.clone().view(t.shape), None


mutant("audit-strided-host-copy", "device", "to_host_async copies storage bytes, ignoring strides",
       ("test_host_staging",), device=StridedHostCopy)


class RemoveMissingOk(EmbeddedStore):
    """Vendor Z: remove of a missing key reports success (idempotent delete)."""

    def remove(self, keys):
        return [ItemResult(r.key, r.nbytes) if isinstance(r.error, KeyNotFound) else r for r in super().remove(keys)]


class OverwriteLeak(EmbeddedStore):
    """Vendor AA: an overwrite does not release the old value's bytes from the accounting."""

    def put(self, keys, buffers):
        with self._lock:
            old = {k: self._values[k].nbytes for k in keys if k in self._values}
        res = super().put(keys, buffers)
        with self._lock:
            self._used += sum(n for k, n in old.items())
            self._evict(0)
        return res


mutant("audit-remove-missing-ok", "store", "remove of a missing key succeeds", ("test_store",), store=RemoveMissingOk)
mutant("audit-overwrite-leak", "store", "overwrites leak the old value's bytes from the capacity", ("test_store",),
       store=OverwriteLeak)


class UniformLengths(_Wrap):
    """Vendor AB: a batch is assumed uniform: every segment moves lengths[0] bytes."""

    def _fix(self, a, b, n):
        return a, b, [n[0]] * len(n)


mutant("audit-uniform-lengths", "transfer", "every segment of a batch moves lengths[0] bytes", ("test_transfer",),
       transfer=UniformLengths)

# ---------------------------------------------------------------- communicator (two gloo ranks)


def _custom_with(bug: str):
    from conformance.mutants.collectives import _custom
    from hwkv.model.layers import rms_norm

    base = _custom(None)

    def custom_all_reduce(self, comm):
        ar = base(self, comm)
        if ar is None:
            return None
        fused = ar.all_reduce_add_rms_norm
        if bug == "eps-fixed":  # the kernel was written for Qwen: eps 1e-6 whatever the model says

            def norm(t, residual, weight, eps):
                return fused(t, residual, weight, 1e-6)
        elif bug == "gemma-weight":  # (1 + weight), Gemma's convention, for every model

            def norm(t, residual, weight, eps):
                y, h = fused(t, residual, weight, eps)
                return rms_norm(h, weight + 1, eps), h
        elif bug == "staging-16mib":  # a 16 MiB staging buffer: bytes past it never reduced
            flat_ar = ar

            def ar(t):  # noqa: F811
                n = (16 << 20) // t.element_size()
                if t.numel() > n:
                    flat_ar(t.view(-1)[:n])
                    return t
                return flat_ar(t)

            ar.all_reduce_add = lambda t, residual: residual + ar(t)
            norm = fused
        ar.all_reduce_add_rms_norm = norm
        return ar

    return type(f"Device_audit_{bug}", (CpuDevice,), {"custom_all_reduce": custom_all_reduce})


COLL = ("test_multi_device.py::test_collectives",)
mutant("audit-ar-norm-eps-fixed", "communicator", "fused all_reduce_add_rms_norm ignores eps (1e-6 always)", COLL,
       device=_custom_with("eps-fixed"))
mutant("audit-ar-norm-gemma-weight", "communicator", "fused all_reduce_add_rms_norm scales by (1 + weight)", COLL,
       device=_custom_with("gemma-weight"))
mutant("audit-ar-staging-16mib", "communicator", "custom all-reduce reduces only the first 16 MiB", COLL,
       device=_custom_with("staging-16mib"))


class PublishFirst(EmbeddedStore):
    """Vendor AC: put publishes the key's index entry (pointing at the destination memory) and then
    copies the segments one by one (a DMA per segment): a concurrent get or exists sees the value
    half-written."""

    def put(self, keys, buffers):
        import time

        import numpy as np

        from hwkv.stores.embedded import copy_bytes

        out = []
        for key, segs in zip(keys, buffers):
            total = sum(n for _, n in segs)
            if total > self.capacity_bytes:
                out.append(ItemResult(key, total, StoreFull(f"key {key!r}: {total} B exceeds the capacity")))
                continue
            arr = np.zeros(total, dtype=np.uint8)
            with self._lock:
                old = self._values.pop(key, None)
                if old is not None:
                    self._used -= old.nbytes
                self._evict(total)
                self._values[key] = arr
                self._used += total
            off = 0
            for p, n in segs:
                copy_bytes(arr.ctypes.data + off, p, n)
                off += n
                time.sleep(0.0002)
            out.append(ItemResult(key, total))
        return out


mutant("audit-publish-before-copy", "store", "a put's index entry is visible before its segments are copied",
       ("test_readers_never_see",), store=PublishFirst)


class ContiguousRows(ReferenceAttentionImpl):
    """Vendor AD: the write kernel indexes key/value rows as if contiguous ([T, H_kv, D] packed): a
    key that is a view of a fused qkv output is read at the wrong offsets."""

    def write_kv(self, key, value, layer_kv, slot_mapping):
        if not key.is_contiguous():
            key = torch.as_strided(key, key.shape, torch.empty(key.shape).stride(), key.storage_offset())
            value = torch.as_strided(value, value.shape, torch.empty(value.shape).stride(), value.storage_offset())
        super().write_kv(key, value, layer_kv, slot_mapping)


class Fp8NoSaturate(ReferenceAttentionImpl):
    """Vendor AE: the fp8 write converts without saturation: |x / scale| > 448 becomes NaN."""

    def write_kv(self, key, value, layer_kv, slot_mapping):
        from hwkv.interfaces.kv_quant import FP8_E4M3_MAX

        sc = self._scales(layer_kv)
        if sc is not None:
            big = lambda x, s: (x.float() / s[:, None]).abs() > FP8_E4M3_MAX  # noqa: E731
            key = torch.where(big(key, sc[0].to(key.device)), float("nan"), key.float()).to(key.dtype)
            value = torch.where(big(value, sc[1].to(value.device)), float("nan"), value.float()).to(value.dtype)
        super().write_kv(key, value, layer_kv, slot_mapping)


class Fp8InverseScale(ReferenceAttentionImpl):
    """Vendor AF: the fp8 write multiplies by the scale (an inverse-scale convention) instead of dividing."""

    def write_kv(self, key, value, layer_kv, slot_mapping):
        from hwkv.reference.attention import write_kv

        self._check_cache(layer_kv)
        sc = self._scales(layer_kv)
        write_kv(key, value, layer_kv, slot_mapping, None if sc is None else 1.0 / sc)


mutant("audit-contiguous-rows", "kv_write", "write kernel reads key/value rows as packed (fused-qkv views wrong)",
       ("test_kv_write", "test_attention"), impl=ContiguousRows)
mutant("audit-fp8-no-saturate", "kv_write", "fp8 write without saturation (|x/scale| > 448 -> NaN)", ("test_fp8",),
       impl=Fp8NoSaturate)
mutant("audit-fp8-inverse-scale", "kv_write", "fp8 write multiplies by the scale instead of dividing", ("test_fp8",),
       impl=Fp8InverseScale)


class VerifyPeeksAhead(ReferenceAttentionImpl):
    """Vendor AG: the multi-token decode path (2..8 query rows: spec verify) builds its causal mask
    with ``<=`` one position late: row i also sees the key of row i + 1."""

    def forward(self, query, key, value, layer_kv, metadata):
        out = super().forward(query, key, value, layer_kv, metadata)
        qsl, sl = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for r in range(len(sl)):
            a, b = int(qsl[r]), int(qsl[r + 1])
            if not 1 < b - a <= 8:
                continue
            n = int(sl[r])
            for i in range(a, b - 1):
                md = _one_row(metadata, r)
                md.query_start_loc_cpu = torch.tensor([0, 1], dtype=qsl.dtype)
                md.seq_lens_cpu = torch.tensor([n - (b - 1 - i) + 1], dtype=sl.dtype)
                out[i:i + 1] = super().forward(query[i:i + 1], key[i:i + 1], value[i:i + 1], layer_kv, md)
        return out


mutant("audit-verify-peeks-ahead", "attention", "k+1 verify rows see one key past their position",
       ("test_attention_verify_queries", "test_long_context"), impl=VerifyPeeksAhead)


class CopySkipsFp8(CpuDevice):
    """Vendor AH: copy_blocks handles the 2-byte dtypes; a 1-byte (fp8) cache is skipped silently
    (the offload tier then stores nothing)."""

    def copy_blocks(self, src, dst, pairs, stream=None):
        if src.tensors and src.tensors[0].element_size() == 1:
            self.check_copy(src, dst, pairs)
            return None
        return super().copy_blocks(src, dst, pairs, stream)


mutant("audit-copy-skips-fp8", "device", "copy_blocks silently skips fp8 (1-byte) caches", ("test_copy_blocks", "fp8"),
       device=CopySkipsFp8)


class PollLies(_Wrap):
    """Vendor AI: poll reports a batch done once it was handed to the NIC (not when it landed)."""

    def poll(self, batch):
        self._t.poll(batch)
        return True

    def wait(self, batch, timeout_s=30.0):
        self.poll(batch)


class PollSwallows(_Wrap):
    """Vendor AJ: a failed batch polls as done (the error is logged, not raised)."""

    def poll(self, batch):
        from hwkv.interfaces.transfer import TransferError

        try:
            return self._t.poll(batch)
        except TransferError:
            return True

    def wait(self, batch, timeout_s=30.0):
        import time

        deadline = time.monotonic() + timeout_s
        while not self.poll(batch):
            if time.monotonic() > deadline:
                raise TimeoutError(batch)
            time.sleep(0.0002)


mutant("audit-poll-early", "transfer", "poll True once submitted, before the bytes landed", ("test_transfer",),
       transfer=PollLies)
mutant("audit-poll-swallows-errors", "transfer", "a failed batch polls as done", ("test_transfer_failure",),
       transfer=PollSwallows)

# ---------------------------------------------------------------- elementwise (written after reading the control)

from conformance.mutants.elementwise import VendorElementwise  # noqa: E402


class SwappedHalves(VendorElementwise):
    """Vendor AK: silu(up) * gate - the checkpoint's gate_up order read the other way round."""

    def _halves(self, gate_up, inter):
        return gate_up[:, inter:], gate_up[:, :inter]


class Int16Positions(VendorElementwise):
    """Vendor AL: RoPE positions loaded as int16 (positions past 32,767 wrap)."""

    def _angles(self, table, positions):
        return table[positions.to(torch.int16).long() % table.shape[0]].unsqueeze(1)


mutant("audit-ew-swapped-halves", "elementwise", "silu_mul reads (up, gate) instead of (gate, up)",
       ("test_elementwise",), elementwise=SwappedHalves)
mutant("audit-ew-int16-positions", "elementwise", "RoPE positions loaded as int16 (wrap past 32,767)",
       ("test_elementwise",), elementwise=Int16Positions)
