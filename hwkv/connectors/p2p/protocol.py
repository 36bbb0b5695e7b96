"""The p2p connector's wire protocol: side-channel messages (msgspec, never pickle), the KV layout
each side advertises at handshake, the compatibility check, and the byte segments that move a
token range of KV from one side's blocks to the other's.

A layout is described by what a peer needs to address its memory remotely: the base address and
per-block byte size of every KV tensor, the layout kind (which tensor and offset hold K or V of a
layer), block size, head count/size, dtype, and the tensor-parallel rank, size, the model's KV
heads and the sender's first head: engines with different tensor-parallel sizes (one dividing the
other) move KV by head ranges (:func:`read_plan`, :mod:`hwkv.parallel.kv_mapping`), each head slice
turned into byte ranges with the layout's head stride (:func:`pair_segments`).
Within a block, each (layer, K|V) unit is token-major ``[block_size, H_kv, D]`` in every layout,
so any two layouts with equal heads, head size and dtype translate token run by token run; runs
contiguous on both sides (consecutive blocks, adjacent K/V halves) are merged into one segment.

KV-cache groups (a hybrid model, docs/hybrid-models.md): a layout lists its groups (:class:`KVGroup`:
window, layers, blocks, tensors); each group is its own KV cache with its own block ids, so a
request's blocks are one list per group (:func:`kv_segments`), and a window group moves only the
blocks the consumer's next query sees (:func:`window_start`). Both sides must group alike
(:func:`group_mismatch`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from hwkv.parallel.kv_mapping import HeadSlice, kv_heads_of, map_kv_heads

PER_LAYER, SEPARATE_KV, CROSS_LAYER = "per_layer", "separate_kv", "cross_layer"
READ_PIECES = 4  # a load is copied in at most this many parts, in token order (a failed part keeps those before)


class KVGroup(msgspec.Struct, frozen=True, array_like=True):
    """One KV-cache group of a layout: ``window`` 0 is full attention; ``layers`` the model's layers
    it holds (in its tensors' order); ``num_blocks`` its pool (a window group's block 0 is its null
    block); ``tensors`` how many of the layout's ``bases`` are its (they follow the groups before it)."""

    window: int
    layers: list[int]
    num_blocks: int
    tensors: int


class Layout(msgspec.Struct, frozen=True):
    engine_id: str
    endpoint: str  # the Transfer endpoint peers read from / write to
    protocol: str
    layout: str
    num_layers: int
    block_size: int
    num_blocks: int
    num_kv_heads: int  # heads in this rank's blocks
    head_size: int
    dtype: str  # KVCache.format_key(): the storage dtype, and for fp8 KV a digest of the scales
    bases: list[int]  # data pointer of every KV tensor (registered with the Transfer)
    block_nbytes: list[int]  # bytes of one block in each tensor
    tp_rank: int = 0
    tp_size: int = 1
    head_start: int = 0  # global index of this rank's first KV head
    total_kv_heads: int = 0  # the model's KV heads (0: num_kv_heads * tp_size, no replication)
    side_channel: str = ""  # this rank's side channel host:port ("" where it serves none)
    host_id: str = ""  # hwkv.transfer.direct.host_identity(): same-host (device-direct) protocols need equal ids
    groups: list[KVGroup] = []  # KV-cache groups ([]: one cache of every layer)

    @property
    def total_heads(self) -> int:
        return self.total_kv_heads or self.num_kv_heads * self.tp_size

    def group(self, g: int) -> Layout:
        """Group ``g``'s own layout (its layers, blocks and tensors), as an ungrouped cache's."""
        grp, t0 = self.groups[g], sum(x.tensors for x in self.groups[:g])
        return msgspec.structs.replace(self, num_layers=len(grp.layers), num_blocks=grp.num_blocks,
                                       bases=self.bases[t0:t0 + grp.tensors],
                                       block_nbytes=self.block_nbytes[t0:t0 + grp.tensors], groups=[])


# ---- side-channel messages (requests get exactly one reply) ----------------------------------
class Hello(msgspec.Struct, tag=True):
    """Handshake: the sender's layout (its preferred protocol) and ``alternatives`` (its layouts
    for the other protocols it offers, in preference order); the reply carries the receiver's, or
    why they cannot pair."""

    layout: Layout
    alternatives: list[Layout] = []


class HelloReply(msgspec.Struct, tag=True):
    layout: Layout | None
    reason: str = ""
    layouts: list[Layout] = []  # every tensor-parallel rank's, in rank order (empty: ``[layout]``)
    alternatives: list[Layout] = []  # the receiver's layouts for its other protocols (tensor-parallel size 1)
    unusable: dict[str, str] = {}  # protocol -> why the receiver cannot use it with the sender (push: it copies)


class Acquire(msgspec.Struct, tag=True):
    """Pull mode: consumer rank ``reader`` (of ``readers``, its tensor-parallel size) is about to
    read ``request_id``'s blocks; the producer keeps them for the read (its hold timeout restarts)
    or says they are gone."""

    request_id: str
    reader: int = 0
    readers: int = 1
    protocol: str = ""  # the protocol the reader uses ("tcp" from device memory: the producer stages first)


class Release(msgspec.Struct, tag=True):
    """Pull mode: consumer rank ``reader``'s read ended (``ok`` or not): once all ``readers`` did,
    the producer may free the blocks."""

    request_id: str
    ok: bool
    reader: int = 0
    readers: int = 1


class PushRequest(msgspec.Struct, tag=True):
    """Push mode: the consumer allocated ``block_ids`` for tokens ``[start, end)`` of the producer's
    ``request_id``; the producer writes them and sends :class:`PushDone` to ``notify``."""

    request_id: str
    consumer_engine_id: str
    consumer_request_id: str
    block_ids: list[int]
    start: int
    end: int
    notify: str  # the consumer's side-channel address host:port
    digest: str = ""  # consumer first (request_id is a transfer id): the prompt the producer must match
    reader: int = 0  # the consumer rank asking (tensor parallelism: every rank asks for its heads)
    readers: int = 1  # the consumer's tensor-parallel size
    protocol: str = ""  # the protocol chosen at the handshake ("": the producer's first)
    group_block_ids: list[list[int]] = []  # KV-cache groups 1.. (block_ids is group 0's)

    @property
    def all_block_ids(self) -> list[list[int]]:
        return [self.block_ids, *self.group_block_ids]


class PushDone(msgspec.Struct, tag=True):
    request_id: str  # the consumer's
    ok: bool
    reason: str = ""
    nbytes: int = 0
    settled: bool = True  # False: a timed-out write may still land (the consumer keeps its blocks pinned)
    valid: int = 0  # not ok: the consumer's first tokens that did land (0: none beyond its local hit)


class PushOrder(msgspec.Struct, tag=True):
    """Tensor-parallel push, producer driver → producer rank: write ``slices`` (``HeadSlice`` fields)
    of blocks ``src_block_ids`` into consumer rank ``consumer``'s blocks for ``push``, then send
    :class:`PushPart` to ``reply_to`` under ``key``."""

    key: str
    push: PushRequest
    consumer: Layout
    src_block_ids: list[list[int]]  # one list per KV-cache group
    slices: list[tuple[int, int, int, int, int]]
    reply_to: str


class PushPart(msgspec.Struct, tag=True):
    """A producer rank's writes of one :class:`PushOrder` ended."""

    key: str
    rank: int
    ok: bool
    reason: str = ""
    nbytes: int = 0
    settled: bool = True
    valid: int = 0  # not ok: the tokens before the part of the write that failed (its parts are in token order)


class Ack(msgspec.Struct, tag=True):
    ok: bool
    reason: str = ""
    retry: bool = False  # not yet (e.g. the producer's ranks are still staging the KV): ask again


Message = Hello | HelloReply | Acquire | Release | PushRequest | PushDone | PushOrder | PushPart | Ack
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Any) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Any:
    return _decoder.decode(data)


def prompt_digest(token_ids: list[int], salt: str | None) -> str:
    """What the consumer checks before trusting remote KV: same tokens (and salt) as the producer's."""
    h = hashlib.sha256(repr(salt).encode())
    h.update(msgspec.msgpack.encode(list(token_ids)))
    return h.hexdigest()[:32]


def layout_of(kv_cache: Any, engine_id: str, endpoint: str, protocol: str, bases: list[int] | None = None,
              tp_rank: int = 0, tp_size: int = 1, total_kv_heads: int | None = None, side_channel: str = "",
              host_id: str = "") -> Layout:
    """The layout of a :class:`~hwkv.interfaces.layout.KVCache`, or of a
    :class:`~hwkv.engine.kv_groups.GroupedKVCache` (one cache per KV-cache group: its ``groups``)."""
    spec = kv_cache.spec
    total = total_kv_heads or spec.num_kv_heads * tp_size
    caches = getattr(kv_cache, "caches", None)
    groups, dtype, nbytes = [], kv_cache.format_key(), None
    if caches is not None:
        groups = [KVGroup(g.window or 0, list(g.layers), c.spec.num_blocks, len(c.tensors))
                  for g, c in zip(kv_cache.groups, caches)]
        dtype = ",".join(dict.fromkeys(c.format_key() for c in caches))  # fp8: each group's scales
        nbytes = [c.block_nbytes(i) for c in caches for i in range(len(c.tensors))]
    return Layout(
        engine_id=engine_id, endpoint=endpoint, protocol=protocol, layout=kv_cache.layout.value,
        num_layers=spec.num_layers, block_size=spec.block_size, num_blocks=spec.num_blocks,
        num_kv_heads=spec.num_kv_heads, head_size=spec.head_size, dtype=dtype,
        bases=bases if bases is not None else [t.data_ptr() for t in kv_cache.tensors],
        block_nbytes=nbytes or [kv_cache.block_nbytes(i) for i in range(len(kv_cache.tensors))],
        tp_rank=tp_rank, tp_size=tp_size, head_start=kv_heads_of(total, tp_size, tp_rank).start,
        total_kv_heads=total, side_channel=side_channel, host_id=host_id, groups=groups,
    )


def describe_groups(lay: Layout) -> str:
    """``lay``'s KV-cache groups in words (for refusals)."""
    if not lay.groups:
        return "one KV-cache group of every layer"
    return "KV-cache groups " + "; ".join(
        f"{'full' if g.window == 0 else f'window {g.window}'}: layers {','.join(map(str, g.layers))}"
        for g in lay.groups)


def group_mismatch(mine: Layout, theirs: Layout) -> str:
    """Why the two engines' KV-cache groups cannot exchange blocks ("" when they group alike: the same
    kinds and windows over the same layers). Block sizes may differ (token runs translate)."""
    a = [(g.window, list(g.layers)) for g in mine.groups]
    b = [(g.window, list(g.layers)) for g in theirs.groups]
    if a == b:
        return ""
    return (f"the KV-cache groups differ: {describe_groups(mine)} at engine {mine.engine_id}, "
            f"{describe_groups(theirs)} at engine {theirs.engine_id} (allowed: the same model and the same "
            "kv_cache_groups setting on both sides)")


def incompatibility(mine: Layout, theirs: Layout) -> str:
    """Why KV cannot move between the two layouts ("" when it can). Different tensor-parallel sizes
    translate by KV-head ranges (:func:`read_plan`) where one size divides the other."""
    for what in ("protocol", "num_layers", "head_size", "dtype"):
        a, b = getattr(mine, what), getattr(theirs, what)
        if a != b:
            return f"{what} differs: {a!r} at engine {mine.engine_id}, {b!r} at engine {theirs.engine_id}"
    why = group_mismatch(mine, theirs)
    if why:
        return why
    if _v_pages(mine) and mine.block_size != theirs.block_size:
        return (f"block sizes differ ({mine.block_size} at engine {mine.engine_id}, {theirs.block_size} at engine "
                f"{theirs.engine_id}) and an fp8 cache's V pages are [H_kv, D, block_size] (whole pages move; allowed: "
                "the same block size)")
    if mine.total_heads != theirs.total_heads:
        return (f"the models' KV heads differ: {mine.total_heads} at engine {mine.engine_id}, {theirs.total_heads} "
                f"at engine {theirs.engine_id}")
    p, d = mine.tp_size, theirs.tp_size
    if p % d and d % p:
        return (f"tensor-parallel sizes tp={p} (engine {mine.engine_id}) and tp={d} (engine {theirs.engine_id}) "
                "cannot be mapped by KV-head ranges (allowed: one divides the other)")
    for lay in (mine, theirs):
        try:
            heads = kv_heads_of(lay.total_heads, lay.tp_size, lay.tp_rank)
        except ValueError as e:
            return f"engine {lay.engine_id}: {e}"
        if (lay.head_start, lay.num_kv_heads) != (heads.start, len(heads)):
            return (f"engine {lay.engine_id} rank {lay.tp_rank} holds KV heads from {lay.head_start} "
                    f"({lay.num_kv_heads} per block), not the [{heads.start}, {heads.stop}) its tp={lay.tp_size} "
                    "split gives")
        if lay.layout not in (PER_LAYER, SEPARATE_KV, CROSS_LAYER):
            return f"KV layout {lay.layout!r} of engine {lay.engine_id} is unknown (allowed: per_layer, " \
                   "separate_kv, cross_layer)"
    return ""


def read_plan(producers: list[Layout], consumer: Layout) -> list[tuple[Layout, HeadSlice]]:
    """Which producer rank's heads fill which of ``consumer``'s (one rank of the consumer engine):
    ``(producer rank's layout, head slice)`` from :func:`hwkv.parallel.kv_mapping.map_kv_heads`; equal
    splits give one whole-block slice from the same rank."""
    if not producers or any(p.tp_size != len(producers) for p in producers):
        raise ValueError(f"the producer described {len(producers)} rank layouts for tp="
                         f"{producers[0].tp_size if producers else '?'}")
    slices = map_kv_heads(consumer.total_heads, len(producers), consumer.tp_size)
    return [(producers[s.src_rank], s) for s in slices if s.dst_rank == consumer.tp_rank]


def write_plan(producers: list[Layout], consumer: Layout) -> dict[int, list[HeadSlice]]:
    """Push: the head slices each producer rank writes into ``consumer`` (one consumer rank), by
    producer rank (the same slices :func:`read_plan` reads)."""
    out: dict[int, list[HeadSlice]] = {}
    for peer, sl in read_plan(producers, consumer):
        out.setdefault(peer.tp_rank, []).append(sl)
    return out


def _unit(lay: Layout, layer: int, kv: int, block: int) -> int:
    """Address of the ``[block_size, H, D]`` K (kv=0) or V (kv=1) unit of ``layer`` in ``block``."""
    unit = lay.block_size * lay.num_kv_heads * lay.head_size * _elem(lay)
    if lay.layout == PER_LAYER:
        return lay.bases[layer] + block * lay.block_nbytes[layer] + kv * unit
    if lay.layout == SEPARATE_KV:
        t = 2 * layer + kv
        return lay.bases[t] + block * lay.block_nbytes[t]
    return lay.bases[0] + block * lay.block_nbytes[0] + (2 * layer + kv) * unit


def _v_pages(lay: Layout) -> bool:
    """The layout's V units are stored ``[H_kv, D, block_size]`` (an fp8 cache, :mod:`hwkv.interfaces.kv_quant`;
    its format key carries ``-vt-``), not token-major."""
    return "-vt-" in lay.dtype


def _elem(lay: Layout) -> int:
    unit_bytes = lay.block_nbytes[0] // (lay.block_size * lay.num_kv_heads * lay.head_size)
    return unit_bytes // {PER_LAYER: 2, SEPARATE_KV: 1, CROSS_LAYER: 2 * lay.num_layers}[lay.layout]


def pair_segments(src: Layout, dst: Layout, src_blocks: list[int], dst_blocks: list[int], start: int, end: int,
                  layers: Sequence[int] | None = None, heads: HeadSlice | None = None, last: int | None = None
                  ) -> tuple[list[int], list[int], list[int]]:
    """``(src_ptrs, dst_ptrs, lengths)`` moving the KV of tokens ``[start, end)`` (positions in the
    request; ``src_blocks``/``dst_blocks`` are each side's block ids of the request in order) of
    ``layers`` (default: all), merging ranges contiguous on both sides.

    ``heads`` (heterogeneous tensor parallelism, a :func:`hwkv.parallel.kv_mapping.map_kv_heads`
    slice): only those heads, from their index in the source's blocks to theirs in the
    destination's; each token is then its own range unless the slice spans both sides' heads.

    An fp8 cache's V pages (``[H_kv, D, block_size]``, :mod:`hwkv.interfaces.kv_quant`) move whole: each
    block's page with the run holding its last token before ``last`` (the whole load's end; default ``end``),
    so a load cut into runs (parts, chunked layerwise writes) moves every page once, after all its tokens exist.

    Vectorized (numpy): an 8k-token prompt of a 32-layer model in 16-token blocks is ~32k pieces,
    which a Python loop took tens of milliseconds to list — more than the NVLink copy itself."""
    layers = range(src.num_layers) if layers is None else layers
    h_src, h_dst, nh = (0, 0, src.num_kv_heads) if heads is None else heads[2:5]
    if heads is None and src.num_kv_heads != dst.num_kv_heads:
        raise ValueError(f"{src.num_kv_heads} KV heads per block at the source, {dst.num_kv_heads} at the "
                         "destination: give the head slice to move")
    if end <= start:
        return [], [], []
    need_s, need_d = -(-end // src.block_size), -(-end // dst.block_size)
    if len(src_blocks) < need_s or len(dst_blocks) < need_d:
        raise ValueError(f"tokens [{start}, {end}) need {need_s} source and {need_d} destination blocks, "
                         f"got {len(src_blocks)} and {len(dst_blocks)}")
    head = src.head_size * _elem(src)
    s_tok, d_tok = src.num_kv_heads * head, dst.num_kv_heads * head
    # token runs: [start, end) cut at every block boundary of either side
    cuts = np.unique(np.concatenate((
        [start, end], np.arange(-(-start // src.block_size) * src.block_size, end, src.block_size),
        np.arange(-(-start // dst.block_size) * dst.block_size, end, dst.block_size))).astype(np.int64))
    t, n = cuts[:-1], np.diff(cuts)
    sb, so = np.divmod(t, src.block_size)
    db, do = np.divmod(t, dst.block_size)
    s_off = np.asarray(src_blocks, np.int64)[sb], so * s_tok + h_src * head
    d_off = np.asarray(dst_blocks, np.int64)[db], do * d_tok + h_dst * head
    su, ss = _units(src, layers)
    du, ds = _units(dst, layers)
    pages = _v_pages(src)
    if pages:  # V units hold [H_kv, D, block_size] pages: whole pages of every block the tokens touch, below
        if src.block_size != dst.block_size:
            raise ValueError(f"fp8 V pages move whole: block sizes {src.block_size} and {dst.block_size} differ")
        vu = (su[1::2], ss[1::2], du[1::2], ds[1::2])
        su, ss, du, ds = su[0::2], ss[0::2], du[0::2], ds[0::2]
    # [unit, run] addresses: unit base + block * block stride + offset in the block
    s0 = (su[:, None] + ss[:, None] * s_off[0][None, :] + s_off[1][None, :]).ravel()
    d0 = (du[:, None] + ds[:, None] * d_off[0][None, :] + d_off[1][None, :]).ravel()
    runs = np.broadcast_to(n, (len(su), len(n))).ravel()
    if nh == src.num_kv_heads == dst.num_kv_heads:  # token runs are contiguous on both sides
        ln = runs * s_tok
    else:  # a head slice: one piece per token
        tok = np.arange(int(runs.sum()), dtype=np.int64) - np.repeat(np.cumsum(runs) - runs, runs)
        s0, d0 = np.repeat(s0, runs) + tok * s_tok, np.repeat(d0, runs) + tok * d_tok
        ln = np.full(len(s0), nh * head, np.int64)
    if pages:
        # a head's V page is head * block_size contiguous bytes: the slice's heads are one piece per block. The
        # first and last blocks' tokens outside [start, end) move too: at the destination those positions are
        # either this request's own earlier tokens (the same prompt, already there) or not yet written
        page, bs = head * src.block_size, src.block_size
        blk = np.arange(start // bs, -(-end // bs))
        blk = blk[(np.minimum((blk + 1) * bs, max(end, last or end)) - 1 < end) & ((blk + 1) * bs > start)]
        sb_v, db_v = np.asarray(src_blocks, np.int64)[blk], np.asarray(dst_blocks, np.int64)[blk]
        s0 = np.concatenate((s0, (vu[0][:, None] + vu[1][:, None] * sb_v[None, :]).ravel() + h_src * page))
        d0 = np.concatenate((d0, (vu[2][:, None] + vu[3][:, None] * db_v[None, :]).ravel() + h_dst * page))
        ln = np.concatenate((ln, np.full(len(vu[0]) * len(blk), nh * page, np.int64)))
    order = np.argsort(s0, kind="stable")  # source address order: runs contiguous on both sides become neighbours
    s0, d0, ln = s0[order], d0[order], ln[order]
    joins = (s0[1:] == s0[:-1] + ln[:-1]) & (d0[1:] == d0[:-1] + ln[:-1])
    first = np.flatnonzero(np.concatenate(([True], ~joins)))
    return s0[first].tolist(), d0[first].tolist(), np.add.reduceat(ln, first).tolist()


def window_start(end: int, window: int, block_size: int) -> int:
    """First token a window group moves for a load ending at ``end``: the start of the block holding
    the oldest key the query at ``end`` sees (``end - window + 1``), so every block the consumer
    registers in its prefix cache is whole."""
    return max(0, end - window + 1) // block_size * block_size


def read_pieces(start: int, end: int, block_size: int, pieces: int = READ_PIECES,
                min_tokens: int = 1) -> list[tuple[int, int]]:
    """``[start, end)`` as up to ``pieces`` token ranges in order, every boundary between two on a block
    boundary, each but the last at least ``min_tokens`` long (rounded up to blocks): a load copies them
    one after another, so when one fails every token before it has landed (in every group and head
    slice) and stays - whole blocks - in the prefix cache."""
    first, last = start // block_size + 1, -(-end // block_size)  # block boundaries strictly inside
    step = max(1, -(-(last - first + 1) // pieces), -(-min_tokens // block_size))
    cuts = [b * block_size for b in range(first + step - 1, last, step)]
    bounds = [start, *cuts, end]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]


def kv_segments(src: Layout, dst: Layout, src_blocks: list[list[int]], dst_blocks: list[list[int]], start: int,
                end: int, load_end: int | None = None, layers: Sequence[int] | None = None,
                heads: HeadSlice | None = None) -> tuple[list[int], list[int], list[int]]:
    """:func:`pair_segments` over every KV-cache group: ``src_blocks``/``dst_blocks`` are each side's
    block ids of the request, one list per group (one list without groups). A window group moves only
    tokens from :func:`window_start` of ``load_end`` (the load's end; default ``end``) in ``dst``'s
    (the consumer's) blocks; a block it needs that the source no longer holds (its null block, id 0)
    is an error. ``layers``: the model's layers (a layerwise write: the one its group holds)."""
    if not src.groups:
        return pair_segments(src, dst, src_blocks[0], dst_blocks[0], start, end, layers, heads, load_end)
    if len(src_blocks) != len(src.groups) or len(dst_blocks) != len(src.groups):
        raise ValueError(f"block ids for {len(src_blocks)} and {len(dst_blocks)} KV-cache groups, the layout has "
                         f"{len(src.groups)}")
    out: tuple[list[int], list[int], list[int]] = ([], [], [])
    for g, grp in enumerate(src.groups):
        lo = start
        if grp.window:
            lo = max(start, window_start(end if load_end is None else load_end, grp.window, dst.block_size))
        if lo >= end:
            continue
        mine = [j for j, layer in enumerate(grp.layers) if layers is None or layer in layers]
        if not mine:
            continue
        if grp.window:
            for lay, ids in ((src, src_blocks[g]), (dst, dst_blocks[g])):
                need = ids[lo // lay.block_size:-(-end // lay.block_size)]
                if 0 in need:
                    raise ValueError(f"engine {lay.engine_id} no longer holds window-{grp.window} group blocks of "
                                     f"tokens [{lo}, {end}) (they left the window)")
        seg = pair_segments(src.group(g), dst.group(g), src_blocks[g], dst_blocks[g], lo, end, mine, heads, load_end)
        for acc, part in zip(out, seg):
            acc += part
    return out


def _units(lay: Layout, layers: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per (layer, K|V) in ``layers`` (K then V per layer): the address of the unit in block 0 and
    the byte stride from one block to the next (:func:`_unit` for every block at once)."""
    base = np.asarray([_unit(lay, layer, kv, 0) for layer in layers for kv in (0, 1)], np.int64)
    if lay.layout == PER_LAYER:
        stride = [lay.block_nbytes[layer] for layer in layers for _ in (0, 1)]
    elif lay.layout == SEPARATE_KV:
        stride = [lay.block_nbytes[2 * layer + kv] for layer in layers for kv in (0, 1)]
    else:
        stride = [lay.block_nbytes[0]] * (2 * len(layers))
    return base, np.asarray(stride, np.int64)


def push_refusal(msg: Any, prompt: list[int], salt: str | None, n: int) -> str:
    """Why a push of tokens ``[msg.start, msg.end)`` cannot be served from a prefill of ``n`` tokens
    of ``prompt`` ("" when it can)."""
    if msg.end > n or msg.start < 0:
        return f"tokens [{msg.start}, {msg.end}) are outside the prefilled {n}"
    if msg.digest and prompt_digest(prompt[:msg.end], salt) != msg.digest:
        return "the prompt (or cache_salt) differs from the one the producer prefilled"
    return ""
