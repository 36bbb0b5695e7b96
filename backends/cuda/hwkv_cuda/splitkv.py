"""Host side of the split-KV (flash-decoding) reduction: which reduction runs, the persistent arrival
counters of the fused one, and its merge tile.

Two reductions, selected by ``HWKV_CUDA_SPLIT_REDUCE``:

* ``fused`` (default): the last split program of each (q block, KV head) merges the partials in the
  attention launch itself. It finds out it is last through an int32 counter that every split bumps;
  the counters live here, are zeroed once and are back at zero after every launch.
* ``kernel``: the attention launch writes partials and ``reduce_kernel`` merges them in a second
  launch (the older path, kept so one GPU run can compare the two).
"""

from __future__ import annotations

import os

import torch

REDUCE_ENV = "HWKV_CUDA_SPLIT_REDUCE"
REDUCE_MODES = ("fused", "kernel")
MIN_COUNTERS = 1024


def reduce_mode() -> str:
    """``HWKV_CUDA_SPLIT_REDUCE`` (read per call, so a process can time both)."""
    mode = os.environ.get(REDUCE_ENV, "").strip().lower() or "fused"
    if mode not in REDUCE_MODES:
        raise ValueError(f"{REDUCE_ENV}={mode!r}: expected one of {', '.join(REDUCE_MODES)}")
    return mode


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def merge_tile(block_q: int, g_pad: int, splits_pad: int, d_pad: int, num_warps: int,
               regs: int) -> tuple[int, int]:
    """``(rows, splits)`` of one merge load ``[rows, splits, d_pad]`` within ``regs`` fp32 values per
    thread, all powers of two. Rows first: the merge costs one dependent round of loads per group of
    rows (the max over its splits) plus one per chunk of splits, and the chunks' total is fixed by the
    budget, so fewer, larger row groups mean fewer rounds (up to half the budget: the [rows, d_pad] sum
    stays live next to each load). More bytes per load shorten the merge; more
    registers can spill or cost the main loop occupancy."""
    budget = regs * 32 * num_warps
    # at most half the budget in rows: the [rows, d_pad] sum is live next to each load
    rows = min(block_q * g_pad, _pow2_floor(budget // (2 * max(d_pad, splits_pad))))
    return rows, min(splits_pad, _pow2_floor(budget // (rows * d_pad)))


class SplitCounters:
    """Arrival counters of the fused reduction, one int32 per (q block, KV head) of a launch, per device.

    Zeroed once when allocated; every launch leaves them at zero (the merging program resets its
    counter), so eager calls and CUDA-graph replays can share them as long as launches that use them
    do not run concurrently (one stream, or streams ordered by events). A buffer grows (never during
    graph capture: allocating and zeroing there would belong to the graph) and the old one is kept,
    since graphs captured earlier still point at it.
    """

    def __init__(self) -> None:
        self.buffers: dict[torch.device, torch.Tensor] = {}
        self.retired: list[torch.Tensor] = []

    def get(self, device: torch.device, n: int) -> torch.Tensor:
        buf = self.buffers.get(device)
        if buf is not None and buf.numel() >= n:
            return buf
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            have = 0 if buf is None else buf.numel()
            raise RuntimeError(
                f"hwkv-cuda: the fused split-KV reduction needs {n} arrival counters on {device} but "
                f"{have} exist, and they cannot be allocated during CUDA-graph capture. Run one eager "
                f"forward with the largest batch (same host lengths as the capture) before capturing, "
                f"as hwkv's GraphRunner does, or set {REDUCE_ENV}=kernel.")
        if buf is not None:
            self.retired.append(buf)
        buf = torch.zeros(max(MIN_COUNTERS, 1 << (n - 1).bit_length()), dtype=torch.int32, device=device)
        self.buffers[device] = buf
        return buf
