"""The p2p connector's consumer (decode engine) side: offer the remote prompt KV as an async
external hit (the request waits in WAITING_FOR_REMOTE_KVS), pin the blocks it arrives in, READ it
(pull) or ask the producer to WRITE it (push), and report the load done or failed (recompute).

A request is offered once: after a failure, a refusal or a preemption it recomputes locally.
State lives on :class:`~hwkv.connectors.p2p.P2PConnector`; this mixin holds the consumer's logic.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from hwkv.connectors.p2p_channel import call
from hwkv.connectors.p2p_protocol import Ack, Acquire, PushRequest, Release, pair_segments, prompt_digest
from hwkv.interfaces.transfer import TransferTimeout

log = logging.getLogger(__name__)
_NEED = ("remote_host", "remote_port", "remote_request_id", "remote_block_ids", "remote_num_tokens", "prompt_digest")


@dataclass
class _Load:
    """One request's incoming KV."""

    rid: str
    params: dict[str, Any]
    blocks: list[Any]  # pinned KVCacheBlocks of the request (all of them, in order)
    start: int
    end: int
    deadline: float = 0.0
    reported: bool = False  # finished_recving / failed_recving sent
    settled: bool = False  # no transfer into the blocks can still be running


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
        self.kv.block_pool.touch(blocks)  # pinned until no transfer can write them any more
        load = _Load(rid, dict(request.kv_transfer_params), blocks, start, start + num_external_tokens)
        if "transfer_id" in load.params and "remote_request_id" not in load.params:
            load.params["remote_request_id"] = load.params["transfer_id"]
            load.params["digest"] = prompt_digest(request.prompt_token_ids[:load.end], request.cache_salt)
        self._loads[rid] = load
        self._new_loads.append(load)
        self._no_offer.add(rid)  # offered once: a preempted or failed request recomputes

    # ---- worker side ---------------------------------------------------------------------------
    def start_loads(self, loads: list[_Load]) -> None:
        for load in loads:
            # consumer first: the producer may still be queueing the prefill, so allow its hold time
            wait = self.hold_timeout_s if "digest" in load.params else 0.0
            load.deadline = time.monotonic() + 3 * self.transfer_timeout_s + wait
            self._pool.submit(self._pull if self.mode == "pull" else self._ask_push, load)

    def _pull(self, load: _Load) -> None:
        p, ok, nbytes, settled = load.params, False, 0, True
        address = f"{p['remote_host']}:{p['remote_port']}"
        try:
            peer = self._handshake(address)
            ack = call(address, Acquire(p["remote_request_id"]), self.transfer_timeout_s)
            if not (isinstance(ack, Ack) and ack.ok):
                raise RuntimeError(getattr(ack, "reason", "acquire refused"))
            sp, dp, ln = pair_segments(peer, self.layout, list(p["remote_block_ids"]),
                                       [b.block_id for b in load.blocks], load.start, load.end)
            t0 = time.perf_counter()
            try:
                if ln:
                    settled = False  # a read that times out may still land: keep the blocks pinned a while
                    self.transfer.read(peer.endpoint, dp, sp, ln)
                ok, nbytes, settled = True, sum(ln), True
                self.counters["transfer_s"] += time.perf_counter() - t0
            except TransferTimeout:
                raise
            except Exception:
                settled = True  # failed, not running
                raise
            finally:
                try:
                    call(address, Release(p["remote_request_id"], ok), self.transfer_timeout_s)
                except Exception as e:  # the producer frees the blocks on its hold timeout
                    log.info("p2p: release of %s at %s failed: %s", p["remote_request_id"], address, e)
        except Exception as e:
            log.warning("p2p: pull of %s failed (it recomputes): %s", load.rid, e)
        self._done("recv", load.rid, ok, nbytes, settled)

    def _ask_push(self, load: _Load) -> None:
        p = load.params
        address = f"{p['remote_host']}:{p['remote_port']}"
        try:
            self._handshake(address)
            msg = PushRequest(p["remote_request_id"], self.engine_id, load.rid, [b.block_id for b in load.blocks],
                              load.start, load.end, self.channel.address, p.get("digest", ""))
            ack = call(address, msg, self.transfer_timeout_s)
            if not (isinstance(ack, Ack) and ack.ok):
                raise RuntimeError(getattr(ack, "reason", "push refused"))
        except Exception as e:
            log.warning("p2p: push into %s not started (it recomputes): %s", load.rid, e)
            self._done("recv", load.rid, False, 0)

    def consumer_result(self, rid: str, ok: bool, nbytes: int, settled: bool, recv: set[str],
                        failed: set[str]) -> None:
        load = self._loads.get(rid)
        if load is None:
            return
        load.settled = settled  # unsettled: unpinned after the grace period (consumer_poll)
        if load.reported:
            return
        load.reported = True
        if ok and self.host_kv is not None:
            bs = self.kv_cache.spec.block_size
            self._stage(False, [b.block_id for b in load.blocks[load.start // bs:-(-load.end // bs)]])
        (recv if ok else failed).add(rid)
        self.counters["loaded_bytes"] += nbytes if ok else 0

    def consumer_poll(self, now: float, failed: set[str]) -> None:
        for rid, load in list(self._loads.items()):
            if not load.reported and now > load.deadline:
                load.reported = True  # recompute now; the blocks stay pinned until the transfer ends
                failed.add(rid)
                self.counters["failed_transfers"] += 1
                log.warning("p2p: KV of %s did not arrive in time (it recomputes)", rid)
            if load.settled or now > load.deadline + 3 * self.transfer_timeout_s:
                self._unpin.append(load.blocks)
                del self._loads[rid]
