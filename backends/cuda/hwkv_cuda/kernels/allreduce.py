"""One-shot "push" all-reduce over peer memory (Triton), optionally fused with the residual add.

Every rank's buffer (one allocation, mapped into every rank through CUDA IPC) holds two parities of
``WS`` slots of ``SLOT`` elements, then ``[programs, WS]`` int64 flags. Program ``p`` of rank ``r``
owns bytes ``[p * 4096, (p + 1) * 4096)`` of every slot: it writes its piece of the input into slot
``r`` of every peer's buffer (NVLink stores are posted: a push costs one crossing, a pull two),
raises flag ``[p, r]`` on every peer to its epoch (release, system scope), waits until every peer
raised flag ``[p, *]`` of its own buffer to that epoch (acquire), then sums the ``WS`` parts (its own
from registers, the peers' from its buffer) in rank order — the same order on every rank, so every
rank holds the same bits — and adds the residual.

The epoch is program ``p``'s call count (``epochs[p]``, in device memory: graph replays advance it).
Calls alternate between the two parities, which makes one barrier per call enough: a rank writes a
parity's slot again two calls later, by then every rank has passed the barrier of the call between,
which it reached only after finishing its reads of this one. The wait is bounded (``MAX_SPIN``
polls): a peer that never comes makes the kernel set ``error[0]`` and go on, instead of hanging
the device.

With ``PDL`` (programmatic dependent launch, as the decode GEMVs of :mod:`hwkv_cuda.kernels.dense`)
the kernel is launched during the previous kernel's tail and waits (``gdc_wait``) before reading
anything; it lets the next kernel start at once, whose programs only load their first weight tile
before their own wait: the next projection's weights stream while this all-reduce crosses NVLink,
instead of the chain of a tensor-parallel layer breaking twice at every all-reduce.
"""

import triton
import triton.language as tl

from hwkv_cuda.kernels.dense import gdc_launch_dependents, gdc_wait

REGION = 4096  # bytes of each slot a program owns (the same for every dtype: regions never overlap)
MAX_SPIN = tl.constexpr(1 << 28)  # a global a @jit function reads must be a constexpr


@triton.jit
def _push_sum(x, offs, mask, pid, buf_ptr, flags_ptr, peers_ptr, epochs_ptr, err_ptr, RANK: tl.constexpr,
              WS: tl.constexpr, SLOT: tl.constexpr, FLAG_OFF: tl.constexpr, BLOCK: tl.constexpr):
    """Program ``pid``'s barrier round: push ``x`` (at ``offs`` of the slot) into slot ``RANK`` of every
    peer's buffer, raise flag ``[pid, RANK]`` on every peer, wait for every peer's flag ``[pid, r]``
    here (bounded), then the float32 sum of the ``WS`` parts in rank order (this rank's own part from
    registers: no store, flag, system-scope fence or wait for it); the epoch is advanced."""
    epoch = tl.load(epochs_ptr + pid) + 1
    base = (epoch % 2) * (WS * SLOT)
    for r in tl.static_range(WS):
        if r != RANK:
            peer = tl.load(peers_ptr + r).to(tl.pointer_type(x.dtype))
            tl.store(peer + base + RANK * SLOT + offs, x, mask=mask)
    tl.debug_barrier()  # every thread's stores before the flag
    for r in tl.static_range(WS):
        if r != RANK:
            flag = tl.load(peers_ptr + r).to(tl.pointer_type(tl.int64)) + FLAG_OFF + pid * WS + RANK
            tl.atomic_xchg(flag, epoch, sem="release", scope="sys")
    for r in tl.static_range(WS):
        if r != RANK:
            spins = 0
            while (tl.atomic_add(flags_ptr + pid * WS + r, 0, sem="acquire", scope="sys") < epoch) & (
                    spins < MAX_SPIN):
                spins += 1
            if spins >= MAX_SPIN:
                tl.store(err_ptr, 1)
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WS):
        if r == RANK:
            acc += x.to(tl.float32)
        else:
            acc += tl.load(buf_ptr + base + r * SLOT + offs, mask=mask).to(tl.float32)
    tl.store(epochs_ptr + pid, epoch)
    return acc


@triton.jit
def push_all_reduce_kernel(x_ptr, res_ptr, out_ptr, buf_ptr, flags_ptr, peers_ptr, epochs_ptr, err_ptr, n,
                           RANK: tl.constexpr, WS: tl.constexpr, SLOT: tl.constexpr, FLAG_OFF: tl.constexpr,
                           BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PDL: tl.constexpr = False):
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    acc = _push_sum(x, offs, mask, pid, buf_ptr, flags_ptr, peers_ptr, epochs_ptr, err_ptr, RANK, WS, SLOT, FLAG_OFF,
                    BLOCK)
    y = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:  # the sum rounded first, then the add (as all_reduce then h + out)
        y = (y.to(tl.float32) + tl.load(res_ptr + offs, mask=mask).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def _add_rms_norm_store(acc, res_ptr, w_ptr, out_ptr, h_ptr, offs, cols, mask, H, eps):
    """A row's sum over the ranks (``acc``, float32) rounded to the model's dtype, then ``h = residual + sum`` and
    ``out = rms_norm(h) * w`` with the model's rounding (the plain forward's ``norm(all_reduce(out) + h)``), both
    stored; masked lanes count as zeros."""
    dt = out_ptr.dtype.element_ty
    s = acc.to(dt).to(tl.float32)
    h = (s + tl.load(res_ptr + offs, mask=mask, other=0.0).to(tl.float32)).to(dt)
    tl.store(h_ptr + offs, h, mask=mask)
    hf = h.to(tl.float32)
    var = tl.sum(hf * hf, axis=0) / H
    y = (hf * tl.rsqrt(var + eps)).to(dt)
    w = tl.load(w_ptr + cols, mask=mask)
    tl.store(out_ptr + offs, (w.to(tl.float32) * y.to(tl.float32)).to(dt), mask=mask)


@triton.jit
def push_all_reduce_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, h_ptr, buf_ptr, flags_ptr, peers_ptr, epochs_ptr,
                                err_ptr, H, eps, RANK: tl.constexpr, WS: tl.constexpr, SLOT: tl.constexpr,
                                FLAG_OFF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """The push all-reduce of rows of ``H`` (program ``p`` owns row ``p``: a buffer of its own, whose
    regions are rows of one fixed ``H``), then ``h = residual + sum`` and ``out = rms_norm(h) * w``
    with the model's rounding (sum, add and normalised row each rounded to the dtype, as
    ``hwkv.model.layers.add_rms_norm``)."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    offs = pid * H + cols
    x = tl.load(x_ptr + offs, mask=mask)
    acc = _push_sum(x, offs, mask, pid, buf_ptr, flags_ptr, peers_ptr, epochs_ptr, err_ptr, RANK, WS, SLOT, FLAG_OFF,
                    BLOCK)
    _add_rms_norm_store(acc, res_ptr, w_ptr, out_ptr, h_ptr, offs, cols, mask, H, eps)


@triton.jit
def _ll_wait(ptr, tag, err_ptr):
    """This rank's words at ``ptr`` once every one carries ``tag`` in its upper half (volatile polls, bounded)."""
    v = tl.load(ptr, volatile=True)
    spins = 0
    while (tl.max((((v >> 32) & 0xFFFFFFFF) != tag).to(tl.int32), axis=0) > 0) & (spins < MAX_SPIN):
        v = tl.load(ptr, volatile=True)
        spins += 1
    if spins >= MAX_SPIN:
        tl.store(err_ptr, 1)
    return v


@triton.jit
def _ll_push(x, pid, peers_ptr, epochs_ptr, RANK: tl.constexpr, WS: tl.constexpr, SLOT_W: tl.constexpr,
             BLOCK: tl.constexpr):
    """Program ``pid``'s ``BLOCK`` 16-bit elements ``x`` as low-latency words (two elements and the call's epoch in
    8 bytes, so a word is its own flag) into this rank's slot of every peer, in this call's parity of slots.
    Returns ``(epoch, tag, words)``: the call's epoch (the program stores it when done), the tag a word of this call
    carries, and the program's word offsets inside a slot pair."""
    HALF: tl.constexpr = BLOCK // 2
    epoch = tl.load(epochs_ptr + pid) + 1
    tag = epoch & 0xFFFFFFFF
    words = (epoch % 2) * (WS * SLOT_W) + pid * HALF + tl.arange(0, HALF)
    bits = (x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF).to(tl.int64)
    lo, hi = tl.split(tl.reshape(bits, [HALF, 2]))
    word = lo | (hi << 16) | (tag << 32)
    for r in tl.static_range(WS):
        if r != RANK:
            peer = tl.load(peers_ptr + r).to(tl.pointer_type(tl.int64))
            tl.store(peer + RANK * SLOT_W + words, word)
    return epoch, tag, words


@triton.jit
def _ll_read(slot_ptr, words, tag, err_ptr, x, BLOCK: tl.constexpr):
    """A peer's ``BLOCK`` elements of this call (``x``'s dtype) from its slot ``slot_ptr`` of this rank's buffer,
    once every word carries ``tag`` (:func:`_ll_wait`)."""
    v = _ll_wait(slot_ptr + words, tag, err_ptr)
    a = (v & 0xFFFF).to(tl.int16).to(x.dtype, bitcast=True)
    b = ((v >> 16) & 0xFFFF).to(tl.int16).to(x.dtype, bitcast=True)
    return tl.reshape(tl.join(a, b), [BLOCK])


@triton.jit
def push_ll_kernel(x_ptr, res_ptr, out_ptr, buf_ptr, peers_ptr, epochs_ptr, err_ptr, n, RANK: tl.constexpr,
                   WS: tl.constexpr, SLOT_W: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr,
                   PDL: tl.constexpr = False):
    """``push_all_reduce_kernel`` for 16-bit dtypes in the low-latency form (NCCL's LL protocol): every 8-byte word
    pushed into a peer's slot holds two elements and the call's epoch, so a word is its own flag - no system-scope
    fence after the stores, no flag store, no flag wait: the reader polls its words until each carries the epoch
    (an aligned 8-byte store lands whole). Program ``p`` owns ``BLOCK`` elements (``BLOCK / 2`` words of every
    slot); calls alternate between two parities of slots as in the push kernel (a slot is rewritten two calls
    later, after every rank passed the call between), the epoch tag tells this call's words from the last ones.
    The sum is the push kernel's (float32, rank order, this rank's part from registers): the same bits."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    epoch, tag, words = _ll_push(x, pid, peers_ptr, epochs_ptr, RANK, WS, SLOT_W, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WS):
        if r == RANK:
            acc += x.to(tl.float32)
        else:
            acc += _ll_read(buf_ptr + r * SLOT_W, words, tag, err_ptr, x, BLOCK).to(tl.float32)
    tl.store(epochs_ptr + pid, epoch)
    y = acc.to(out_ptr.dtype.element_ty)
    if HAS_RES:  # the sum rounded first, then the add (as all_reduce then h + out)
        y = (y.to(tl.float32) + tl.load(res_ptr + offs, mask=mask).to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def ce_sum_kernel(x_ptr, slot_ptr, out_ptr, n, stride, RANK: tl.constexpr, WS: tl.constexpr, BLOCK: tl.constexpr,
                  HAS_OUT: tl.constexpr = True):
    """The copy-engine all-reduce's sum of this rank's chunk (:mod:`hwkv_cuda.ce_allreduce`): ``x`` (this
    rank's part) and the peers' parts (``WS - 1`` slots ``stride`` elements apart, in rank order without
    ``RANK``) summed in rank order in float32, rounded once, stored into ``x`` (and ``out``)."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WS):
        if r == RANK:
            acc += tl.load(x_ptr + offs, mask=mask).to(tl.float32)
        else:
            slot = r if r < RANK else r - 1
            acc += tl.load(slot_ptr + slot * stride + offs, mask=mask).to(tl.float32)
    y = acc.to(out_ptr.dtype.element_ty)
    tl.store(x_ptr + offs, y, mask=mask)
    if HAS_OUT:
        tl.store(out_ptr + offs, y, mask=mask)


@triton.jit
def ce_add_norm_kernel(x_ptr, slot_ptr, res_ptr, w_ptr, out_ptr, h_ptr, H, eps, stride, RANK: tl.constexpr,
                       WS: tl.constexpr, BLOCK: tl.constexpr):
    """The one-shot copy-engine all-reduce's sum fused into the next RMSNorm, one program per row of ``H``:
    ``s`` = this rank's row and the peers' (``WS - 1`` slots ``stride`` elements apart, rank order) in
    float32, rounded; ``h = residual + s`` and ``out = rms_norm(h) * w`` with the model's rounding (as
    ``push_all_reduce_norm_kernel``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    offs = row * H + cols
    acc = tl.zeros([BLOCK], tl.float32)
    for r in tl.static_range(WS):
        if r == RANK:
            acc += tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        else:
            slot = r if r < RANK else r - 1
            acc += tl.load(slot_ptr + slot * stride + offs, mask=mask, other=0.0).to(tl.float32)
    _add_rms_norm_store(acc, res_ptr, w_ptr, out_ptr, h_ptr, offs, cols, mask, H, eps)


@triton.jit
def ce_signal_kernel(addr, value):
    """A flag write to (peer) memory at ``addr`` (release, system scope): the fallback of a stream memory
    operation."""
    v = tl.zeros([], tl.int64) + value
    tl.atomic_xchg(addr.to(tl.pointer_type(tl.int64)), v, sem="release", scope="sys")


@triton.jit
def ce_wait_kernel(addr, value):
    """Spin until the local flag at ``addr`` is ``>= value`` (acquire, system scope): the fallback of
    ``cuStreamWaitValue64``."""
    p = addr.to(tl.pointer_type(tl.int64))
    v = tl.zeros([], tl.int64) + value
    spins = 0
    while tl.atomic_add(p, 0, sem="acquire", scope="sys") < v:
        spins += 1


@triton.jit
def push_ll_gather_kernel(x_ptr, out_ptr, buf_ptr, peers_ptr, epochs_ptr, err_ptr, n, S, RANK: tl.constexpr,
                          WS: tl.constexpr, SLOT_W: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = False):
    """All-gather of ``[R, S]`` 16-bit rows along the last dim in the low-latency form (``push_ll_kernel``'s words:
    two elements and the call's epoch each): program ``p`` pushes its ``BLOCK`` elements of the flattened rows into
    this rank's slot of every peer, writes them into its own columns ``[RANK S, (RANK + 1) S)`` of ``out [R, WS S]``,
    then polls each peer's words and writes them into that peer's columns - every rank the same bytes."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    epoch, tag, words = _ll_push(x, pid, peers_ptr, epochs_ptr, RANK, WS, SLOT_W, BLOCK)
    row = offs // S
    col = offs % S
    dst = out_ptr + row.to(tl.int64) * (WS * S) + col
    tl.store(dst + RANK * S, x, mask=mask)
    for r in tl.static_range(WS):
        if r != RANK:
            tl.store(dst + r * S, _ll_read(buf_ptr + r * SLOT_W, words, tag, err_ptr, x, BLOCK), mask=mask)
    tl.store(epochs_ptr + pid, epoch)
