"""The Proposer interface: what a speculative proposer is built from, what it gets from the runner
each step, and what it returns.

Built once by :func:`hwkv.engine.spec_config.make_proposer` (the method's class, found by name in
``METHODS``) from the :class:`~hwkv.engine.spec_config.ProposerTarget` (the target model, its
config, the backend). The engine then asks it, in this order: its KV bytes per block
(:meth:`Proposer.kv_bytes_per_block`: sized into the pool with the target's), its own KV cache
(:meth:`~Proposer.allocate`), the backend's fused decode ops (:meth:`~Proposer.set_decode_ops`),
graphs (:meth:`~Proposer.enable_graphs`). Each step :class:`~hwkv.spec_decode.runner.SpecModelRunner`
asks it for drafts: :meth:`~Proposer.propose` from the requests' tokens, or, for a proposer that
``needs_hidden`` (EAGLE), :meth:`~Proposer.propose_with_hidden` from the target's hidden states of
the step. It returns per request at most ``caps[i]`` draft token ids. What it may read of the runner
is :class:`RunnerView`, nothing else.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from hwkv.engine.spec_config import ProposerTarget

if TYPE_CHECKING:
    import numpy as np
    import torch

    from hwkv.engine.inputs import StepBatch


class RunnerView:
    """What a proposer reads of the model runner: the token and block tables (row ``state.slot`` of a
    request's state; ``state.num_tokens`` tokens known, drafts written after them), the geometry, the
    device, the attention metadata builder (to capture graphs) and the runner's device-input builder."""

    __slots__ = ("_runner",)

    def __init__(self, runner: Any):
        self._runner = runner

    @property
    def token_ids(self) -> np.ndarray:  # [max_num_seqs, width] int32; its width may grow between steps
        return self._runner.token_ids

    @property
    def block_table(self) -> np.ndarray:  # [max_num_seqs, max_blocks] int32
        return self._runner.block_table

    @property
    def block_size(self) -> int:
        return self._runner.block_size

    @property
    def max_model_len(self) -> int:
        return self._runner.max_model_len

    @property
    def dev(self) -> Any:  # the backend's Device
        return self._runner.dev

    @property
    def meta_builder(self) -> Any:
        return self._runner.meta_builder

    def device_inputs(self, batch: StepBatch) -> Any:
        """The model's device inputs for a host batch (:func:`hwkv.engine.inputs.build_batch`)."""
        return self._runner.device_inputs(batch)


class Proposer:
    """A speculative proposer. Every hook but the one that proposes has a do-nothing default."""

    # propose_with_hidden (the target's states of the step) instead of propose; the target's graphs
    # then return those states too (hwkv.spec_decode.state_graphs)
    needs_hidden: bool = False
    # the target must run its plain forward (the proposer hooks inside its layers: no fused decode ops)
    needs_plain_forward: bool = False

    @classmethod
    def load(cls, cfg: Any, target: ProposerTarget) -> Proposer:
        """The proposer ``cfg`` (a :class:`~hwkv.engine.spec_config.SpeculativeConfig`) asks for, on
        ``target`` (``ValueError`` naming what does not fit it)."""
        raise NotImplementedError

    def kv_bytes_per_block(self, block_size: int) -> int:
        """Bytes per KV block of the proposer's own cache (indexed by the target's block ids)."""
        return 0

    def allocate(self, num_blocks: int, block_size: int, max_model_len: int) -> None:
        """Allocate the proposer's own state for the pool the engine sized (``ValueError`` naming a
        limit the proposer cannot meet)."""

    def set_decode_ops(self, ops: Any) -> None:
        """The backend's fused decode ops, for the proposer's own few-token forwards."""

    def enable_graphs(self, runner: RunnerView, max_batch: int, use_graphs: bool = True) -> None:
        """Capture the proposer's own graphs where the target has graphs."""

    def propose(self, runner: RunnerView, states: list[Any], req_ids: list[str], caps: Any) -> list[list[int]]:
        """Up to ``caps[i]`` drafts for each request that sampled this step (its tokens in the runner's
        token row, this step's sampled token included)."""
        raise NotImplementedError(f"{type(self).__name__} proposes with hidden states only")

    def propose_with_hidden(self, runner: RunnerView, states: list[Any], batch: StepBatch, hidden: torch.Tensor,
                            valid: np.ndarray, sample_rows: np.ndarray, caps: Any) -> list[list[int]]:
        """``needs_hidden`` proposers: drafts for the rows ``sample_rows`` from the target's ``hidden``
        states of ``batch`` (``valid[i]``: row ``i``'s query tokens the verification kept)."""
        raise NotImplementedError(f"{type(self).__name__} does not propose from hidden states")

    def target_states(self, target: Any, h: torch.Tensor) -> torch.Tensor:
        """``needs_hidden`` proposers: the states they read, from the target's final hidden states."""
        raise NotImplementedError(f"{type(self).__name__} does not read the target's states")

    def drop(self, req_id: str) -> None:
        """The request finished or was preempted: forget its state."""
