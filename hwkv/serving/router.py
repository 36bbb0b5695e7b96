"""Cache-aware router: one OpenAI-compatible endpoint in front of several ``hwkv serve`` instances
of one model, sending each request where the longest prefix of its prompt is already cached.

Each instance publishes its KV events (``hwkv serve --kv-events-endpoint``, docs/kv-events.md); the
router follows every instance with a :class:`~hwkv.engine.kv_events.KVEventSubscriber` (replay and
snapshot resync included), so it knows, per instance, the block hashes its device cache (medium
``GPU``) and its host tier (``CPU``) hold. For a request it renders and tokenizes the prompt as the
server does (the model directory's tokenizer and chat template), hashes the tokens into the same
chained block hashes (``hwkv.core.hashing``, ``cache_salt`` included; the block size is the one
the events carry) and scores each instance by its cached prefix: blocks from the start of the
prompt, consecutive, a device block counting 1 and a host-tier block ``cpu_weight``.

Policy ``cache_aware`` (the default; the design of SGLang's cache-aware router and llm-d's
prefix-cache scorer):

1. load balance first: only instances with at most ``balance_abs`` more requests in flight (through
   this router) than the least loaded one are candidates, so a hot prefix cannot pile every
   request onto one instance;
2. among them the highest prefix score wins; ties go to the less loaded, then round-robin;
3. no candidate holds any block of the prompt: the least loaded, round-robin among equals.

With ``load_weight > 0`` step 2 weighs the prefix against the work already queued (the cost of
Dynamo's KV router): each candidate costs the blocks it would have to compute for this prompt plus
``load_weight`` x the blocks its in-flight requests (routed here) had to compute, and the cheapest
wins — a hit behind long prefills elsewhere may lose to a recompute on an idle instance. Ties go to
the higher score, then the less loaded, then round-robin.

A routed request's block hashes count as cached on its instance at once, for ``predict_ttl_s``
seconds (the prefill has not finished, so no event has come yet): requests of the same prefix
that arrive meanwhile follow it instead of computing it elsewhere (SGLang inserts into its
approximate tree at routing time for the same reason). Instances without events, or whose
subscriber has not caught up yet, score 0: the router degrades to least-loaded. Policies
``round_robin`` and ``least_loaded`` ignore the cache (baselines).

A routing decision only moves work, never changes an answer: a stale index costs a recompute.
An instance that cannot be reached is skipped for ``retry_s`` and the request goes to the next
choice; every response carries ``x-hwkv-instance`` (the URL that served it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from hwkv.core.hashing import hash_token_blocks
from hwkv.engine.kv_events import KVEventSubscriber
from hwkv.serving.relay import Upstream, add_openai_routes, error, forward_headers, json_body, relay

log = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "least_loaded")


@dataclass
class Instance:
    url: str
    events: str | None = None  # KV events PUB endpoint
    replay: str | None = None  # its replay ROUTER endpoint
    sub: Any = None  # KVEventSubscriber
    inflight: int = 0
    queued: float = 0.0  # blocks its in-flight requests had to compute (uncached when routed)
    routed: int = 0
    down_until: float = 0.0
    predicted: dict[bytes, float] = field(default_factory=dict)  # hash -> expiry (monotonic)


class Router:
    """Chooses an instance per request (module docstring). Thread use: subscriber threads change the
    indexes; :meth:`choose` runs on the event loop and only reads them (set membership is atomic)."""

    def __init__(self, urls: list[str], events: list[str | None] | None = None,
                 replays: list[str | None] | None = None, *, policy: str = "cache_aware", tokenizer: Any = None,
                 balance_abs: int = 16, cpu_weight: float = 0.5, predict_ttl_s: float = 10.0, retry_s: float = 2.0,
                 load_weight: float = 0.0):
        if not urls:
            raise ValueError("the router needs at least one instance URL")
        if policy not in POLICIES:
            raise ValueError(f"policy {policy!r} is invalid (allowed: {', '.join(POLICIES)})")
        for name, v in (("kv events endpoints", events), ("kv events replay endpoints", replays)):
            if v is not None and len(v) != len(urls):
                raise ValueError(f"{len(v)} {name} for {len(urls)} instances (allowed: one per instance URL, "
                                 "in the same order)")
        if not isinstance(balance_abs, int) or balance_abs < 0:
            raise ValueError(f"balance_abs={balance_abs!r} is invalid (need an int >= 0)")
        if not 0 <= cpu_weight <= 1:
            raise ValueError(f"cpu_weight={cpu_weight!r} is invalid (need a number in [0, 1])")
        if isinstance(load_weight, bool) or not isinstance(load_weight, (int, float)) or not 0 <= load_weight <= 1e6:
            raise ValueError(f"load_weight={load_weight!r} is invalid (need a number >= 0; 0: prefix first)")
        if policy == "cache_aware" and not events:
            raise ValueError("policy cache_aware needs each instance's KV events endpoint (hwkv serve "
                             "--kv-events-endpoint); allowed without: round_robin, least_loaded")
        self.policy, self.tokenizer, self.load_weight = policy, tokenizer, float(load_weight)
        self.balance_abs, self.cpu_weight, self.predict_ttl_s, self.retry_s = balance_abs, cpu_weight, predict_ttl_s, \
            retry_s
        self.instances = [Instance(u.rstrip("/"), (events or [None] * len(urls))[i],
                                   (replays or [None] * len(urls))[i]) for i, u in enumerate(urls)]
        self._rr = itertools.count()
        self.stats = dict(requests=0, cache_routed=0, fallback_routed=0, prompt_blocks=0, matched_blocks=0.0,
                          unreachable=0, tokenize_failed=0)

    def start(self) -> None:
        """Subscribe to every instance's events (threads; :meth:`close` stops them)."""
        for inst in self.instances:
            if inst.events is not None and inst.sub is None:
                inst.sub = KVEventSubscriber(inst.events, inst.replay)

    def close(self) -> None:
        for inst in self.instances:
            if inst.sub is not None:
                inst.sub.close()
                inst.sub = None

    # ---- scoring ---------------------------------------------------------------------------------
    def block_size(self) -> int | None:
        """Tokens per block, as the instances' GPU events say (None before any event)."""
        for inst in self.instances:
            if inst.sub is not None and (bs := inst.sub.index.block_size.get("GPU")):
                return bs
        return None

    def hashes(self, tokens: list[int] | None, salt: str | None) -> list[bytes]:
        bs = self.block_size()
        if not tokens or bs is None:
            return []
        return hash_token_blocks(tokens, bs, cache_salt=salt)

    def score(self, inst: Instance, hashes: list[bytes], now: float) -> float:
        """Cached prefix of ``hashes`` on ``inst``, in blocks (host-tier blocks weighted)."""
        if inst.sub is None or not hashes:
            return 0.0
        media = inst.sub.index.media
        gpu, cpu, pred = media.get("GPU", ()), media.get("CPU", ()), inst.predicted
        n = 0.0
        for h in hashes:
            if h in gpu or pred.get(h, 0.0) > now:
                n += 1.0
            elif h in cpu:
                n += self.cpu_weight
            else:
                break
        return n

    def choose(self, hashes: list[bytes], exclude: set[int] = frozenset()) -> tuple[int, float]:  # type: ignore
        """``(instance index, score)`` for a request whose prompt hashes to ``hashes``."""
        now = time.monotonic()
        live = [i for i, x in enumerate(self.instances) if i not in exclude and x.down_until <= now]
        if not live:
            live = [i for i in range(len(self.instances)) if i not in exclude] or list(range(len(self.instances)))
        start = next(self._rr)
        order = sorted(live, key=lambda i: (i - start) % len(self.instances))  # round-robin rotation
        if self.policy == "round_robin":
            return order[0], 0.0
        loads = {i: self.instances[i].inflight for i in order}
        if self.policy == "least_loaded":
            return min(order, key=loads.__getitem__), 0.0
        lo = min(loads.values())
        cands = [i for i in order if loads[i] <= lo + self.balance_abs]
        scores = {i: self.score(self.instances[i], hashes, now) for i in cands}
        if self.load_weight > 0:  # blocks to compute here + weighted blocks queued here; min keeps the rotation
            n, lw = len(hashes), self.load_weight
            best = min(cands, key=lambda i: (n - scores[i] + lw * self.instances[i].queued, -scores[i], loads[i]))
            return best, scores[best]
        best = max(cands, key=lambda i: (scores[i], -loads[i]))  # max keeps the first of equals: the rotation
        if scores[best] <= 0:
            return min(cands, key=loads.__getitem__), 0.0
        return best, scores[best]

    def routed(self, i: int, hashes: list[bytes], score: float) -> float:
        """Count a request sent to instance ``i`` and take its blocks as cached there from now on.
        Returns the blocks it has to compute there (queued on ``i`` until :meth:`released`)."""
        inst, now = self.instances[i], time.monotonic()
        inst.inflight += 1
        work = max(0.0, len(hashes) - score)
        inst.queued += work
        inst.routed += 1
        self.stats["requests"] += 1
        self.stats["cache_routed" if score > 0 else "fallback_routed"] += 1
        self.stats["prompt_blocks"] += len(hashes)
        self.stats["matched_blocks"] += score
        if self.policy == "cache_aware" and hashes:
            pred, expiry = inst.predicted, now + self.predict_ttl_s
            if len(pred) > 1 << 16:  # drop the expired ones now and then
                for h in [h for h, t in pred.items() if t <= now]:
                    del pred[h]
            for h in hashes:
                pred[h] = expiry
        return work

    def released(self, i: int, work: float) -> None:
        """A request routed to ``i`` (``work``: what :meth:`routed` returned) ended or failed."""
        inst = self.instances[i]
        inst.inflight -= 1
        inst.queued = max(0.0, inst.queued - work)

    # ---- prompts -------------------------------------------------------------------------------
    def prompt_tokens(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the server computes them (None: cannot tell; the request is routed
        without a cache score)."""
        tok = self.tokenizer
        special = body.get("add_special_tokens")
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if tok is None or not isinstance(messages, list):
                return None
            text = tok.apply_chat_template(messages, body.get("add_generation_prompt", True),
                                           template=body.get("chat_template"), tools=body.get("tools"),
                                           **(body.get("chat_template_kwargs") or {}))
            return tok.encode(text, add_special_tokens=bool(special))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]  # a batch goes to one instance: route by its first prompt
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and tok is not None:
            return tok.encode(prompt, add_special_tokens=special is not False)
        return None

    def summary(self) -> dict[str, Any]:
        s = dict(self.stats)
        s["policy"], s["load_weight"] = self.policy, self.load_weight
        s["matched_fraction"] = s["matched_blocks"] / s["prompt_blocks"] if s["prompt_blocks"] else 0.0
        s["instances"] = [{"url": x.url, "inflight": x.inflight, "queued_blocks": x.queued, "routed": x.routed,
                           "events": x.events is not None,
                           "ready": x.sub is not None and x.sub.next_seq is not None,
                           "gpu_blocks": len(x.sub.index.hashes("GPU")) if x.sub is not None else 0,
                           "cpu_blocks": len(x.sub.index.hashes("CPU")) if x.sub is not None else 0}
                          for x in self.instances]
        return s


def build_router(router: Router, timeout_s: float = 600.0) -> FastAPI:
    """The router's HTTP app: ``/v1/completions``, ``/v1/chat/completions`` (streamed or not, passed
    through), ``/v1/models``, ``/health``, ``/router/stats``."""
    timeout = httpx.Timeout(timeout_s, connect=min(5.0, timeout_s))
    upstream = Upstream(timeout)
    client = upstream.client

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        router.start()
        try:
            yield
        finally:
            router.close()
            await upstream.aclose()

    app = FastAPI(title="hwkv router", lifespan=lifespan)

    async def handle(request: Request, path: str) -> Response:
        body = await json_body(request)
        if not isinstance(body, dict):
            return body
        hashes: list[bytes] = []
        if router.policy == "cache_aware":
            try:
                tokens = await asyncio.to_thread(router.prompt_tokens, path, body)
                hashes = router.hashes(tokens, body.get("cache_salt"))
            except Exception as e:  # the server names what is wrong with the prompt; route it anyway
                router.stats["tokenize_failed"] += 1
                log.debug("router: prompt not tokenized (%s): routed without a cache score", e)
        tried: set[int] = set()
        while True:
            i, score = router.choose(hashes, tried)
            inst = router.instances[i]
            tried.add(i)
            work = router.routed(i, hashes, score)  # before the send: requests arriving meanwhile follow this one
            done = True
            try:
                release = functools.partial(router.released, i, work)
                resp = await send(inst, path, body, forward_headers(request), release)
                if resp is not None:
                    if isinstance(resp, StreamingResponse):
                        done = False  # the relay releases the instance when the stream ends
                    resp.headers["x-hwkv-instance"] = inst.url
                    return resp
            finally:
                if done:
                    router.released(i, work)
            inst.down_until = time.monotonic() + router.retry_s
            router.stats["unreachable"] += 1
            if len(tried) == len(router.instances):
                return error(503, f"no instance is reachable (tried {', '.join(x.url for x in router.instances)})")

    async def send(inst: Instance, path: str, body: dict[str, Any], hdrs: dict[str, str],
                   release: Any) -> Response | None:
        """The instance's answer, passed through; None when it cannot be reached (try another)."""
        url = f"{inst.url}{path}"
        req = client().build_request("POST", url, json=body, headers=hdrs)
        try:
            r = await client().send(req, stream=bool(body.get("stream")))
        except httpx.TimeoutException:
            return error(503, f"instance {inst.url} did not answer within {timeout_s:g} s")
        except httpx.HTTPError:
            return None
        if not body.get("stream") or r.status_code >= 400:
            content = await r.aread()
            await r.aclose()
            return Response(content, r.status_code, media_type=r.headers.get("content-type"))
        return relay(r, f"instance {inst.url}", on_end=release)  # the stream ended, failed or its client left

    add_openai_routes(app, handle)

    @app.get("/health")
    async def health() -> Response:
        bad = await upstream.unhealthy([inst.url for inst in router.instances])
        return error(503, f"unhealthy: {', '.join(bad)}") if len(bad) == len(router.instances) else \
            Response(status_code=200)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        for inst in router.instances:
            try:
                r = await client().get(f"{inst.url}/v1/models", headers=forward_headers(request))
            except httpx.HTTPError:
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        return error(503, "no instance is reachable")

    @app.get("/router/stats")
    async def stats() -> dict[str, Any]:
        return router.summary()

    return app
