"""ACL graphs for the torch_npu emulator (tests only): ``NPUGraph`` capture/replay, task groups and
task updates, ``ExternalEvent``, as the docs describe them, with the property that matters — a
captured op's *host* arguments are frozen at capture:

* [GRAPH-doc] Ascend/op-plugin ``docs/context/torch_npu-npu-graph_task_group_begin.md`` (and
  ``_end``, ``graph_task_update_begin``/``_end``): ``graph_task_group_begin(stream)`` /
  ``graph_task_group_end(stream) -> handle`` bracket ops during capture; outside capture,
  ``graph_task_update_begin(stream, handle)``, the same op re-issued (``.out`` variant, same
  workspace and outputs, new host arguments), ``graph_task_update_end(stream)`` rewrite that task;
  the captured graph waits on an ``ExternalEvent`` the update stream records.
* [ACLGRAPH] vllm-project/vllm-ascend ``vllm_ascend/compilation/acl_graph.py`` ``update_attn_params``:
  FIA's ``actual_seq_lengths(_kv)`` lists and ATB paged attention's host ``context_lens`` are
  re-bound per replay this way; without it a replay computes with the capture's lengths.

Emulation: each torch_npu op launched during capture becomes one task (run once, then re-run on
replay with the *frozen* host arguments — lists copied, host tensors cloned — and the live device
tensors); other torch ops are recorded by :class:`hwkv.reference.graphs.RecordedGraph`. A replay whose
graph waits on an ``ExternalEvent`` that nobody recorded since the last replay raises (a real one
would block forever).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from hwkv.reference.graphs import RecordedGraph

# host arguments each op reads at launch (frozen into a captured task) [ACLGRAPH]
HOST_ARGS = {
    "npu_fused_infer_attention_score": ("actual_seq_lengths", "actual_seq_lengths_kv"),
    "npu_fused_infer_attention_score.out": ("actual_seq_lengths", "actual_seq_lengths_kv"),
    "_npu_paged_attention": ("context_lens",),
}
# arguments a task update must pass unchanged (the graph's other tasks read these buffers) [GRAPH-doc]
SAME_ON_UPDATE = ("out", "workspace", "query", "key_cache", "value_cache", "key", "value", "block_table")


class GraphError(RuntimeError):
    """What torch_npu / ACL report for a misuse of graph capture or task update."""


def _freeze(name: str, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    host = HOST_ARGS.get(name, ())
    frozen = {}
    for k, v in kwargs.items():
        if k in host:
            v = v.clone() if isinstance(v, torch.Tensor) else list(v)
        frozen[k] = v
    return tuple(args), frozen


class Task:
    """One op launch inside a graph: ``fn`` with the arguments it was captured (or last updated) with."""

    def __init__(self, name: str, fn: Callable, args: tuple, kwargs: dict):
        self.name, self.fn = name, fn
        self.args, self.kwargs = _freeze(name, args, kwargs)
        self.updates = 0

    def __call__(self) -> Any:
        return self.fn(*self.args, **self.kwargs)

    def update(self, name: str, args: tuple, kwargs: dict) -> None:
        if name != self.name:
            raise GraphError(f"graph task update: the task group captured {self.name}, the update issued {name}")
        for k in SAME_ON_UPDATE:
            old, new = self.kwargs.get(k), kwargs.get(k)
            flat_old = [t for t in tree_flatten(old)[0] if isinstance(t, torch.Tensor)]
            flat_new = [t for t in tree_flatten(new)[0] if isinstance(t, torch.Tensor)]
            if [t.data_ptr() for t in flat_old] != [t.data_ptr() for t in flat_new]:
                raise GraphError(f"graph task update of {name}: {k!r} is not the tensor the task captured")
        self.args, self.kwargs = _freeze(name, args, kwargs)
        self.updates += 1


class TaskGroup:
    """The handle ``graph_task_group_end`` returns."""

    def __init__(self) -> None:
        self.tasks: list[Task] = []


class Runtime:
    """Capture / update state of one emulated device (single stream semantics, synchronous)."""

    def __init__(self) -> None:
        self.capturing: RecordedGraph | None = None
        self.capture_stream: Any = None
        self.group: TaskGroup | None = None
        self.updating: TaskGroup | None = None
        self.update_pos = 0
        self.current: Any = None

    # -- ops ------------------------------------------------------------------------------------

    def wrap(self, name: str, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def op(*args: Any, **kwargs: Any) -> Any:
            if self.updating is not None:
                group = self.updating
                if self.update_pos >= len(group.tasks):
                    raise GraphError("graph task update issued more ops than the task group captured")
                group.tasks[self.update_pos].update(name, args, kwargs)
                self.update_pos += 1
                return None
            if self.capturing is None:
                return fn(*args, **kwargs)
            task = Task(name, fn, args, kwargs)
            with _disable_current_modes():
                out = task()
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            self.capturing.ops.append((task, (), {}, outs))
            if self.group is not None:
                self.group.tasks.append(task)
            return out

        return op

    # -- torch_npu.npu graph API ----------------------------------------------------------------

    @contextlib.contextmanager
    def graph(self, g: RecordedGraph, pool: Any = None, stream: Any = None) -> Iterator[None]:
        if self.capturing is not None:
            raise GraphError("graph capture is already in progress")
        self.capturing, self.capture_stream = g, stream
        try:
            with self.stream(stream), g:
                yield
        finally:
            self.capturing, self.capture_stream = None, None
        if self.group is not None:
            raise GraphError("graph_task_group_begin without graph_task_group_end in the capture")

    def is_current_stream_capturing(self) -> bool:
        return self.capturing is not None

    def graph_task_group_begin(self, stream: Any) -> None:
        if self.capturing is None:
            raise GraphError("graph_task_group_begin outside a graph capture")
        if self.group is not None:
            raise GraphError("graph_task_group_begin inside an open task group")
        self.group = TaskGroup()

    def graph_task_group_end(self, stream: Any) -> TaskGroup:
        if self.group is None or self.capturing is None:
            raise GraphError("graph_task_group_end without graph_task_group_begin")
        group, self.group = self.group, None
        if not group.tasks:
            raise GraphError("empty task group: no op was launched between begin and end")
        return group

    def graph_task_update_begin(self, stream: Any, handle: TaskGroup) -> None:
        if self.capturing is not None:
            raise GraphError("graph_task_update_begin during a capture")
        if not isinstance(handle, TaskGroup):
            raise GraphError(f"graph_task_update_begin: handle must come from graph_task_group_end, got {handle!r}")
        if self.updating is not None:
            raise GraphError("graph_task_update_begin inside an open update")
        self.updating, self.update_pos = handle, 0

    def graph_task_update_end(self, stream: Any) -> None:
        if self.updating is None:
            raise GraphError("graph_task_update_end without graph_task_update_begin")
        n, want = self.update_pos, len(self.updating.tasks)
        self.updating = None
        if n != want:
            raise GraphError(f"graph task update re-issued {n} of the group's {want} ops")

    @contextlib.contextmanager
    def stream(self, s: Any) -> Iterator[None]:
        prev, self.current = self.current, (s if s is not None else self.current)
        try:
            yield
        finally:
            self.current = prev

    def external_event(self) -> ExternalEvent:
        return ExternalEvent(self)


class ExternalEvent:
    """``torch.npu.ExternalEvent``: ``wait``/``reset`` captured into a graph; ``record`` on a stream."""

    def __init__(self, rt: Runtime):
        self.rt, self.recorded = rt, False

    def _in_graph(self, fn: Callable[[], None]) -> None:
        if self.rt.capturing is None:
            fn()
        else:
            self.rt.capturing.ops.append((_Call(fn), (), {}, []))

    def wait(self, stream: Any = None) -> None:
        def check() -> None:
            if not self.recorded:
                raise GraphError("replay blocks: the graph waits on an ExternalEvent nobody recorded since the "
                                 "last replay (a missing graph task update)")
        if self.rt.capturing is not None:  # the capture itself does not wait
            self.rt.capturing.ops.append((_Call(check), (), {}, []))

    def reset(self, stream: Any = None) -> None:
        self._in_graph(lambda: setattr(self, "recorded", False))

    def record(self, stream: Any = None) -> None:
        if self.rt.capturing is not None:
            raise GraphError("ExternalEvent.record inside a capture")
        self.recorded = True


class _Call:
    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


def _fia_out(fia: Callable) -> Callable:
    def out_variant(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                    workspace: torch.Tensor | None = None, out: list[torch.Tensor], **kwargs: Any) -> None:
        if workspace is not None and workspace.dtype != torch.uint8:
            raise GraphError("workspace must be the uint8 tensor "
                             "_npu_fused_infer_attention_score_get_max_workspace returns")
        res, lse = fia(query, key, value, **kwargs)
        if out[0].shape != res.shape or out[0].dtype != res.dtype:
            raise GraphError(f"out[0] must be {tuple(res.shape)} {res.dtype}, got {tuple(out[0].shape)} {out[0].dtype}")
        out[0].copy_(res)
    return out_variant


def _workspace(*args: Any, **kwargs: Any) -> torch.Tensor:
    return torch.empty(1024, dtype=torch.uint8)


def install(mod: Any, op_names: tuple[str, ...]) -> Runtime:
    """Give emulated ``mod`` (torch_npu) the graph API, every op in ``op_names`` task semantics, and
    FIA's ``.out`` variant plus the workspace getters vllm-ascend calls before capturing."""
    rt = Runtime()
    npu = mod.npu
    npu.NPUGraph = RecordedGraph
    npu.graph_pool_handle = lambda: object()
    npu.graph = rt.graph
    npu.is_current_stream_capturing = rt.is_current_stream_capturing
    npu.graph_task_group_begin, npu.graph_task_group_end = rt.graph_task_group_begin, rt.graph_task_group_end
    npu.graph_task_update_begin, npu.graph_task_update_end = rt.graph_task_update_begin, rt.graph_task_update_end
    npu.ExternalEvent = rt.external_event
    default = npu.current_stream()
    npu.stream = rt.stream
    npu.current_stream = lambda device=None: rt.current if rt.current is not None else default
    for name in op_names:
        setattr(mod, name, rt.wrap(name, getattr(mod, name)))
    mod.npu_fused_infer_attention_score.out = rt.wrap("npu_fused_infer_attention_score.out",
                                                      _fia_out(mod.npu_fused_infer_attention_score.__wrapped__))
    mod._npu_fused_infer_attention_score_get_max_workspace = _workspace
    mod._npu_paged_attention_get_workspace = _workspace
    mod.HWKV_GRAPH_RUNTIME = rt
    return rt
