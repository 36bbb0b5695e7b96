"""The p2p connector's consumer (decode engine) side: offer the remote prompt KV as an async
external hit (the request waits in WAITING_FOR_REMOTE_KVS), pin the blocks it arrives in, READ it
(pull) or ask the producer to WRITE it (push), and report the load done or failed (recompute).

A request is offered once: after a failure, a refusal or a preemption it recomputes locally.
State lives on :class:`~hwkv.connectors.p2p.connector.P2PConnector`; this mixin holds the consumer's logic.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import msgspec

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
    pair_segments,
    prompt_digest,
    read_plan,
)
from hwkv.interfaces.transfer import TransferTimeout

log = logging.getLogger(__name__)
_NEED = ("remote_host", "remote_port", "remote_request_id", "remote_block_ids", "remote_num_tokens", "prompt_digest")


class LoadSpec(msgspec.Struct, array_like=True):
    """Per-step metadata: load tokens ``[start, end)`` of the remote request ``params`` names into
    ``block_ids`` (the request's blocks, all of them, in order; pinned by the scheduler side)."""

    rid: str
    params: dict[str, Any]
    block_ids: list[int]
    start: int
    end: int


@dataclass
class _Load:
    """Worker side: one request's incoming KV (into this rank's shard)."""

    spec: LoadSpec
    deadline: float = 0.0
    reported: bool = False  # finished_recving / failed_recving sent
    settled: bool = False  # no transfer into the blocks can still be running
    protocol: str = ""  # chosen at the handshake ("tcp" from a device: it arrives in the host mirror)


class ConsumerSide:
    # ---- scheduler side ------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid, p = request.request_id, request.kv_transfer_params or {}
        if self.role != "consumer" or not p.get("do_remote_prefill") or rid in self._no_offer or self.layout is None:
            return 0, False
        why = self._refusal(request, p)
        if why:
            self._no_offer.add(rid)
            self.counters["refused_offers"] += 1
            log.warning("p2p: request %s recomputes its prompt: %s", rid, why)
            self.release_remote(p)
            return 0, False
        end = request.num_tokens - 1
        if "remote_num_tokens" in p:
            end = min(int(p["remote_num_tokens"]), end)
        if end <= num_computed_tokens:  # the local prefix cache has it all
            self._no_offer.add(rid)
            self.release_remote(p)
            return 0, False
        self._offers[rid] = (num_computed_tokens, end)
        return end - num_computed_tokens, True

    def release_remote(self, p: dict[str, Any]) -> None:
        """Best effort, in the background: the producer may free blocks this consumer will not fetch
        (else they go on its hold timeout)."""
        if "remote_request_id" in p and "remote_host" in p and "remote_port" in p:
            address = f"{p['remote_host']}:{p['remote_port']}"
            self._pool.submit(call, address, Release(str(p["remote_request_id"]), False), self.transfer_timeout_s)

    def _refusal(self, request: Any, p: dict[str, Any]) -> str:
        if p.get("mode", self.mode) != self.mode:
            return f"the producer runs mode {p.get('mode')!r}, this consumer {self.mode!r}"
        if "transfer_id" in p and "remote_request_id" not in p:  # consumer first: the producer checks the prompt
            missing = [k for k in ("remote_host", "remote_port") if k not in p]
            if self.mode != "push":
                return "a transfer_id (consumer-first request) needs mode 'push'"
            return f"kv_transfer_params lack {', '.join(missing)}" if missing else ""
        missing = [k for k in _NEED if k not in p]
        if missing:
            return f"kv_transfer_params lack {', '.join(missing)}"
        n = int(p["remote_num_tokens"])
        if n > request.num_prompt_tokens or \
                prompt_digest(request.prompt_token_ids[:n], request.cache_salt) != p["prompt_digest"]:
            return "the prompt (or cache_salt) differs from the one the producer prefilled"
        return ""

    def consumer_admitted(self, request: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        offer = self._offers.pop(rid, None)
        if offer is None or not num_external_tokens:
            return
        start, _ = offer
        blocks = list(self.kv.get_blocks(rid))
        self.kv.block_pool.touch(blocks)  # pinned until every rank reports no transfer can write them
        load = LoadSpec(rid, dict(request.kv_transfer_params), [b.block_id for b in blocks], start,
                        start + num_external_tokens)
        if "transfer_id" in load.params and "remote_request_id" not in load.params:
            load.params["remote_request_id"] = load.params["transfer_id"]
            load.params["digest"] = prompt_digest(request.prompt_token_ids[:load.end], request.cache_salt)
        self._loads[rid] = blocks
        self._new_loads.append(load)
        self._no_offer.add(rid)  # offered once: a preempted or failed request recomputes

    # ---- worker side ---------------------------------------------------------------------------
    def _handshake(self, address: str) -> list[Layout]:
        """The producer's rank layouts over the protocol chosen with it (cached per address): the first
        of this engine's offers, in its order, that the producer offers too and that works between
        them (same host and a probe for device-direct ones); each skipped one is logged with why.
        Raises naming why they cannot pair at all."""
        peers = self._producers.get(address)
        if peers is not None:
            return peers
        mine = list(self.layouts.values()) or [self.layout]
        reply = call(address, Hello(mine[0], mine[1:]), self.transfer_timeout_s)  # type: ignore[arg-type]
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
                why = self.usable(me, lay) if self.mode == "pull" else incompatibility(me, lay)
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
            wait = self.hold_timeout_s if "digest" in spec.params else 0.0
            load = self._reading[spec.rid] = _Load(spec, time.monotonic() + 3 * self.transfer_timeout_s + wait)
            self._pool.submit(self._pull if self.mode == "pull" else self._ask_push, load)

    def _pull(self, load: _Load) -> None:
        """Read this rank's KV heads from the producer ranks that hold them (one whole-block slice
        from the same rank when both engines split alike), then release the producer's hold."""
        spec, me = load.spec, self.layout
        p, ok, nbytes, settled = spec.params, False, 0, True
        address = f"{p['remote_host']}:{p['remote_port']}"
        try:
            try:
                peers = self._handshake(address)
            except Exception:  # never read: the producer frees its copy once every rank said so, not on its timeout
                release = Release(str(p["remote_request_id"]), False, self.layout.tp_rank, self.layout.tp_size)
                self._pool.submit(call, address, release, self.transfer_timeout_s)
                raise
            load.protocol = peers[0].protocol
            transfer, me = self.transfer_for(load.protocol)
            rid, rank, size = p["remote_request_id"], me.tp_rank, me.tp_size
            ack = call(address, Acquire(rid, rank, size, load.protocol), self.transfer_timeout_s)
            while isinstance(ack, Ack) and ack.retry and time.monotonic() < load.deadline - self.transfer_timeout_s:
                time.sleep(0.005)  # the producer's ranks are still staging the KV
                ack = call(address, Acquire(rid, rank, size, load.protocol), self.transfer_timeout_s)
            if not (isinstance(ack, Ack) and ack.ok):
                raise RuntimeError(getattr(ack, "reason", "acquire refused"))
            t0 = time.perf_counter()
            try:
                reads = [(peer, pair_segments(peer, me, list(p["remote_block_ids"]), spec.block_ids, spec.start,
                                              spec.end, heads=sl)) for peer, sl in read_plan(peers, me)]
                for peer, (sp, dp, ln) in reads:
                    if time.monotonic() > load.deadline:  # given up (or about to be): no read may start now
                        raise RuntimeError("the load's deadline passed before all of its reads started")
                    if ln:
                        settled = False  # a read that times out may still land: keep the blocks pinned a while
                        t1 = time.perf_counter()
                        transfer.read(peer.endpoint, dp, sp, ln)
                        # the copies alone (transfer_s also has the segment plan): where the time goes
                        self.counters["copy_s"] = self.counters.get("copy_s", 0.0) + time.perf_counter() - t1
                    nbytes += sum(ln)
                ok, settled = True, True
                self.counters["transfer_s"] += time.perf_counter() - t0
            except TransferTimeout:
                raise
            except Exception:
                settled = True  # failed, not running
                raise
            finally:
                try:
                    call(address, Release(rid, ok, rank, size), self.transfer_timeout_s)
                except Exception as e:  # the producer frees the blocks on its hold timeout
                    log.info("p2p: release of %s at %s failed: %s", p["remote_request_id"], address, e)
        except Exception as e:
            log.warning("p2p: pull of %s failed (it recomputes): %s", spec.rid, e)
        self._done("recv", spec.rid, ok, nbytes if ok else 0, settled)

    def _ask_push(self, load: _Load) -> None:
        spec = load.spec
        p = spec.params
        address = f"{p['remote_host']}:{p['remote_port']}"
        try:
            try:
                load.protocol = self._handshake(address)[0].protocol
            except Exception:
                if p.get("remote_request_id") != p.get("transfer_id"):  # a held prefill: free it now
                    self.release_remote(p)
                raise
            msg = PushRequest(p["remote_request_id"], self.engine_id, spec.rid, spec.block_ids, spec.start, spec.end,
                              self.channel.address, p.get("digest", ""), self.layout.tp_rank, self.layout.tp_size,
                              load.protocol)
            ack = call(address, msg, self.transfer_timeout_s)
            if not (isinstance(ack, Ack) and ack.ok):
                raise RuntimeError(getattr(ack, "reason", "push refused"))
        except Exception as e:
            log.warning("p2p: push into %s not started (it recomputes): %s", spec.rid, e)
            self._done("recv", spec.rid, False, 0)

    def consumer_result(self, rid: str, ok: bool, nbytes: int, settled: bool, recv: set[str],
                        failed: set[str]) -> None:
        load = self._reading.get(rid)
        if load is None:
            return
        load.settled = settled  # unsettled: unpinned after the grace period (consumer_poll)
        if load.reported:
            return
        load.reported = True
        if ok and self.host_kv is not None and load.protocol in ("tcp", ""):  # it arrived in the host mirror
            bs, spec = self.kv_cache.spec.block_size, load.spec
            self._stage(False, spec.block_ids[spec.start // bs:-(-spec.end // bs)])
        (recv if ok else failed).add(rid)
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
            if load.settled or now > load.deadline + 3 * self.transfer_timeout_s:
                settled.append((rid, True))
                del self._reading[rid]
