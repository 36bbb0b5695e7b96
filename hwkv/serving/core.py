"""EngineCore: the scheduler + model runner in their own process, busy-looping on work.

Started by :class:`hwkv.serving.client.CoreClient` as ``python -m hwkv.serving.core CONFIG_JSON``
(a fresh interpreter: no fork of a process holding threads, an event loop or a device context).
It builds an :class:`hwkv.Engine` with detokenization off, reports ``Ready`` and then loops:
drain the input socket (blocking only while idle), ``step()``, send each request's new token ids.
Tokenizing, detokenizing, stop strings and output assembly stay in the front end, so the core's
host time goes to scheduling and the model. An error in a step is fatal: the core reports ``Dead``
with the traceback and exits (the front end then fails every pending request); it also exits when
its parent process is gone, so a killed server leaves no engine behind.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from typing import Any

import zmq

from hwkv.engine import Engine
from hwkv.serving import messages as m

IDLE_POLL_MS = 1000  # while idle: how often the parent-alive check (and a heartbeat) runs
STATS_INTERVAL_S = 0.25
HEARTBEAT_S = 1.0  # with nothing else sent for this long the core sends a Heartbeat (front end: /health)
# Engine.step() contains a failure (rolls back, isolates the requests to blame) and raises; raising
# this many times in a row means it cannot make progress: every request it holds then fails.
MAX_STEP_FAILURES = 3


class EngineCore:
    def __init__(self, cfg: m.CoreConfig):
        self.cfg = cfg
        # by name: a tensor-parallel engine builds one connector per rank from the name and config
        kw = dict(cfg.engine_kwargs)
        if kw.get("usage_context") is None:  # a server's defaults (engine/defaults.py): shorter prefill chunks
            kw["usage_context"] = "server"
        self.engine = Engine(cfg.model, kv_connector=cfg.kv_connector,
                             kv_connector_config=cfg.kv_connector_config or None, **kw)
        self.default_params = self.engine.default_sampling_params()
        # The front end detokenizes: without a tokenizer the engine's detokenizer is a no-op.
        self.engine.tokenizer = None
        self.num_sent: dict[str, int] = {}  # output tokens already sent, per request (= the live ones)
        self.last_stats = 0.0
        self.failures = 0  # consecutive step() exceptions

    def ready(self) -> m.Ready:
        e = self.engine
        return m.Ready(
            model=self.cfg.model, backend=e.backend.name, device=e.backend.device.description(),
            vocab_size=e.vocab_size, max_model_len=e.max_model_len, block_size=e.block_size,
            num_kv_blocks=e.kv_cache.spec.num_blocks, eos_token_ids=sorted(e.eos_token_ids),
            default_params=self.default_params, kv_connector=self.cfg.kv_connector,
            scheduling_policy=e.scheduler.config.scheduling_policy, pid=os.getpid(),
        )

    def handle(self, msg: Any, out: list[m.CoreOutput], replies: list[m.UtilityResult]) -> bool:
        """Apply one input message; False on Shutdown."""
        if isinstance(msg, m.AddRequest):
            try:
                self.engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, msg.priority)
                self.num_sent[msg.request_id] = 0
            except ValueError as e:  # the front end validated; this is a race (id reuse) or a bug
                out.append(m.CoreOutput(msg.request_id, [], "rejected", error=str(e)))
        elif isinstance(msg, m.Abort):
            self.engine.abort(msg.request_ids)
        elif isinstance(msg, m.Utility):
            if msg.name == "stats":
                replies.append(m.UtilityResult(msg.call_id, self.stats()))
            else:
                replies.append(m.UtilityResult(msg.call_id, error=f"unknown utility {msg.name!r} (allowed: stats)"))
        elif isinstance(msg, m.Shutdown):
            return False
        return True

    def step(self) -> list[m.CoreOutput]:
        """One engine step → each live request's new tokens. A step that raises is logged and
        retried (the engine has rolled it back); after ``MAX_STEP_FAILURES`` in a row every live
        request finishes with ``"error"`` and the exception's message, and the core carries on."""
        try:
            step_outputs = self.engine.step()
        except Exception as e:
            self.failures += 1
            traceback.print_exc(file=sys.stderr)
            if self.failures < MAX_STEP_FAILURES:
                return []
            self.failures = 0
            why = f"the engine failed {MAX_STEP_FAILURES} steps in a row: {type(e).__name__}: {e}"
            ids, self.num_sent = list(self.num_sent), {}
            self.engine.abort(ids)  # frees their blocks; the abort outputs are dropped (no longer live)
            return [m.CoreOutput(rid, [], "error", error=why) for rid in ids]
        self.failures = 0
        outs = []
        for o in step_outputs:
            sent = self.num_sent.get(o.request_id)
            if sent is None:  # failed above, its abort output arrives now
                continue
            new = o.token_ids[sent:]
            lps = o.logprobs[sent:] if o.logprobs is not None else None
            plps = o.prompt_logprobs if sent == 0 and new else None
            if o.finished:
                self.num_sent.pop(o.request_id, None)
            else:
                self.num_sent[o.request_id] = len(o.token_ids)
            stop = o.stop_reason if isinstance(o.stop_reason, int) else None
            outs.append(m.CoreOutput(o.request_id, new, o.finish_reason, stop, o.metrics.num_cached_tokens,
                                     o.metrics.num_preemptions, lps, o.error,
                                     o.kv_transfer_params if o.finished else None, plps))
        return outs

    def stats(self) -> dict[str, Any]:
        """``Engine.stats()``, plus ``"connector"``: the numeric ``stats()["kv_connector"]`` counters
        (external_hit_tokens, loaded/stored bytes, load_failures and the connector's own)."""
        st = self.engine.stats()
        if "kv_connector" in st:
            st["connector"] = {k: v for k, v in st["kv_connector"].items() if k != "name"}
        return st

    def maybe_stats(self, force: bool = False) -> dict[str, Any] | None:
        now = time.monotonic()
        if not force and now - self.last_stats < STATS_INTERVAL_S:
            return None
        self.last_stats = now
        return self.stats()


def run(cfg: m.CoreConfig) -> int:
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    inp.connect(cfg.input_addr)
    out = ctx.socket(zmq.PUSH)
    out.setsockopt(zmq.LINGER, 2000)
    out.setsockopt(zmq.SNDHWM, 0)  # never block a step on the front end (it reads continuously)
    out.connect(cfg.output_addr)
    try:
        try:
            core = EngineCore(cfg)
        except Exception as e:  # a bad option, a missing model, an unavailable backend: say which
            out.send(m.encode(m.Failed(f"{type(e).__name__}: {e}")))
            return 1
        try:
            out.send(m.encode(core.ready()))
            return _loop(core, cfg, inp, out)
        finally:  # on every exit (Shutdown, orphaned, SIGTERM, Dead): workers, connector threads/sockets
            _begin_unwinding()
            try:
                core.engine.close()
            except Exception:
                traceback.print_exc(file=sys.stderr)
    finally:  # the output socket lingers: the last message (Failed, Dead) still reaches the front end
        inp.close(0)
        out.close()
        ctx.term()
        # Orphaned (SIGTERM is also the parent-death signal; getppid may not show it yet):
        # nobody else will remove the sockets' directory. After the client's own SIGTERM it does
        # too, harmlessly.
        if _terminated or os.getppid() != cfg.parent_pid:
            _remove_socket_dir(cfg.input_addr)


def _loop(core: EngineCore, cfg: m.CoreConfig, inp: Any, out: Any) -> int:
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    last_sent = time.monotonic()
    try:
        while True:
            busy = core.engine.has_unfinished()
            outs: list[m.CoreOutput] = []
            replies: list[m.UtilityResult] = []
            events = poller.poll(0 if busy else IDLE_POLL_MS)
            alive = True
            while events and alive:  # drain everything queued, without waiting
                alive = core.handle(m.to_core.decode(inp.recv()), outs, replies)
                events = poller.poll(0)
            if not alive:
                return 0
            if os.getppid() != cfg.parent_pid:  # orphaned: the front end is gone
                _begin_unwinding()  # the parent-death SIGTERM is on its way: it must not cut the clean-up
                return 0
            if core.engine.has_unfinished():
                outs.extend(core.step())
            for r in replies:
                out.send(m.encode(r))
            if outs or replies:
                out.send(m.encode(m.StepOutputs(outs, core.maybe_stats(force=not core.engine.has_unfinished()))))
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent >= HEARTBEAT_S:
                out.send(m.encode(m.Heartbeat()))
                last_sent = time.monotonic()
    except Exception as e:
        out.send(m.encode(m.Dead(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")))
        return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = _json_config(argv[0])
    # Ctrl-C reaches the whole process group: the front end shuts the core down, not the signal.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _on_sigterm)
    _die_with_parent(cfg.parent_pid)
    return run(cfg)


def _json_config(text: str) -> m.CoreConfig:
    import msgspec

    return msgspec.json.decode(text, type=m.CoreConfig)


_terminated = False
_unwinding = False


def _begin_unwinding() -> None:
    global _unwinding
    _unwinding = True


def _on_sigterm(*_: Any) -> None:
    """Unwind (sockets closed, the socket directory removed) instead of dying mid-flight.

    Once the core is already unwinding (the loop saw its parent gone, or returned), a SIGTERM only
    marks it: raising again would cut the clean-up short (e.g. between closing the sockets and
    removing their directory - the parent-death signal races the loop's own orphan check).
    """
    global _terminated
    _terminated = True
    if not _unwinding:
        sys.exit(0)


def _remove_socket_dir(addr: str) -> None:
    """The private directory ``CoreClient`` made for the IPC sockets (and only that)."""
    import shutil
    import tempfile

    d = os.path.dirname(addr.removeprefix("ipc://"))
    if os.path.basename(d).startswith("hwkv-core-") and os.path.dirname(d) == tempfile.gettempdir():
        shutil.rmtree(d, ignore_errors=True)


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGTERM when the parent dies (also covers a SIGKILLed server mid-step)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # it died before prctl took effect
        os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
