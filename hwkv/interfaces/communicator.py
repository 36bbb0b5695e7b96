"""Communicator interface: the collectives tensor parallelism needs, over one group of ranks.

Core code (the sharded model layers, the tensor-parallel runners) calls only these methods, so a
backend can bring faster collectives (a custom all-reduce over NVLink / HCCS, as vLLM's
``CustomAllreduce``) without the model knowing. The default implementation
(:class:`hwkv.parallel.communicator.TorchDistCommunicator`) runs ``torch.distributed`` with the
backend's ``Device.dist_backend`` (``gloo`` on the host, ``nccl`` for CUDA, ``hccl`` for Ascend).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

# A backend's own all-reduce: sums ``t`` over the group in place and returns it, or returns
# ``None`` when it declines this tensor (size, dtype, inside/outside capture): the communicator
# then runs its default all-reduce. Results follow the Communicator contract (ordered on the
# current stream, capturable, bitwise identical on every rank). The callable may also have
# ``all_reduce_add(t, residual)``: ``residual + sum of t over the ranks`` as a new tensor, or
# ``None`` to decline (it may overwrite ``t`` either way), for a fused kernel; and
# ``all_reduce_add_rms_norm(t, residual, weight, eps)`` as the Communicator method of that name; and
# ``all_reduce_start(t)``: a ``wait()`` as ``Communicator.all_reduce_start`` returns, or ``None`` to decline; and
# ``all_gather(t, dim)``: as the Communicator method of that name, or ``None`` to decline.
CustomAllReduce = Callable[[torch.Tensor], "torch.Tensor | None"]


class Communicator(ABC):
    """Collectives over ``world_size`` ranks; this process is ``rank``.

    Contract (every method):
    * Collective: every rank of the group calls it, in the same order, with tensors of the same
      shape and dtype (``broadcast``: the receivers' tensor has the sender's shape and dtype). A
      rank that skips a call makes the others wait until the group's timeout, then raise.
    * Tensors live on the group's device (``Device.torch_device``; host tensors for ``gloo``) and
      are contiguous.
    * Ordered on the device's current stream and without a host synchronisation, so the calls may
      sit inside a captured graph (``torch.distributed`` NCCL collectives are capturable; a
      backend whose collectives are not must say so in ``capturable``).
    * Results are bitwise identical on every rank (all ranks hold the same reduced / gathered /
      broadcast bytes), which keeps the ranks' sampling inputs identical.
    * ``world_size == 1``: the engine never builds a communicator (tp=1 runs no collective).
    """

    rank: int
    world_size: int
    capturable: bool = True
    # a forward of at least this many tokens runs its MLPs in two row halves, each half's all-reduces
    # started (all_reduce_start) before the other half's MLP, so a communicator whose collectives run
    # beside compute hides part of them (0: off)
    overlap_tokens: int = 0

    @abstractmethod
    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over all ranks, in place; returns ``t``."""

    @abstractmethod
    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """A new tensor: every rank's ``t`` concatenated along ``dim`` in rank order."""

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """``t`` of rank ``src`` copied into ``t`` on every rank, in place; returns ``t``."""

    def all_reduce_start(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start summing ``t`` over all ranks, in place; the returned ``wait()`` orders the current
        stream after the sum and returns ``t``. Work enqueued between the two may run beside the
        collective (``t`` is not to be touched until ``wait()``). Collective in the order of the
        starts; every start is waited for. Default: :meth:`all_reduce` at once."""
        self.all_reduce(t)
        return lambda: t

    def all_reduce_add(self, t: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """``residual + (t summed over all ranks)``: the sum rounded to ``t``'s dtype first, then
        the add (a row-parallel layer's output joining the residual stream). Returns a new tensor
        or ``t`` (``t`` may be overwritten; ``residual`` never is). Default: :meth:`all_reduce`,
        then the add in place."""
        return self.all_reduce(t).add_(residual)

    def all_reduce_add_rms_norm(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rms_norm(h, weight, eps), h)`` with ``h = residual + (t summed over all ranks)`` (the
        rounding of ``hwkv.model.layers.add_rms_norm`` after the all-reduce) as one fused step, or
        ``None`` where this communicator does not fuse it for this tensor — then the caller runs
        :meth:`all_reduce` and its own add + norm. Every rank gets the same answer for the same
        call. ``t`` may be overwritten. Default: ``None``."""
        return None

    def all_reduce_add_rms_norm_start(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                      eps: float) -> Callable[[], tuple[torch.Tensor, torch.Tensor]] | None:
        """:meth:`all_reduce_add_rms_norm` started as :meth:`all_reduce_start` is: work enqueued before
        ``wait()`` may run beside the sum, ``wait()`` returns ``(rms_norm(h, weight, eps), h)`` (``t``,
        ``residual`` untouched until then). ``None`` where not offered for this tensor (every rank the
        same answer) — the caller then runs :meth:`all_reduce_start` and its own add + norm. Default: ``None``."""
        return None

    def all_reduce_min(self, value: int) -> int:
        """The smallest ``value`` over the ranks (a host int; setup only, e.g. the KV pool size
        every rank can hold). Synchronises with the host."""
        raise NotImplementedError

    def close(self) -> None:
        """Leave the group (idempotent); collectives afterwards raise."""
        return None
