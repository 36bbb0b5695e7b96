"""Reference paged attention (pure torch): the numerical oracle of conformance.

One code path serves every attention state (prefill, prefill on a cached prefix / chunked prefill,
decode, mixtures): each request is a query range at absolute positions ``ctx .. seq_len - 1`` that
attends causally to KV positions ``0 .. pos``. Requests are gathered from the paged cache into padded
``[g, S, H_kv, D]`` tensors and computed with one batched matmul + masked softmax in float32 (float64
for float64 input). To bound memory, long queries are cut into tiles (a tile is itself a valid
"request" with a shorter seq_len, since causality never looks ahead) and tiles are batched in groups
whose padded score tensor stays under :data:`SCORE_BUDGET` elements.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hwkv.interfaces.attention import AttentionBackend, AttentionImpl
from hwkv.interfaces.kv_quant import is_quantized, quantize, v_token_view
from hwkv.interfaces.layout import KVLayoutKind

SCORE_BUDGET = 1 << 24  # elements of one group's padded score tensor (64 MiB in float32)


def split_kv(layer_kv: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(K, V)`` views ``[num_blocks, block_size, H_kv, D]`` of a PER_LAYER tensor or a SEPARATE_KV pair."""
    if isinstance(layer_kv, (tuple, list)):
        k, v = layer_kv
    else:
        if layer_kv.dim() != 5 or layer_kv.shape[1] != 2:
            raise ValueError(f"layer_kv must be [num_blocks, 2, block_size, H_kv, D], got {tuple(layer_kv.shape)}")
        k, v = layer_kv[:, 0], layer_kv[:, 1]
    if k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"K and V caches must both be [num_blocks, block_size, H_kv, D], got {tuple(k.shape)}, {tuple(v.shape)}"
        )
    return k, v


def write_kv(key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slot_mapping: torch.Tensor,
             scales: torch.Tensor | None = None) -> None:
    """Scatter ``key``/``value`` ``[T, H_kv, D]`` into the paged cache at ``slot_mapping``; -1 is skipped.
    A float8 cache stores them quantised with ``scales`` ``[2, H_kv]`` (K, V; default 1.0)."""
    k_cache, v_cache = split_kv(layer_kv)
    nb, bs = k_cache.shape[:2]
    n = slot_mapping.numel()
    if key.shape != value.shape or key.dim() != 3 or key.shape[0] < n or key.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"key/value must be [>= {n}, {k_cache.shape[2]}, {k_cache.shape[3]}] (one row per slot), "
            f"got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    if n == 0:
        return
    lo, hi = (int(x) for x in slot_mapping.aminmax())
    if hi >= nb * bs or lo < -1:
        bad = hi if hi >= nb * bs else lo
        raise ValueError(f"slot_mapping value {bad} out of range [-1, {nb * bs}) for {nb} blocks of {bs}")
    if hi < 0:  # every row padding
        return
    if lo >= 0:  # no padding: no masked copies of the rows (the common case)
        slots, k_new, v_new = slot_mapping.long(), key[:n], value[:n]
    else:
        keep = slot_mapping >= 0
        slots, k_new, v_new = slot_mapping[keep].long(), key[:n][keep], value[:n][keep]
    blk, off = slots // bs, slots % bs
    if is_quantized(k_cache.dtype):  # V pages stored [H_kv, D, block_size] (hwkv.interfaces.kv_quant)
        ks, vs = (scales[0], scales[1]) if scales is not None else (1.0, 1.0)
        k_cache[blk, off] = quantize(k_new, ks, k_cache.dtype)
        v_token_view(v_cache)[blk, off] = quantize(v_new, vs, v_cache.dtype)
        return
    k_cache[blk, off] = k_new.to(k_cache.dtype)
    v_cache[blk, off] = v_new.to(v_cache.dtype)


def _tiles(qsl: torch.Tensor, sl: torch.Tensor, tile: int) -> tuple[torch.Tensor, ...]:
    """Cut each request's query range into tiles of <= ``tile`` tokens.

    Returns per tile: request row, first query token, query length, KV tokens before it (ctx).
    """
    ql = qsl[1:] - qsl[:-1]
    n = (ql + tile - 1) // tile
    req = torch.repeat_interleave(torch.arange(ql.numel()), n)
    first = torch.cumsum(n, 0) - n
    start = (torch.arange(int(n.sum())) - first[req]) * tile
    tq = torch.minimum(ql[req] - start, torch.full_like(start, tile))
    return req, qsl[:-1][req] + start, tq, sl[req] - ql[req] + start


def _groups(tq: list[int], tsl: list[int], heads: int, budget: int) -> list[list[int]]:
    """Batch tiles, similar query lengths together, keeping padded score size under ``budget``."""
    order = sorted(range(len(tq)), key=lambda i: (-tq[i], -tsl[i]))
    groups: list[list[int]] = []
    cur: list[int] = []
    mq = ms = 0
    for i in order:
        nq, ns = max(mq, tq[i]), max(ms, tsl[i])
        if cur and (len(cur) + 1) * nq * ns * heads > budget:
            groups.append(cur)
            cur, nq, ns = [], tq[i], tsl[i]
        cur.append(i)
        mq, ms = nq, ns
    if cur:
        groups.append(cur)
    return groups


@dataclass(frozen=True)
class _Group:
    """One batch of tiles: everything about it that does not depend on the layer."""

    flat: torch.Tensor       # block ids to gather, [g * nblk]
    shape: tuple[int, ...]   # heads-first view of the gathered blocks, (H_kv, g, nblk * bs, D)
    slots: torch.Tensor      # [H_kv * g * S]: row (block, offset, head) of [num_blocks * bs * H_kv, D], heads-first
    blk_rows: torch.Tensor   # block * bs * H_kv of each: the extra rows of an interleaved [nb, 2, bs, H_kv, D] cache
    s_len: int
    q_len: int
    bad: tuple[torch.Tensor, torch.Tensor]  # (tile, slot) of unused KV slots, zeroed in V
    tok: torch.Tensor        # [g, Q] query rows (0 where padding)
    q_valid: torch.Tensor    # [g, Q]
    masked: torch.Tensor     # [1, g, 1, Q, S]: score entries set to -inf
    rows: torch.Tensor       # tok[q_valid]: output rows written
    qpos: torch.Tensor       # [g, Q, 1]: absolute position of each query row (sliding windows)


def _plan(t: int, h: int, k_cache: torch.Tensor, qsl: torch.Tensor, sl: torch.Tensor, block_tables: torch.Tensor,
          budget: int) -> list[_Group]:
    """Validate the metadata and cut it into groups (module docstring)."""
    nb, bs, hkv, d = k_cache.shape
    ql = qsl[1:] - qsl[:-1]
    if qsl.numel() != sl.numel() + 1 or int(qsl[0]) != 0 or int(qsl[-1]) > t or bool((ql < 0).any()):
        raise ValueError(f"query_start_loc {qsl.tolist()} must start at 0, be non-decreasing and end <= {t}")
    if bool((sl < ql).any()):
        raise ValueError(f"seq_lens {sl.tolist()} must be >= the query lengths {ql.tolist()}")
    if sl.numel() == 0 or int(qsl[-1]) == 0:
        return []
    need = (sl + bs - 1) // bs
    bt = block_tables.long()
    if bt.dim() != 2 or bt.shape[0] != sl.numel() or bt.shape[1] < int(need.max()):
        raise ValueError(f"block_tables {tuple(bt.shape)} must be [{sl.numel()}, >= {int(need.max())}]")
    used = bt[torch.arange(bt.shape[1], device=bt.device)[None] < need.to(bt.device)[:, None]]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= nb):
        raise ValueError(f"block_tables hold block ids outside [0, {nb})")
    dev = k_cache.device
    tile = max(1, budget // (h * int(sl.max())))
    req, tok0, tq, ctx = _tiles(qsl, sl, tile)
    groups = []
    for grp in _groups(tq.tolist(), (ctx + tq).tolist(), h, budget):
        gi = torch.tensor(grp)
        g, s_len, q_len = len(grp), int((ctx + tq)[gi].max()), int(tq[gi].max())
        g_req, g_tok0, g_q, g_ctx = (x[gi].to(dev) for x in (req, tok0, tq, ctx))
        g_sl = g_ctx + g_q
        nblk = (s_len + bs - 1) // bs
        blocks = bt[g_req, :nblk]
        blocks = torch.where(torch.arange(nblk, device=dev)[None] * bs < g_sl[:, None], blocks, 0)
        s = torch.arange(s_len, device=dev)
        kv_valid = s[None] < g_sl[:, None]  # [g, S]
        j = torch.arange(q_len, device=dev)
        q_valid = j[None] < g_q[:, None]  # [g, Q]
        tok = torch.where(q_valid, g_tok0[:, None] + j, 0)
        allowed = (s[None, None] <= (g_ctx[:, None] + j)[:, :, None]) & kv_valid[:, None]  # [g, Q, S]
        blk = blocks[:, s // bs]  # [g, S]
        heads = torch.arange(hkv, device=dev)[:, None, None]
        slots = ((blk * bs + s % bs)[None] * hkv + heads).reshape(-1)
        blk_rows = (blk[None] * (bs * hkv)).expand(hkv, g, s_len).reshape(-1)
        groups.append(_Group(blocks.reshape(-1), (hkv, g, nblk * bs, d), slots, blk_rows, s_len, q_len,
                             torch.nonzero(~kv_valid, as_tuple=True), tok, q_valid, ~allowed[None, :, None],
                             tok[q_valid], (g_ctx[:, None] + j)[:, :, None]))
    return groups


# The last plan and what it was made from: the layers of a step share their metadata, so only the
# first layer plans (the content is compared, never object identity: buffers are reused in place).
_last_plan: tuple[tuple[Any, ...], list[_Group]] | None = None


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    for x, y in zip(a, b):
        if isinstance(x, torch.Tensor):
            if not (isinstance(y, torch.Tensor) and x.shape == y.shape and x.device == y.device
                    and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def paged_attention(
    query: torch.Tensor,
    layer_kv: Any,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_tables: torch.Tensor,
    scale: float,
    budget: int | None = None,
    kv_scales: torch.Tensor | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal GQA attention of ``query`` ``[T, H, D]`` over a paged cache (see module docstring).
    A float8 cache is dequantised with ``kv_scales`` ``[2, H_kv]`` (K, V; default 1.0) in float32.
    ``window`` / ``softcap`` / ``sinks`` ``[H]`` as :class:`hwkv.interfaces.attention.AttentionImpl`'s.

    ``query_start_loc`` ``[R+1]`` and ``seq_lens`` ``[R]`` as in AttentionMetadata (host copies
    preferred); rows of ``query`` past ``query_start_loc[-1]`` (padding) come back zero.
    Returns ``[T, H, D]`` in ``query``'s dtype.
    """
    global _last_plan
    k_cache, v_cache = split_kv(layer_kv)
    nb, bs, hkv, d = k_cache.shape
    if query.dim() != 3 or query.shape[2] != d or query.shape[1] % hkv:
        raise ValueError(f"query must be [T, H, {d}] with H a multiple of H_kv={hkv}, got {tuple(query.shape)}")
    t, h = query.shape[:2]
    qsl, sl = query_start_loc.to("cpu", torch.long), seq_lens.to("cpu", torch.long)
    budget = budget or SCORE_BUDGET
    key = (t, h, tuple(k_cache.shape), k_cache.device, budget, qsl, sl, block_tables)
    if _last_plan is not None and _same(key, _last_plan[0]):
        plan = _last_plan[1]
    else:
        plan = _plan(t, h, k_cache, qsl, sl, block_tables, budget)
        _last_plan = (key[:5] + (qsl.clone(), sl.clone(), block_tables.clone()), plan)
    out = torch.zeros_like(query)
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    dev = k_cache.device
    group = h // hkv
    interleaved = isinstance(layer_kv, torch.Tensor)
    if is_quantized(k_cache.dtype):  # V pages stored transposed: gather whole blocks through the token view
        v_cache = v_token_view(v_cache)
        rows = v_rows = None
    elif interleaved:
        rows = layer_kv.view(-1, d) if layer_kv.is_contiguous() else None
        v_rows = None
    elif k_cache.is_contiguous() and v_cache.is_contiguous():
        rows, v_rows = k_cache.view(-1, d), v_cache.view(-1, d)
    else:
        rows = v_rows = None
    for p in plan:
        g, q_len, s_len = p.shape[1], p.q_len, p.s_len
        # One gather straight into the heads-first layout [H_kv, g, S, D] of the batched matmuls,
        # rows of the cache viewed as [rows, D] (cost ~ the slots read, never the pool); other
        # layouts gather whole blocks, then lay them out (an index_select on a permuted or strided
        # view of the cache would copy the whole layer).
        if rows is not None:
            k = rows[p.slots + p.blk_rows if interleaved else p.slots].view(hkv, g, s_len, d).to(acc)
            v = (rows[p.slots + p.blk_rows + bs * hkv] if interleaved else v_rows[p.slots]).view(hkv, g, s_len, d)
            v = v.to(acc)
        else:
            k = _heads_first(k_cache, p.flat, p.shape)[:, :, :s_len].to(acc)
            v = _heads_first(v_cache, p.flat, p.shape)[:, :, :s_len].to(acc)
        if is_quantized(k_cache.dtype) and kv_scales is not None:  # [H_kv, g, S, D] times per-head scales
            k = k * kv_scales[0].to(dev, acc)[:, None, None, None]
            v = v * kv_scales[1].to(dev, acc)[:, None, None, None]
        v[:, p.bad[0], p.bad[1]] = 0  # unused slots may hold NaN: keep 0 * NaN out of the output
        q = (query[p.tok].to(acc) * scale).view(g, q_len, hkv, group, d).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q.reshape(hkv, g, group * q_len, d), k.transpose(-1, -2))
        scores = scores.view(hkv, g, group, q_len, s_len)
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.masked_fill_(p.masked, float("-inf"))
        if window is not None:  # a query at p sees keys in (p - window, p]
            out_of_window = torch.arange(s_len, device=dev)[None, None] <= p.qpos - window  # [g, Q, S]
            scores = scores.masked_fill_(out_of_window[None, :, None], float("-inf"))
        if sinks is not None:  # one extra logit per head in the denominator, dropped afterwards
            sink = sinks.to(dev, acc).view(hkv, 1, group, 1, 1).expand(hkv, g, group, q_len, 1)
            probs = torch.cat([scores, sink], -1).softmax(-1)[..., :s_len]
        else:
            probs = scores.softmax(-1)
        o = torch.matmul(probs.reshape(hkv, g, group * q_len, s_len), v)
        o = o.view(hkv, g, group, q_len, d).permute(1, 3, 0, 2, 4).reshape(g, q_len, h, d)
        out[p.rows] = o[p.q_valid].to(out.dtype)
    return out


def _heads_first(cache: torch.Tensor, blocks: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """``cache[blocks]`` ``[n, bs, H_kv, D]`` as a contiguous ``[H_kv, n, bs, D]``, viewed as ``shape``."""
    return cache[blocks].permute(2, 0, 1, 3).contiguous().view(shape)


class ReferenceAttentionImpl(AttentionImpl):
    """Pure-torch paged attention for one geometry; KV layout PER_LAYER (a SEPARATE_KV pair also works)."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, slot_mapping: torch.Tensor) -> None:
        self._check_cache(layer_kv)
        write_kv(key, value, layer_kv, slot_mapping, self._scales(layer_kv))

    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer_kv: Any, metadata: Any
    ) -> torch.Tensor:
        bs = self._check_cache(layer_kv)
        if query.dim() != 3 or tuple(query.shape[1:]) != (self.num_heads, self.head_size):
            raise ValueError(f"query must be [T, {self.num_heads}, {self.head_size}], got {tuple(query.shape)}")
        if metadata.block_size != bs:
            raise ValueError(f"metadata.block_size {metadata.block_size} != KV cache block size {bs}")
        return paged_attention(
            query, layer_kv, metadata.query_start_loc_cpu, metadata.seq_lens_cpu, metadata.block_tables, self.scale,
            kv_scales=self._scales(layer_kv), window=self.window, softcap=self.softcap, sinks=self.sinks,
        )

    def _scales(self, layer_kv: Any) -> torch.Tensor | None:
        return self.scales_for(layer_kv) if is_quantized(split_kv(layer_kv)[0].dtype) else None

    def _check_cache(self, layer_kv: Any) -> int:
        k_cache, _ = split_kv(layer_kv)
        if tuple(k_cache.shape[2:]) != (self.num_kv_heads, self.head_size):
            raise ValueError(
                f"KV cache heads/head_size {tuple(k_cache.shape[2:])} != ({self.num_kv_heads}, {self.head_size})"
            )
        return int(k_cache.shape[1])


class ReferenceAttentionBackend(AttentionBackend):
    name = "reference"
    kv_layout = KVLayoutKind.PER_LAYER

    def make_impl(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float) -> ReferenceAttentionImpl:
        return ReferenceAttentionImpl(num_heads, head_size, num_kv_heads, scale)
