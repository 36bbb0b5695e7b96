"""The p2p connector's scheduler side (the driver's): decide what moves, pin blocks, tell the workers.

Consumer: offers a request's remote prompt KV (``get_num_new_matched_tokens``), pins the blocks it
lands in, lists the step's loads (:class:`~hwkv.connectors.p2p.state.LoadSpec`) and the remote
holds to release in the metadata, and unpins once every rank reported its transfers ended
(``p2p_settled``). Producer: a finished request's blocks become a :class:`~hwkv.connectors.p2p.state.Held`
in the :class:`~hwkv.connectors.p2p.state.DriverState` the driver's side channel serves, and its
``kv_transfer_params`` say where; layerwise, the writes of this step's forwards go to the worker.
It does no I/O: every transfer and side-channel call is the worker side's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from hwkv.connectors.base.roles import ConnectorScheduler
from hwkv.connectors.p2p.protocol import prompt_digest, push_refusal
from hwkv.connectors.p2p.state import DriverState, Held, LoadSpec, P2PConfig, P2PMeta, Stream
from hwkv.core.request import RequestStatus
from hwkv.interfaces.connector import KVConnectorOutput

log = logging.getLogger(__name__)
_NEED = ("remote_host", "remote_port", "remote_request_id", "remote_block_ids", "remote_num_tokens", "prompt_digest")


class P2PScheduler(ConnectorScheduler):
    def __init__(self, config: P2PConfig, state: DriverState):
        self.config, self.state = config, state
        self.kv: Any = None  # the kv cache manager (pins)
        self.staging = False  # the ranks' KV goes to peers through a host mirror (bind_worker)
        self._offers: dict[str, tuple[int, int]] = {}  # rid -> (start, end) offered
        self._loads: dict[str, Any] = {}  # rid -> its pinned blocks, until every rank settled
        self._new_loads: list[LoadSpec] = []
        self._no_offer: set[str] = set()
        self._releases: list[dict[str, Any]] = []
        self._to_stage: list[tuple[str, list[int]]] = []
        self.refused_offers = 0

    def bind_tp_worker_info(self, infos: list[Any]) -> None:
        self.state.rank_layouts = list(infos)

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.kv = kv_cache_manager

    def bind_worker(self, staging: bool) -> None:
        """The driver's worker registered its KV: whether it goes to peers through a host mirror."""
        self.staging = staging

    @property
    def registered(self) -> bool:
        return bool(self.state.rank_layouts)

    # ---- consumer ------------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        rid, p = request.request_id, request.kv_transfer_params or {}
        if self.config.role != "consumer" or not p.get("do_remote_prefill") or rid in self._no_offer \
                or not self.registered:
            return 0, False
        why = self._refusal(request, p)
        if why:
            self._no_offer.add(rid)
            self.refused_offers += 1
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
        """The producer may free blocks this consumer will not fetch (else they go on its hold
        timeout): the driver's worker tells it, best effort, next step."""
        if "remote_request_id" in p and "remote_host" in p and "remote_port" in p:
            self._releases.append({k: p[k] for k in ("remote_request_id", "remote_host", "remote_port")})

    def _refusal(self, request: Any, p: dict[str, Any]) -> str:
        mode = self.config.mode
        if p.get("mode", mode) != mode:
            return f"the producer runs mode {p.get('mode')!r}, this consumer {mode!r}"
        if "transfer_id" in p and "remote_request_id" not in p:  # consumer first: the producer checks the prompt
            missing = [k for k in ("remote_host", "remote_port") if k not in p]
            if mode != "push":
                return "a transfer_id (consumer-first request) needs mode 'push'"
            return f"kv_transfer_params lack {', '.join(missing)}" if missing else ""
        missing = [k for k in _NEED if k not in p]
        if missing:
            return f"kv_transfer_params lack {', '.join(missing)}"
        theirs, mine = 1 + len(p.get("remote_group_block_ids") or ()), len(getattr(self.kv, "managers", [0]))
        if theirs != mine:
            return (f"the producer holds {theirs} KV-cache group(s) per request, this consumer has {mine} (allowed: "
                    "the same model and kv_cache_groups setting on both sides)")
        n = int(p["remote_num_tokens"])
        if n > request.num_prompt_tokens or \
                prompt_digest(request.prompt_token_ids[:n], request.cache_salt) != p["prompt_digest"]:
            return "the prompt (or cache_salt) differs from the one the producer prefilled"
        return ""

    def update_state_after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if self.config.role == "consumer":
            self._admitted(request, num_external_tokens)
        elif self.config.layerwise:
            tid = (request.kv_transfer_params or {}).get("transfer_id")
            if tid:
                self.state.producing[request.request_id] = request
                self.state.by_transfer[tid] = request.request_id

    def _admitted(self, request: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        offer = self._offers.pop(rid, None)
        if offer is None or not num_external_tokens:
            return
        start, _ = offer
        end = start + num_external_tokens
        ids = [self.kv.get_block_ids(rid)]
        if self.grouped:
            for m in self.kv.managers:
                if getattr(m, "window", None):  # blocks before the loaded window: never loaded, never read
                    m.free_outside_window(request, end)
            ids = self.kv.get_group_block_ids(rid)
        blocks = self._pin(rid)  # pinned until every rank reports no transfer can write them
        load = LoadSpec(rid, dict(request.kv_transfer_params), ids[0], start, end, ids[1:])
        if "transfer_id" in load.params and "remote_request_id" not in load.params:
            load.params["remote_request_id"] = load.params["transfer_id"]
            load.params["digest"] = prompt_digest(request.prompt_token_ids[:load.end], request.cache_salt)
        self._loads[rid] = blocks
        self._new_loads.append(load)
        self._no_offer.add(rid)  # offered once: a preempted or failed request recomputes

    @property
    def grouped(self) -> bool:
        """The KV-cache manager has KV-cache groups (docs/hybrid-models.md)."""
        return hasattr(self.kv, "managers")

    def _pin(self, rid: str) -> list[list[Any]]:
        """Touch the request's blocks (each group's live ones, in its own pool); returns them per group."""
        if not self.grouped:
            blocks = list(self.kv.get_blocks(rid))
            self.kv.block_pool.touch(blocks)
            return [blocks]
        out = []
        for m in self.kv.managers:
            live = [b for b in m.get_blocks(rid) if not b.is_null]
            m.block_pool.touch(live)
            out.append(live)
        return out

    def _unpin(self, blocks: list[list[Any]]) -> None:
        pools = [m.block_pool for m in self.kv.managers] if self.grouped else [self.kv.block_pool]
        for pool, b in zip(pools, blocks):
            pool.free_blocks(b)

    # ---- both roles ----------------------------------------------------------------------------
    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid, params = request.request_id, request.kv_transfer_params or {}
        self._offers.pop(rid, None)
        offered = rid in self._no_offer
        self._no_offer.discard(rid)
        if self.config.role == "consumer":
            if params.get("do_remote_prefill"):
                request.kv_transfer_params = None  # consumed: the response carries none (as vLLM's decode side)
                if not offered:  # finished (aborted) before it was admitted: nobody fetches the remote KV
                    self.release_remote(params)
            return False, None  # in-flight loads pin their blocks themselves
        if not params.get("do_remote_decode") or not self.registered:
            return False, None
        return self._hold(request, block_ids)

    def build_connector_meta(self, scheduler_output: Any) -> P2PMeta:
        loads, self._new_loads = self._new_loads, []
        writes = self._layer_writes(scheduler_output) if self.state.producing else []
        stage, self._to_stage = self._to_stage, []
        releases, self._releases = self._releases, []
        return P2PMeta(loads, writes, scheduler_output.total_num_scheduled_tokens == 0, stage, releases)

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        if "p2p_staged" in output.extra:
            self._staged(output.extra["p2p_staged"])
        for rid, *_ in output.extra.get("p2p_settled", ()):  # every rank's transfers into them ended
            blocks = self._loads.pop(rid, None)
            if blocks is not None:
                self._unpin(blocks)

    def has_pending_transfers(self) -> bool:
        return bool(self._loads or self.state.held or self.state.streams or self._releases)

    def stats(self) -> dict[str, Any]:
        return dict(refused_offers=self.refused_offers, loads_in_flight=len(self._loads),
                    held_requests=len(self.state.held), role=self.config.role, mode=self.config.mode)

    # ---- producer ------------------------------------------------------------------------------
    def _hold(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid, params, st = request.request_id, request.kv_transfer_params or {}, self.state
        st.producing.pop(rid, None)
        stream = st.streams.get(rid)
        ok_end = request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
        n = min(request.num_computed_tokens, request.num_prompt_tokens)
        me = st.rank_layouts[0]
        ids = list(block_ids[:-(-n // me.block_size)])
        # KV-cache groups: every group's table (a window group's entries before its window are its
        # null block: the consumer refuses a load that needs them)
        rest = [list(g[:len(ids)]) for g in self.kv.get_group_block_ids(rid)[1:]] if self.grouped else []
        if not ok_end or n < 1 or not ids:
            if stream is not None:
                stream.failed = stream.failed or f"the prefill request ended {request.status.name}"
                stream.finished = True
            return stream is not None, None  # in-flight layer writes read the blocks: freed once they end
        # with a host mirror, a tensor-parallel hold is served once every rank copied its shard there
        # (at its next step's start, reported in p2p_staged); at tp=1 the worker copies it when a
        # peer first reads or writes it over tcp
        tp_staged = not (self.staging and self.tp_size > 1)
        if not tp_staged:
            self._to_stage.append((rid, [ids, *rest]))
        with st.lock:
            h = st.held[rid] = Held(rid, ids, n, time.monotonic() + self.config.hold_timeout_s, rest,
                                    (request.prompt_token_ids, request.cache_salt), staged=tp_staged,
                                    host_staged=not tp_staged)
            tid = params.get("transfer_id")
            early = st.targets.pop(tid, None) if tid and stream is None else None
            if stream is not None:
                h.busy, stream.finished = True, True
            elif early is not None:  # announced during the prefill, too late for layer writes: one write now
                st.claim(h, early[0], self.config.transfer_timeout_s)
                st.ready.append((early[0], h, early[1], True))
        host, port = me.side_channel.rsplit(":", 1)
        return True, {
            "do_remote_prefill": True, "do_remote_decode": False, "mode": self.config.mode,
            "remote_engine_id": me.engine_id, "remote_host": host, "remote_port": int(port),
            "remote_request_id": rid, "remote_block_ids": ids, "remote_num_tokens": n,
            "remote_block_size": me.block_size, **({"remote_group_block_ids": rest} if rest else {}),
            "prompt_digest": prompt_digest(request.prompt_token_ids[:n], request.cache_salt),
        }

    def _staged(self, done: list[Any]) -> None:
        """Holds every rank staged (``(rid, ok)``): the pushes that waited for them are released."""
        st = self.state
        for rid, ok, *_ in done:
            with st.lock:
                h = st.held.get(rid)
                if h is None:
                    continue
                h.staged, waiting, h.waiting = bool(ok), h.waiting, []
                if not ok:  # a rank could not stage: never served (readers retry until it expires, now)
                    h.deadline = 0.0
                for msg, peer in waiting:
                    if ok:
                        st.claim(h, msg, self.config.transfer_timeout_s)
                    st.ready.append((msg, h, peer, bool(ok)))

    def _layer_writes(self, so: Any) -> list[tuple[Stream, list[list[int]], int, int]]:
        """This step's layerwise writes: ``(stream, block ids per group, start, end)`` per request whose
        consumer announced its blocks before the request's first forward."""
        out, st = [], self.state
        for rid in so.preempted_req_ids:  # its blocks go back to the pool under in-flight layer writes
            if (s := st.streams.get(rid)) is not None:
                s.failed = s.failed or "the prefill request was preempted"
        for new in so.scheduled_new_reqs:
            req = st.producing.get(new.req_id)
            if req is None or new.req_id in st.streams:
                continue
            with st.lock:
                target = st.targets.pop(req.kv_transfer_params["transfer_id"], None)
            if target is None:
                continue
            msg, peer = target
            why = push_refusal(msg, req.prompt_token_ids, req.cache_salt, req.num_prompt_tokens)
            s = st.streams[new.req_id] = Stream(msg, peer, failed=why)
            out.append((s, self._all_ids(new.req_id), 0, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id]))
        cached = so.scheduled_cached_reqs
        for rid, c in zip(cached.req_ids, cached.num_computed_tokens):
            s = st.streams.get(rid)
            if s is not None and not s.finished and c < s.msg.end:
                out.append((s, self._all_ids(rid), c, c + so.num_scheduled_tokens[rid]))
        return out

    def _all_ids(self, rid: str) -> list[list[int]]:
        """The request's block ids, one list per KV-cache group."""
        return self.kv.get_group_block_ids(rid) if self.grouped else [self.kv.get_block_ids(rid)]

