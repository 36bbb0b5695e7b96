"""Communicator mutants: ``Device.custom_all_reduce`` of the reference device with one mistake.

The multi-device section runs two gloo ranks on the host (``conformance.ranks``), each rebuilding the
mutant, so a vendor's custom all-reduce is checked as the engine uses it: in place, every declared
dtype, 1 element .. 32 MiB, bitwise identical on both ranks. The control's custom all-reduce is the
same code without the bug (it reduces over the group's own gloo process group).

``allreduce-captured-stale`` needs a device that captures graphs: :func:`graph_collectives_device`
records a custom all-reduce issued during a capture as one step of the emulated graph
(:mod:`conformance.mutants.runtime`), which at replay reduces the tensor's contents *then*, as a
captured NCCL or IPC kernel does."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from conformance.mutants.base import mutant
from conformance.mutants.runtime import GraphDevice
from hwkv.model.layers import rms_norm
from hwkv.reference import CpuDevice
from hwkv.reference.graphs import StaticAttentionImpl

FIRST = ("test_multi_device.py::test_collectives",)
TWO_SHOT = 1 << 20  # elements from which a vendor kernel switches to reduce-scatter + all-gather
VECTOR = 8  # elements per vector load


def _custom(bug: str | None) -> Any:
    def custom_all_reduce(self: CpuDevice, comm: Any) -> Any:
        pg = getattr(comm, "torch_group", None)
        if pg is None:
            return None

        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            n, flat = t.numel(), t.view(-1)
            if bug == "two-shot-tail" and n >= TWO_SHOT:  # chunks of n // (world * VECTOR) vectors
                flat = flat[: n - n % (comm.world_size * VECTOR)]
            elif bug == "vector-tail" and n < TWO_SHOT:  # the n % VECTOR tail of the one-shot path skipped
                flat = flat[: n - n % VECTOR]
            if bug == "half-staging" and t.dtype == torch.float32:
                staged = flat.to(torch.bfloat16)
                pg.allreduce([staged]).wait()
                flat.copy_(staged)
                return t
            if flat.numel():
                pg.allreduce([flat]).wait()
            return t

        def all_reduce_add(t: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            if bug == "add-before-reduce":  # the residual joins every rank's partial: counted world times
                return all_reduce(t.add_(residual))
            if bug == "add-into-residual":  # the residual stream updated in place (the sum lands in it)
                return residual.add_(all_reduce(t))
            return residual + all_reduce(t)

        def all_reduce_add_rms_norm(t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
            if bug == "norm-before-peers":  # statistics from this rank's partial: the peers' wait comes late
                local = t.float() + residual.float()
                inv = torch.rsqrt(local.pow(2).mean(-1, keepdim=True) + eps)
                h = all_reduce(t) + residual
                return weight * (h.float() * inv).to(h.dtype), h
            if bug == "norm-unrounded-sum":  # the sum kept in float32 into the add: one rounding, not two
                h = _float32_sum(pg, t.float()).add_(residual.float()).to(t.dtype)
            else:
                h = all_reduce(t) + residual
            if bug == "norm-residual-in-place":  # the fused kernel's residual_out written over its residual input
                residual.copy_(h)
                h = residual
            return rms_norm(h, weight, eps), h

        if bug == "out-of-place":  # the sum written to a new tensor; the argument keeps its value
            return lambda t: all_reduce(t.clone())
        all_reduce.all_reduce_add = all_reduce_add
        all_reduce.all_reduce_add_rms_norm = all_reduce_add_rms_norm
        return all_reduce

    return custom_all_reduce


def _float32_sum(pg: Any, partial: torch.Tensor) -> torch.Tensor:
    pg.allreduce([partial]).wait()
    return partial


def collectives_device(bug: str | None) -> type[CpuDevice]:
    return type(f"Device_custom_ar_{bug}", (CpuDevice,), {"custom_all_reduce": _custom(bug)})


mutant("allreduce-two-shot-tail", "communicator", "custom all-reduce's two-shot path (>= 1 Mi elements) leaves the "
       "n % (world x vector) tail unreduced", FIRST, device=collectives_device("two-shot-tail"))
mutant("allreduce-vector-tail", "communicator", "custom all-reduce's one-shot path skips the n % 8 tail of its "
       "vector loads (small and odd sizes)", FIRST, device=collectives_device("vector-tail"))
mutant("allreduce-half-staging", "communicator", "custom all-reduce stages float32 through a bfloat16 buffer",
       FIRST, device=collectives_device("half-staging"))
mutant("allreduce-add-before-reduce", "communicator", "fused all_reduce_add adds the residual before the reduce "
       "(the residual counted once per rank)", FIRST, device=collectives_device("add-before-reduce"))
mutant("allreduce-add-into-residual", "communicator", "fused all_reduce_add adds the sum into its residual input "
       "in place (the contract: the residual is never written)", FIRST, device=collectives_device("add-into-residual"))
mutant("allreduce-norm-residual-in-place", "communicator", "fused all_reduce_add_rms_norm writes h over its "
       "residual input (a residual_out aliased to the input)", FIRST,
       device=collectives_device("norm-residual-in-place"))
mutant("allreduce-norm-unrounded-sum", "communicator", "fused all_reduce_add_rms_norm adds the residual to the "
       "float32 sum (one rounding where add_rms_norm after an all-reduce rounds twice)", FIRST,
       device=collectives_device("norm-unrounded-sum"))
mutant("allreduce-norm-before-peers", "communicator", "fused all_reduce_add_rms_norm takes the RMS statistics from "
       "this rank's partial sum (before the peers' partials arrived)", FIRST,
       device=collectives_device("norm-before-peers"))
mutant("allreduce-out-of-place", "communicator", "custom all-reduce writes the sum to a new tensor and leaves its "
       "argument unreduced (the contract: in place)", FIRST, device=collectives_device("out-of-place"))


class _CollectiveGraphDevice(GraphDevice):
    """Emulated graphs (``GraphDevice``) and a capturable custom all-reduce: outside a capture it
    reduces at once; inside one it adds a step to the graph that reduces the tensor at replay."""

    stale = False  # the bug of allreduce-captured-stale
    stale_residual = False  # the bug of allreduce-norm-captured-stale-residual
    capturing: Any = None  # the graph being captured

    def capture_graph(self, fn: Any, pool: Any, stream: Any) -> Any:
        g = self.graph_cls()
        self.capturing = g
        try:
            with g:
                out = fn()
        finally:
            self.capturing = None
        self.captured.append(g)
        return g, out

    def custom_all_reduce(self, comm: Any) -> Any:
        pg = getattr(comm, "torch_group", None)
        if pg is None:
            return None
        dev = self

        def reduce(t: torch.Tensor) -> torch.Tensor:
            pg.allreduce([t]).wait()
            return t

        def all_reduce(t: torch.Tensor) -> torch.Tensor:
            g = dev.capturing
            if g is None:
                return reduce(t)
            if dev.stale:
                # BUG: the input is staged into the kernel's buffer by a host-issued copy at capture
                # time, outside the graph; every replay reduces that snapshot
                with _disable_current_modes():
                    staged = t.clone()
                g.ops.append((lambda: t.copy_(reduce(staged.clone())), (), {}, []))
            else:
                g.ops.append((lambda: reduce(t), (), {}, []))
            return t

        def all_reduce_add(t: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            return residual + all_reduce(t)  # the add is recorded by the emulated capture like any op

        def all_reduce_add_rms_norm(t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
            if dev.capturing is not None and dev.stale_residual:
                # BUG: the residual staged into the kernel's buffer at capture time, outside the graph
                with _disable_current_modes():
                    residual = residual.clone()
            h = all_reduce(t) + residual
            return rms_norm(h, weight, eps), h

        all_reduce.all_reduce_add = all_reduce_add
        all_reduce.all_reduce_add_rms_norm = all_reduce_add_rms_norm
        return all_reduce


def graph_collectives_device(stale: bool, stale_residual: bool = False) -> type[CpuDevice]:
    return type(f"Device_graph_ar_{'stale' if stale else 'ok'}{'_res' if stale_residual else ''}",
                (_CollectiveGraphDevice,), {"stale": stale, "stale_residual": stale_residual})


def graph_collectives_pieces(stale: bool, stale_residual: bool = False) -> dict[str, Any]:
    """What :class:`~conformance.mutants.base.MutantBackend` takes for a graph-capturing backend with
    the custom all-reduce above (``impl``: a capture-safe ``write_kv``)."""
    return {"device": graph_collectives_device(stale, stale_residual), "impl": StaticAttentionImpl,
            "caps": {"graph_capture": True}}


mutant("allreduce-captured-stale", "communicator", "custom all-reduce captured into a graph stages its input at "
       "capture time, outside the graph: every replay reduces the capture-time data", FIRST,
       **graph_collectives_pieces(stale=True))
mutant("allreduce-norm-captured-stale-residual", "communicator", "fused all_reduce_add_rms_norm captured into a "
       "graph stages its residual at capture time, outside the graph: every replay adds the capture-time residual",
       FIRST, **graph_collectives_pieces(stale=False, stale_residual=True))
