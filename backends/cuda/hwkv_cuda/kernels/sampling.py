"""Greedy argmax of float32 logits rows in one launch (Triton), for a batch-1 decode step's sampler.

torch's argmax reduces a row in one thread block (37 us for a row of 128,256 on an H200), and the chunked torch
variant (:func:`hwkv.model.sampler.argmax_rows`) takes five launches. Here program ``(r, c)`` reduces chunk ``c`` of
row ``r`` to one int64 key - the logit's order-preserving 32-bit code above ``2^32 - 1 - index`` - and folds it into
the row's slot by ``atomic_max``: the largest logit wins, NaN above everything and the first index among equals, as
``torch.argmax``. The row's last program to arrive (an acq_rel counter, as the split-KV merge) swaps the slot back to
its empty value, writes the index and resets the counter, so every launch leaves the slots and counters as it found
them (eager calls and graph replays share them; launches that share them must not overlap).
"""

import triton
import triton.language as tl

EMPTY = tl.constexpr(-(1 << 63))  # a slot's value between launches: below every key


@triton.jit
def argmax_kernel(x_ptr, key_ptr, cnt_ptr, out_ptr, V, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < V
    x = tl.load(x_ptr + row.to(tl.int64) * stride_x + offs, mask=ok, other=0.0)
    x = tl.where(x == 0.0, 0.0, x)  # -0.0 equals 0.0 (the first of them wins, as torch)
    b = x.to(tl.uint32, bitcast=True)
    code = tl.where((b >> 31) == 1, ~b, b | 0x80000000)  # float order as unsigned order
    code = tl.where(x != x, 0xFFFFFFFF, code)  # NaN is the maximum
    hi = code.to(tl.int64) - (1 << 31)  # signed, so that the int64 order is (code, -index) lexicographic
    key = hi * 4294967296 + (4294967295 - offs.to(tl.int64))
    key = tl.where(ok, key, EMPTY)
    tl.atomic_max(key_ptr + row, tl.max(key, axis=0), sem="relaxed", scope="gpu")
    # one thread issues both atomics, in order: the release of the count publishes the max above
    done = tl.atomic_add(cnt_ptr + row, 1, sem="acq_rel", scope="gpu")
    if done == tl.num_programs(1) - 1:
        best = tl.atomic_xchg(key_ptr + row, EMPTY, sem="acq_rel", scope="gpu")
        tl.store(out_ptr + row, 4294967295 - (best & 4294967295))
        tl.store(cnt_ptr + row, 0)
