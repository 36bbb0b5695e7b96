"""Device-runtime mutants: graphs and streams, on host devices that make their bugs observable.

The reference device is synchronous and has no graphs, so a stream-ordering or graph bug cannot
show on it. Two host devices emulate what a GPU/NPU runtime does, closely enough for the suite's
runtime tests to see such bugs:

* :class:`GraphDevice`: graphs recorded and replayed op by op (:mod:`hwkv.reference.graphs`), the
  backend declaring ``graph_capture`` with a capture-safe ``write_kv``. A replay re-runs the ops on
  the *current* contents of the captured tensors, as a real replay does.
* :class:`LazyStreamDevice`: work issued inside ``stream_context(side)`` is *computed* at once on
  shadow tensors but lands in the tensors the caller sees only when something orders it: an event
  recorded on that stream and then waited on or synchronized, ``stream.synchronize()``,
  ``wait_stream`` or ``device.synchronize()``. Until then those tensors hold NaN (or their old
  contents, for in-place work), which is what a read racing a still-running stream returns.

Each control (the same device without a bug) passes the runtime tests; each mutant carries one
mistake a vendor port makes (stale graph inputs, a graph pool released by ``empty_cache``, an event
recorded on the wrong stream, a wait that orders nothing).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from conformance.mutants.base import MutantBackend, mutant
from hwkv.reference.device import CpuDevice, CpuEvent, CpuStream
from hwkv.reference.graphs import RecordedGraph, RecordingCpuDevice, StaticAttentionImpl

GRAPH = ("test_graph_replay_reads_inputs_in_place",)
FORK = ("test_graph_captures_side_stream_fork_join",)
EVENT = ("test_event_on_side_stream",)
STAGING = ("test_host_staging",)


def _written(func: Any) -> set[int]:
    """Positions of the arguments ``func`` writes (in-place and ``out=`` ops)."""
    return {i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write}


# -- graphs ----------------------------------------------------------------------------------------
class GraphDevice(RecordingCpuDevice):
    graph_cls: type[RecordedGraph] = RecordedGraph

    def capture_graph(self, fn: Callable[[], Any], pool: Any, stream: Any) -> tuple[RecordedGraph, Any]:
        g = self.graph_cls()
        with g:
            out = fn()
        self.captured.append(g)
        return g, out


class _SnapshotGraph(RecordedGraph):
    """BUG: every tensor the capture only reads is copied into a graph-owned buffer at capture time
    (as a graph mode that needs its inputs registered does); replays read those copies."""

    def __init__(self) -> None:
        super().__init__()
        self._copies: dict[int, torch.Tensor] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = super().__torch_dispatch__(func, types, args, kwargs)
        written = _written(func)
        produced = {id(t) for _, _, _, outs in self.ops[:-1] for t in outs}
        f, a, kw, outs = self.ops[-1]
        snap = lambda t: self._copies.setdefault(id(t), t.clone()) if id(t) not in produced else t  # noqa: E731
        a = tuple(x if i in written or not isinstance(x, torch.Tensor) else snap(x) for i, x in enumerate(a))
        self.ops[-1] = (f, a, kw, outs)
        return out


class _ReleasedPoolDevice(GraphDevice):
    """BUG: ``empty_cache`` hands the live graphs' memory pool back to the allocator; the next owner's
    data (here 7.0) is what a replay's outputs then hold."""

    def empty_cache(self) -> None:
        for g in self.captured:
            g.released = True

    class graph_cls(RecordedGraph):  # noqa: N801
        released = False

        def replay(self) -> None:
            super().replay()
            if self.released:
                for _, _, _, outs in self.ops:
                    for t in outs:
                        if t.is_floating_point():
                            t.fill_(7.0)


def graph_backend(name: str, device: type | None = None) -> MutantBackend:
    """The reference backend whose device captures graphs (``device``, default: emulated graphs with
    lazy side streams) and whose ``write_kv`` survives a capture (no host reads)."""
    return MutantBackend(f"mutant-{name}", impl=StaticAttentionImpl, device=device or LazyGraphDevice,
                         caps={"graph_capture": True}, spec=None)


# -- lazy streams ----------------------------------------------------------------------------------
class LazyStream(CpuStream):
    def __init__(self, device: LazyStreamDevice) -> None:
        self.device = device
        self.queue: list[tuple[torch.Tensor, torch.Tensor]] = []  # (what the caller sees, its value)
        self.done = 0  # queue entries landed

    def flush(self, upto: int | None = None) -> None:
        upto = len(self.queue) if upto is None else upto
        for visible, value in self.queue[self.done : upto]:
            visible.copy_(value)
            self.device.shadow.pop(id(visible), None)
        self.done = max(self.done, upto)

    def synchronize(self) -> None:
        self.flush()

    def query(self) -> bool:
        return self.done == len(self.queue)

    def wait_event(self, event: CpuEvent) -> None:
        event.synchronize()

    def wait_stream(self, stream: CpuStream) -> None:
        if isinstance(stream, LazyStream):
            stream.flush()

    def record_event(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event or self.device.new_event()
        event.record(self)
        return event


class LazyEvent(CpuEvent):
    def __init__(self, device: LazyStreamDevice, enable_timing: bool = False) -> None:
        super().__init__(enable_timing)
        self.device = device
        self.mark: tuple[LazyStream, int] | None = None

    def record(self, stream: CpuStream | None = None) -> None:
        super().record(stream)
        s = stream if isinstance(stream, LazyStream) else None
        self.mark = (s, len(s.queue)) if s is not None else None

    def query(self) -> bool:
        return self.mark is None or self.mark[0].done >= self.mark[1]

    def synchronize(self) -> None:
        if self.mark is not None:
            self.mark[0].flush(self.mark[1])

    def wait(self, stream: CpuStream | None = None) -> None:
        self.synchronize()


class _Issue(TorchDispatchMode):
    """Ops issued on a side stream: computed now on shadows, visible when the stream is ordered."""

    def __init__(self, stream: LazyStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        shadow = self.stream.device.shadow
        real = lambda x: shadow.get(id(x), (None, x))[1] if isinstance(x, torch.Tensor) else x  # noqa: E731
        written = [a for i, a in enumerate(args) if i in _written(func) and isinstance(a, torch.Tensor)]
        for t in written:  # in-place work on a tensor the caller sees: done on a copy, lands later
            if id(t) not in shadow:
                shadow[id(t)] = (t, t.clone())
        out = func(*tree_map(real, args), **tree_map(real, kwargs or {}))
        back = {id(v): vis for vis, v in shadow.values()}

        def visible(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            if id(v) in back:  # an in-place op returned its (shadowed) argument
                vis = back[id(v)]
            else:
                vis = torch.full_like(v, float("nan")) if v.is_floating_point() else torch.zeros_like(v)
                shadow[id(vis)] = (vis, v)
            self.stream.queue.append((vis, v))
            return vis

        flat, _ = tree_flatten(out)
        return tree_map(visible, out) if flat else out


class LazyStreamDevice(CpuDevice):
    event_cls: type[LazyEvent] = LazyEvent
    default_stream_cls: type[LazyStream] = LazyStream

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self.shadow: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(visible) -> (visible, value)
        self.streams: list[LazyStream] = []
        self._default_stream = self.default_stream_cls(self)  # eager: its work is done when issued

    def new_stream(self) -> LazyStream:
        s = LazyStream(self)
        self.streams.append(s)
        return s

    @contextlib.contextmanager
    def _issue(self, stream: LazyStream) -> Iterator[None]:
        with _Issue(stream):
            yield

    def stream_context(self, stream: CpuStream) -> Any:
        lazy = isinstance(stream, LazyStream) and stream is not self._default_stream
        return self._issue(stream) if lazy else contextlib.nullcontext()

    def new_event(self, enable_timing: bool = False) -> LazyEvent:
        return self.event_cls(self, enable_timing)

    def synchronize(self) -> None:
        for s in self.streams:
            s.flush()


class _EventOnCurrentStream(LazyEvent):
    """BUG: ``record(stream)`` records on the current stream, not on ``stream``."""

    def record(self, stream: CpuStream | None = None) -> None:
        super().record(None)


class _WaitIgnored(LazyStream):
    """BUG: ``wait_event`` orders nothing (only the host-side ``event.synchronize`` waits)."""

    def wait_event(self, event: CpuEvent) -> None:
        return None


class _NoWaitDevice(LazyStreamDevice):
    default_stream_cls = _WaitIgnored


class LazyGraphDevice(LazyStreamDevice, GraphDevice):
    """Lazy side streams and emulated graphs together: a capture records the side stream's work, the
    NaN refills of what the caller sees and the copies each captured wait lands, in issue order."""


class _CapturingGraph(RecordedGraph):
    capturing: list[bool] = [False]

    def __enter__(self) -> Any:
        self.capturing[0] = True
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        self.capturing[0] = False
        return super().__exit__(*exc)


class _WaitNotCaptured(LazyStream):
    """BUG: inside a capture ``wait_event`` is left out of the graph (ordering only at eager time): the
    side stream's result lands when the host next synchronizes, never in a replay."""

    def wait_event(self, event: CpuEvent) -> None:
        if not _CapturingGraph.capturing[0]:
            super().wait_event(event)


class _NoCapturedWaitDevice(LazyGraphDevice):
    default_stream_cls = _WaitNotCaptured
    graph_cls = _CapturingGraph


class AsyncHostCopyDevice(LazyStreamDevice):
    """``to_host_async`` as a GPU runtime does it: the copy runs on a copy stream (lazy: it lands when
    ordered) into a fresh host buffer, and the returned event is recorded on that stream after it.
    The buffer starts as NaN: what a read racing the copy sees."""

    early = False  # the bug of host-copy-event-early

    def to_host_async(self, t: torch.Tensor) -> tuple[torch.Tensor, LazyEvent]:
        if not hasattr(self, "_copy_stream"):
            self._copy_stream = self.new_stream()
        s, event = self._copy_stream, self.new_event()
        host = torch.full_like(t, float("nan")) if t.is_floating_point() else torch.zeros_like(t)
        if self.early:  # BUG: the event is recorded when the copy is queued, before the copy itself
            event.record(s)
        with self.stream_context(s):
            host.copy_(t)
        if not self.early:
            event.record(s)
        return host, event


def lazy_backend(name: str, device: type = LazyStreamDevice) -> MutantBackend:
    return MutantBackend(f"mutant-{name}", device=device, spec=None)


def _event_device(cls: type[LazyEvent]) -> type[LazyStreamDevice]:
    return type("LazyStreamDevice_event", (LazyStreamDevice,), {"event_cls": cls})


mutant("graph-stale-inputs", "device", "graph replays read copies of their inputs taken at capture (stale after an "
       "in-place update)", GRAPH, impl=StaticAttentionImpl,
       device=type("GraphDevice_snapshot", (GraphDevice,), {"graph_cls": _SnapshotGraph}), caps={"graph_capture": True})
mutant("graph-pool-freed-by-empty-cache", "device", "empty_cache with live graphs releases their memory pool (the "
       "next owner's data shows in a replay's outputs)", GRAPH, impl=StaticAttentionImpl, device=_ReleasedPoolDevice,
       caps={"graph_capture": True})
mutant("event-records-current-stream", "device", "event.record(stream) records on the current stream, not the "
       "given one", EVENT, device=_event_device(_EventOnCurrentStream))
mutant("wait-event-orders-nothing", "device", "current_stream().wait_event(e) returns without ordering the "
       "stream behind e", EVENT, device=_NoWaitDevice)
mutant("graph-wait-not-captured", "device", "a wait_event issued during a capture is not recorded into the graph "
       "(a side stream's fork/join is unordered on replay)", FORK, impl=StaticAttentionImpl,
       device=_NoCapturedWaitDevice, caps={"graph_capture": True})
mutant("host-copy-event-early", "device", "to_host_async records its event before the copy on the copy stream: "
       "the event fires while the host buffer still holds stale data", STAGING,
       device=type("AsyncHostCopyDevice_early", (AsyncHostCopyDevice,), {"early": True}))
