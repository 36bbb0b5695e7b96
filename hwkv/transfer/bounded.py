"""Blocking vendor calls run on worker threads, so a caller waits at most its timeout.

Mooncake's batch calls release the GIL, so while one waits on a hung peer the rest of the
interpreter keeps running; what they lack is a bound (a hung master costs a 30 s RPC deadline
per call, a dead one 4-9 s of reconnect attempts). :class:`BoundedCalls` gives every call a
deadline: the caller gets :class:`CallTimedOut` when it passes. A call that already started cannot
be cancelled — it finishes (or fails) on its worker later; :meth:`BoundedCalls.orphans` counts
those, and :meth:`BoundedCalls.wait_orphans` waits for them. A call still queued behind stuck ones
when its deadline passes is cancelled and never runs.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any


class CallTimedOut(Exception):
    """The deadline passed; ``started`` says whether the call is still running on its worker."""

    def __init__(self, started: bool):
        super().__init__("started" if started else "never started")
        self.started = started


class BoundedCalls:
    """Up to ``workers`` daemon threads (started on demand) running calls submitted by :meth:`run`."""

    def __init__(self, name: str, workers: int = 4):
        self.name = name
        self._max = workers
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._idle = 0  # workers waiting on the queue
        self._queued = 0  # calls in the queue, not taken by a worker yet
        self._running = 0  # calls started and not finished
        self._orphans = 0  # of those, calls whose caller timed out
        self._cond = threading.Condition()

    def run(self, fn: Callable[..., Any], *args: Any, timeout_s: float) -> Any:
        """``fn(*args)`` on a worker; its result or exception, or :class:`CallTimedOut` after ``timeout_s``."""
        fut: Future = Future()
        with self._cond:
            self._queued += 1
            if self._queued > self._idle and len(self._threads) < self._max:  # no idle worker left for it
                t = threading.Thread(target=self._work, name=f"{self.name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
            self._queue.put((fut, fn, args))
        try:
            return fut.result(timeout_s)
        except FutureTimeout:
            if fut.cancel():
                raise CallTimedOut(started=False) from None
            if fut.done():  # finished between the timeout and the cancel
                return fut.result()
            with self._cond:
                self._orphans += 1
            fut.add_done_callback(self._orphan_done)  # runs at once if it finished meanwhile
            raise CallTimedOut(started=True) from None

    def _orphan_done(self, _fut: Future) -> None:
        with self._cond:
            self._orphans -= 1
            self._cond.notify_all()

    def _work(self) -> None:
        while True:
            with self._cond:
                self._idle += 1
            item = self._queue.get()
            with self._cond:
                self._idle -= 1
                if item is None:  # shutdown
                    self._threads.remove(threading.current_thread())
                    return
                self._queued -= 1
                fut, fn, args = item
                if not fut.set_running_or_notify_cancel():
                    continue
                self._running += 1
            try:
                fut.set_result(fn(*args))
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            finally:
                with self._cond:
                    self._running -= 1
                    self._cond.notify_all()

    def in_flight(self) -> int:
        """Calls started and not finished (those whose caller timed out included)."""
        with self._cond:
            return self._running

    def orphans(self) -> int:
        """Calls still running whose caller timed out."""
        with self._cond:
            return self._orphans

    def wait_orphans(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no call whose caller timed out runs; whether none does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._orphans == 0, timeout_s)

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no call runs; whether none does."""
        with self._cond:
            return self._cond.wait_for(lambda: self._running == 0, timeout_s)

    def shutdown(self) -> None:
        """Let every worker exit once its current call (if any) returned; queued calls run first.
        Does not wait."""
        with self._cond:
            for _ in self._threads:
                self._queue.put(None)

    def workers(self) -> int:
        with self._cond:
            return len(self._threads)
