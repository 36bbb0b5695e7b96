"""The p2p producer's push writes, split over its tensor-parallel ranks.

A consumer rank's :class:`~hwkv.connectors.p2p.protocol.PushRequest` reaches the producer's driver,
which holds the blocks. The head slices that consumer rank needs
(:func:`~hwkv.connectors.p2p.protocol.write_plan`) are written by the producer ranks that hold
them: the driver's own slices in its transfer threads, every other rank's through a
:class:`~hwkv.connectors.p2p.protocol.PushOrder` to that rank's side channel, which writes from its
KV shard and answers with a :class:`~hwkv.connectors.p2p.protocol.PushPart`. Once every part ended
the driver sends the consumer rank ``PushDone`` (ok only if every part was); the blocks are freed
once every consumer rank was answered (or the hold expires). With one rank on each side this is
the single whole-block write of the untensor-parallel push.

A mixin of :class:`~hwkv.connectors.p2p.worker.P2PWorker`, whose ``__init__`` declares the state it uses.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

from hwkv.connectors.p2p.channel import call
from hwkv.connectors.p2p.protocol import (
    Ack,
    Layout,
    PushOrder,
    PushPart,
    PushRequest,
    kv_segments,
    push_refusal,
    read_pieces,
    write_plan,
)
from hwkv.interfaces.transfer import TransferTimeout
from hwkv.parallel.kv_mapping import HeadSlice


@dataclass
class _Parts:
    """One consumer rank's push, until every producer rank's part ended."""

    msg: PushRequest
    rid: str
    pending: set[int]
    ok: bool = True
    why: str = ""
    nbytes: int = 0
    settled: bool = True
    valid: int = -1  # the smallest failed part's valid tokens (-1: no part failed)
    t0: float = field(default_factory=time.monotonic)


class Pusher:
    def _push(self, msg: PushRequest, h: Any, peer: Layout) -> None:
        """Driver: split the push into its producer ranks' parts and start them."""
        why = push_refusal(msg, *h.digest_of, h.num_tokens)
        try:
            plan = {} if why else write_plan(self.state.rank_layouts, peer)
            if not why:
                self.stage_for(peer.protocol, h)  # a tcp consumer while the pool's own protocol is device-direct
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        if why or not plan:
            self._notify(msg, False, why or "no KV heads to write", 0, h.rid)
            return
        key = f"{h.rid}/{msg.reader}"
        with self.state.lock:
            self._parts[key] = _Parts(msg, h.rid, set(plan))
        for rank, slices in sorted(plan.items()):
            if rank == self.tp_rank:
                self._part_done(PushPart(key, rank, *self._write(peer, h.all_block_ids, msg, slices, h.deadline)))
                continue
            order = PushOrder(key, msg, peer, h.all_block_ids, [tuple(s) for s in slices], self.channel.address)
            try:
                ack = call(self.state.rank_layouts[rank].side_channel, order, self.config.transfer_timeout_s)
                if not (isinstance(ack, Ack) and ack.ok):
                    raise RuntimeError(getattr(ack, "reason", "refused"))
            except Exception as e:
                self._part_done(PushPart(key, rank, False, f"rank {rank}: {type(e).__name__}: {e}"))

    def _write(self, peer: Layout, src_blocks: list[list[int]], msg: PushRequest, slices: list[HeadSlice],
               deadline: float) -> tuple[bool, str, int, bool, int]:
        """Write this rank's ``slices`` into the consumer's blocks (``src_blocks``: one list per KV-cache
        group): ``(ok, why, bytes, settled, valid)``. The write goes in parts in token order
        (:func:`read_pieces` of the consumer's blocks); a failed one reports the tokens before it as
        ``valid`` (they landed in every group). No write starts past ``deadline`` (monotonic): a part
        queued behind other pushes must not land in blocks the consumer has given up on and unpinned."""
        nbytes, landed = 0, 0
        try:
            t0 = time.perf_counter()
            transfer, mine = self.transfer_for(peer.protocol)
            for lo, hi in read_pieces(msg.start, msg.end, peer.block_size, min_tokens=self.config.part_tokens):
                landed = lo
                for sl in slices:
                    if time.monotonic() > deadline:
                        return False, "the push's deadline passed before this part was written", 0, True, landed
                    sp, dp, ln = kv_segments(mine, peer, src_blocks, msg.all_block_ids, lo, hi, load_end=msg.end,
                                             heads=HeadSlice(*sl))
                    if ln:
                        transfer.write(peer.endpoint, sp, dp, ln)
                    nbytes += sum(ln)
            self.counters["transfer_s"] += time.perf_counter() - t0
            return True, "", nbytes, True, msg.end
        except TransferTimeout as e:
            return False, f"{type(e).__name__}: {e}", 0, False, landed  # it may still land
        except Exception as e:
            return False, f"{type(e).__name__}: {e}", 0, True, landed

    def accept_order(self, order: PushOrder) -> Ack:
        """A producer rank other than the driver: write its part in the background."""
        if self.layout is None:
            return Ack(False, "this rank has no registered KV cache")
        self._pool.submit(self._write_part, order, time.monotonic() + 3 * self.config.transfer_timeout_s)
        return Ack(True)

    def _write_part(self, order: PushOrder, deadline: float) -> None:
        ok, why, nbytes, settled, valid = self._write(order.consumer, order.src_block_ids, order.push,
                                                      [HeadSlice(*s) for s in order.slices], deadline)
        part = PushPart(order.key, self.tp_rank, ok, why, nbytes, settled, 0 if ok else valid)
        with contextlib.suppress(Exception):  # else the driver's hold expires; the consumer recomputes
            call(order.reply_to, part, self.config.transfer_timeout_s)

    def _part_done(self, part: PushPart) -> Ack:
        """Driver: one rank's part ended; the last one answers the consumer rank."""
        with self.state.lock:
            p = self._parts.get(part.key)
            if p is None or part.rank not in p.pending:
                return Ack(False, f"no push part {part.key} of rank {part.rank} is pending")
            p.pending.discard(part.rank)
            p.ok, p.nbytes, p.settled = p.ok and part.ok, p.nbytes + part.nbytes, p.settled and part.settled
            p.why = p.why or part.reason
            if not part.ok:  # every part writes its slices in token order: the smallest failed one's landed
                p.valid = part.valid if p.valid < 0 else min(p.valid, part.valid)
            if p.pending:
                return Ack(True)
            del self._parts[part.key]
        self._pool.submit(self._notify, p.msg, p.ok, p.why, p.nbytes if p.ok else 0, p.rid, p.settled,
                          max(p.valid, 0))
        return Ack(True)
