"""The p2p worker side's consumer (decode engine) part: bring in the loads the scheduler side
listed (:class:`LoadSpec`) - READ the producer's blocks (pull) or ask the producer to WRITE them
(push) - over the protocol the handshake chose, follow the producer's liveness, and report each
load done or failed (the request recomputes) and, separately, settled (no transfer can still write
its blocks: the scheduler side unpins them once every rank did).

A mixin of :class:`~hwkv.connectors.p2p.worker.P2PWorker`, whose ``__init__`` declares the state it uses.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from hwkv.connectors.p2p.channel import PROBE_S, call, listening
from hwkv.connectors.p2p.protocol import (
    Ack,
    Acquire,
    Hello,
    HelloReply,
    Layout,
    PushRequest,
    Release,
    incompatibility,
    kv_segments,
    read_pieces,
    read_plan,
)
from hwkv.connectors.p2p.state import LoadSpec
from hwkv.interfaces.transfer import TransferTimeout

log = logging.getLogger(__name__)


@dataclass
class _Load:
    """Worker side: one request's incoming KV (into this rank's shard)."""

    spec: LoadSpec
    deadline: float = 0.0
    reported: bool = False  # finished_recving / failed_recving sent
    settled: bool = False  # no transfer into the blocks can still be running
    protocol: str = ""  # chosen at the handshake ("tcp" from a device: it arrives in the host mirror)


class Consumer:
    def send_release(self, p: dict[str, Any]) -> None:
        """Best effort, in the background: the producer may free blocks this consumer will not fetch
        (else they go on its hold timeout)."""
        address = f"{p['remote_host']}:{p['remote_port']}"
        self._pool.submit(call, address, Release(str(p["remote_request_id"]), False),
                          self.config.transfer_timeout_s)

    # ---- loads ---------------------------------------------------------------------------
    def _handshake(self, address: str) -> list[Layout]:
        """The producer's rank layouts over the protocol chosen with it (cached per address): the first
        of this engine's offers, in its order, that the producer offers too and that works between
        them (same host and a probe for device-direct ones); each skipped one is logged with why.
        Raises naming why they cannot pair at all."""
        peers = self._producers.get(address)
        if peers is not None:
            return peers
        mine = list(self.layouts.values()) or [self.layout]
        reply = call(address, Hello(mine[0], mine[1:]), self.config.transfer_timeout_s)  # type: ignore[arg-type]
        if not isinstance(reply, HelloReply) or reply.layout is None:
            raise RuntimeError(f"p2p handshake with {address} refused: {getattr(reply, 'reason', reply)}")
        theirs = {lay.protocol: lay for lay in [reply.layout, *reply.alternatives]}
        skipped: list[str] = []
        for me in mine:
            lay = theirs.get(me.protocol)
            if lay is None:
                skipped.append(f"{me.protocol}: not offered by the producer (it offers {', '.join(theirs)})")
                continue
            why = reply.unusable.get(me.protocol, "")
            if not why:  # pull: this side copies (push: the producer checked in its reply)
                why = self.usable(me, lay) if self.config.mode == "pull" else incompatibility(me, lay)
            if why:
                skipped.append(f"{me.protocol}: {why}")
                continue
            peers = (list(reply.layouts) or [reply.layout]) if lay.protocol == reply.layout.protocol else [lay]
            why = next((w for p in peers if (w := incompatibility(me, p))), "")
            if not why and len(peers) != lay.tp_size:
                why = f"the producer described {len(peers)} ranks for tp={lay.tp_size}"
            if why:
                raise RuntimeError(f"p2p handshake with {address} refused: {why}")
            if skipped:
                log.warning("p2p: with producer %s using %s, not %s", address, me.protocol, "; ".join(skipped))
            else:
                log.info("p2p: with producer %s using %s", address, me.protocol)
            self._producers[address] = peers
            return peers
        raise RuntimeError(f"p2p handshake with {address} refused: no protocol works between them ("
                           f"{'; '.join(skipped)})")

    def start_loads(self, loads: list[LoadSpec]) -> None:
        for spec in loads:
            # consumer first: the producer may still be queueing the prefill, so allow its hold time
            wait = self.config.hold_timeout_s if "digest" in spec.params else 0.0
            load = self._reading[spec.rid] = _Load(spec, time.monotonic() + 3 * self.config.transfer_timeout_s + wait)
            self._pool.submit(self._pull if self.config.mode == "pull" else self._ask_push, load)

    def _pull(self, load: _Load) -> None:
        """Read this rank's KV heads from the producer ranks that hold them (one whole-block slice
        from the same rank when both engines split alike), then release the producer's hold."""
        spec, me = load.spec, self.layout
        p, ok, nbytes, settled = spec.params, False, 0, True
        landed = 0  # the tokens before the part being read: whole in every group (reported on a failure)
        address = f"{p['remote_host']}:{p['remote_port']}"
        try:
            try:
                peers = self._handshake(address)
            except Exception:  # never read: the producer frees its copy once every rank said so, not on its timeout
                release = Release(str(p["remote_request_id"]), False, self.layout.tp_rank, self.layout.tp_size)
                self._pool.submit(call, address, release, self.config.transfer_timeout_s)
                raise
            load.protocol = peers[0].protocol
            transfer, me = self.transfer_for(load.protocol)
            rid, rank, size = p["remote_request_id"], me.tp_rank, me.tp_size
            ack = call(address, Acquire(rid, rank, size, load.protocol), self.config.transfer_timeout_s)
            timeout_s = self.config.transfer_timeout_s
            while isinstance(ack, Ack) and ack.retry and time.monotonic() < load.deadline - timeout_s:
                time.sleep(0.005)  # the producer's ranks are still staging the KV
                ack = call(address, Acquire(rid, rank, size, load.protocol), self.config.transfer_timeout_s)
            if not (isinstance(ack, Ack) and ack.ok):
                raise RuntimeError(getattr(ack, "reason", "acquire refused"))
            t0 = time.perf_counter()
            try:
                theirs = [list(p["remote_block_ids"]), *map(list, p.get("remote_group_block_ids") or ())]
                plan = read_plan(peers, me)
                # in parts, in token order: a part that fails keeps every part before it (valid_tokens)
                for lo, hi in read_pieces(spec.start, spec.end, me.block_size, min_tokens=self.config.part_tokens):
                    landed = lo
                    for peer, sl in plan:
                        sp, dp, ln = kv_segments(peer, me, theirs, spec.all_block_ids, lo, hi, load_end=spec.end,
                                                 heads=sl)
                        if time.monotonic() > load.deadline:  # given up (or about to be): no read may start now
                            raise RuntimeError("the load's deadline passed before all of its reads started")
                        if ln:
                            settled = False  # a read that times out may still land: keep the blocks pinned a while
                            t1 = time.perf_counter()
                            transfer.read(peer.endpoint, dp, sp, ln)
                            # the copies alone (transfer_s also has the segment plan): where the time goes
                            self.counters["copy_s"] = self.counters.get("copy_s", 0.0) + time.perf_counter() - t1
                            settled = True
                        nbytes += sum(ln)
                ok, landed = True, spec.end
                self.counters["transfer_s"] += time.perf_counter() - t0
            except TransferTimeout:
                settled = False  # the timed-out part may still land: its blocks stay pinned a while
                raise
            except Exception:
                settled = True  # failed, not running
                raise
            finally:
                try:
                    call(address, Release(rid, ok, rank, size), self.config.transfer_timeout_s)
                except Exception as e:  # the producer frees the blocks on its hold timeout
                    log.info("p2p: release of %s at %s failed: %s", p["remote_request_id"], address, e)
        except Exception as e:
            log.warning("p2p: pull of %s failed (it recomputes): %s", spec.rid, e)
        self._done("recv", spec.rid, ok, nbytes if ok else 0, settled, landed if landed > spec.start else 0)

    def _ask_push(self, load: _Load) -> None:
        spec = load.spec
        p = spec.params
        address = f"{p['remote_host']}:{p['remote_port']}"
        try:
            try:
                load.protocol = self._handshake(address)[0].protocol
            except Exception:
                if p.get("remote_request_id") != p.get("transfer_id"):  # a held prefill: free it now
                    self.send_release(p)
                raise
            msg = PushRequest(p["remote_request_id"], self.engine_id, spec.rid, spec.block_ids, spec.start, spec.end,
                              self.channel.address, p.get("digest", ""), self.layout.tp_rank, self.layout.tp_size,
                              load.protocol, spec.group_block_ids)
            ack = call(address, msg, self.config.transfer_timeout_s)
            if not (isinstance(ack, Ack) and ack.ok):
                raise RuntimeError(getattr(ack, "reason", "push refused"))
        except Exception as e:
            log.warning("p2p: push into %s not started (it recomputes): %s", spec.rid, e)
            self._done("recv", spec.rid, False, 0)

    def consumer_result(self, rid: str, ok: bool, nbytes: int, settled: bool, valid: int, recv: set[str],
                        failed: set[str], valid_tokens: dict[str, int]) -> None:
        """A load ended: ``ok``, or failed with its first ``valid`` tokens landed (0: none beyond its
        local hit), which the scheduler keeps."""
        load = self._reading.get(rid)
        if load is None:
            return
        load.settled = settled  # unsettled: unpinned after the grace period (consumer_poll)
        if load.reported:
            return
        load.reported = True
        spec = load.spec
        end = spec.end if ok else valid
        if end > spec.start and self.host_kv is not None and load.protocol in ("tcp", ""):  # in the host mirror
            bs = self.kv_cache.spec.block_size
            try:
                self._stage(False, [ids[spec.start // bs:-(-end // bs)] for ids in spec.all_block_ids])
            except Exception as e:  # never on the device: nothing of the load is
                log.warning("p2p: staging the KV of %s to the device failed (it recomputes): %s", rid, e)
                ok, end = False, 0
        (recv if ok else failed).add(rid)
        if not ok and end > spec.start:
            valid_tokens[rid] = end
        self.counters["loaded_bytes"] += nbytes if ok else 0
        if ok and load.protocol:
            key = f"bytes_via_{load.protocol}"
            self.counters[key] = self.counters.get(key, 0) + nbytes

    def _probe_producers(self, now: float) -> None:
        """Loads waiting on a producer (its push, its PushDone) follow its liveness: every ``PROBE_S``
        a short-lived thread checks each such producer still listens; a dead one fails its loads at once
        (they recompute) instead of at their deadline (30 s and more)."""
        last = self._probed
        for addr in {f"{ld.spec.params['remote_host']}:{ld.spec.params['remote_port']}"
                     for ld in self._reading.values() if not ld.reported}:
            if now - last.get(addr, 0.0) >= PROBE_S:
                last[addr] = now
                threading.Thread(target=self._probe, args=(addr,), name="p2p-probe", daemon=True).start()

    def _probe(self, addr: str) -> None:
        if listening(addr):
            return
        for rid, load in list(self._reading.items()):
            p = load.spec.params
            if not load.reported and f"{p['remote_host']}:{p['remote_port']}" == addr:
                log.warning("p2p: producer %s is down; %s recomputes", addr, rid)
                self._done("recv", rid, False, 0)  # dead: nothing of it can still write into the blocks

    def consumer_poll(self, now: float, failed: set[str], settled: list[tuple[str, bool]]) -> None:
        """Time out loads; report (in ``settled``) those no transfer can still write into, so the
        scheduler side unpins their blocks once every rank did."""
        self._probe_producers(now)
        for rid, load in list(self._reading.items()):
            if not load.reported and now > load.deadline:
                load.reported = True  # recompute now; the blocks stay pinned until the transfer ends
                failed.add(rid)
                self.counters["failed_transfers"] += 1
                log.warning("p2p: KV of %s did not arrive in time (it recomputes)", rid)
            if load.settled or now > load.deadline + 3 * self.config.transfer_timeout_s:
                settled.append((rid, True))
                del self._reading[rid]
