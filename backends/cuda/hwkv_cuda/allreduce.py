"""Custom all-reduce for tensor parallelism on CUDA (``CudaDevice.custom_all_reduce``), over peer
memory: the push kernels' buffers are mapped into every rank through CUDA IPC handles, PyTorch's
symmetric-memory ops (optional) over its own allocation (NVLink; NVLink multicast is never used:
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` is set before the first allocation unless the user set it,
and no ``multimem`` op runs).

By message size (bytes of the tensor), as vLLM's custom all-reduce:

* ``<= push_max``: one-shot push (:mod:`hwkv_cuda.kernels.allreduce`, one Triton kernel): each rank
  writes its tensor into every rank's buffer, one flag barrier, every rank sums all copies in rank
  order. ``all_reduce_add`` fuses the residual add into the same kernel (the decode ops' two per
  layer); ``all_reduce_add_rms_norm`` (rows up to ``norm_max`` bytes in all) also the next RMSNorm
  (the plain forward's two per layer).
* ``<= one_shot_max``: ``torch.ops.symm_mem.one_shot_all_reduce_out`` (each rank pulls every peer's copy).
* ``<= two_shot_max``: ``torch.ops.symm_mem.two_shot_all_reduce_`` (reduce-scatter + all-gather over
  peer memory: each rank reads and writes ``(ws - 1) / ws`` of the message).
* larger: declined — the communicator's NCCL all-reduce (bandwidth-optimal for prefill-sized messages).

Every path is ordered on the current stream without a host sync, so it is captured into CUDA graphs;
every rank takes the same path for the same tensor (the choice depends on size and dtype only), and
every path gives the same bits on every rank. Thresholds are bytes. On by default
(``HWKV_CUSTOM_ALLREDUCE=auto``; ``off``: NCCL only) since its first two-GPU run (ed3398d, 2 x H200:
the push path bit-exact at every size, 3.8-12.5 us in a graph against NCCL's 21-30 us up to 2 MB);
``=symm`` keeps only PyTorch's ops (no Triton kernel), ``=push`` only the kernel.
"""

from __future__ import annotations

import contextlib
import os
import struct
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import torch

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# defaults, bytes: first choices, to be set from `hwkv bench allreduce` once it has timed the push
# kernel (push up to 2 MB: a decode step of up to 256 rows of 4096 bf16; vLLM's custom all-reduce runs
# one-shot at every size for two ranks). 2 parities x world size x PUSH_MAX of peer buffer per rank.
PUSH_MAX = 2 * 1024 * 1024
ONE_SHOT_MAX = 512 * 1024
TWO_SHOT_MAX = 8 * 1024 * 1024
NORM_MAX = 2 * 1024 * 1024  # all_reduce_add_rms_norm: rows of hidden states up to this many bytes
# the all-reduce inside the decode GEMVs (hwkv_cuda.decode_ops.TritonRankSum): a rank slot of one site holds a
# row-parallel projection's output, up to 8 tokens x 16384 float32 (HWKV_TP_FUSED_AR=0: the push kernel instead)
FUSED_SLOT = 8 * 16384 * 4
FUSED_SITES = 2
MIN_ROW_BYTES = 512
# the low-latency push (kernels/allreduce.py push_ll_kernel: each 8-byte word carries two 16-bit elements and the
# call's epoch, no fence, flag or barrier round): 16-bit messages up to this many bytes (a decode step's hidden
# states, 8 KB a row at 4096); its own 2 parities x world size x 2 LL_MAX of peer buffer per rank.
# Set up (its buffer and setup self-test) only where HWKV_PUSH_LL is set when the group starts; taken where it is "1"
# (read per call: an A/B recaptures the graphs with "0" / "1"). Off by default until measured
LL_MAX = 64 * 1024
LL_ENV = "HWKV_PUSH_LL"
# the low-latency all-gather (kernels/allreduce.py push_ll_gather_kernel): a rank's part of [rows, S] 16-bit up to this
# many bytes (the LM head's logits at tp=2 of a 128,256 vocabulary: 125 KB a row), set up with the low-latency push;
# HWKV_PUSH_GATHER=1 takes it (read per call), off by default until measured
GATHER_MAX = 1024 * 1024
GATHER_ENV = "HWKV_PUSH_GATHER"


def make_custom_all_reduce(comm: Any) -> CudaAllReduce | None:
    """The custom all-reduce over ``comm`` (a TorchDistCommunicator on CUDA), or ``None`` where it
    cannot run (one rank, a communicator without a store, no symmetric memory, no peer access) —
    decided by all ranks together, so they all use it or none does."""
    mode = os.environ.get("HWKV_CUSTOM_ALLREDUCE", "auto")
    if mode not in ("auto", "off", "symm", "push"):
        raise ValueError(f"HWKV_CUSTOM_ALLREDUCE={mode!r} (allowed: auto, off, symm, push)")
    n = comm.world_size
    if mode == "off" or not 2 <= n <= 8 or getattr(comm, "store", None) is None or not hasattr(comm, "group_name"):
        return None
    ar, ok = None, 1
    try:
        ar = CudaAllReduce(comm, push=mode != "symm", symm=mode != "push")
    except Exception as e:  # noqa: BLE001 - any rank failing turns it off on every rank
        ok, reason = 0, f"{type(e).__name__}: {e}"
    if comm.all_reduce_min(ok) == 0:
        if ar is not None:
            ar.close()
        if ok == 0:
            warnings.warn(f"custom all-reduce off (NCCL for every size): {reason}", stacklevel=2)
        return None
    return ar


class CudaAllReduce:
    """Callable as a :data:`~hwkv.interfaces.communicator.CustomAllReduce` (see the module doc)."""

    pdl = False  # the push kernels launched with programmatic dependent launch (set in __init__)
    fused = False  # the buffers of the all-reduce inside the decode GEMVs set up (set in __init__)
    fused_error = ""  # why that path was turned off
    ll_max = 0  # bytes up to which the low-latency push may run (set in __init__; 0: never)
    ll_error = ""  # why it was turned off
    _ce: Any = None
    norm_warps = 0  # warps per row of the push + RMSNorm kernel (0: 8 from 4096 columns on, else 4; probes set it)
    ce_min = 0  # messages of at least this many bytes take the copy-engine all-reduce (0: off; set in __init__)
    ce_error = ""  # why the copy-engine path was turned off
    ce_signal = ""  # how its flags are written and waited for ("memop" or "kernel")
    ce_mode = ""  # "rsag" (reduce-scatter + all-gather) or "oneshot" (HWKV_CE_ALLREDUCE=1 / 2)

    def __init__(self, comm: Any, push: bool = True, symm: bool = True, push_max: int = PUSH_MAX,
                 one_shot_max: int = ONE_SHOT_MAX, two_shot_max: int = TWO_SHOT_MAX, norm_max: int = NORM_MAX):
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        self.rank, self.world_size, self.device = comm.rank, comm.world_size, comm.device
        self._registered, self._symm_group = False, None
        self.name = ""
        self.push_max = push_max if push else 0
        self.norm_max = norm_max if push else 0
        self.ll_max = LL_MAX if push and os.environ.get(LL_ENV) else 0
        # the row-parallel all-reduce inside the decode GEMVs (TritonRankSum); HWKV_TP_FUSED_AR=0: off (A/B)
        self.fused = push and os.environ.get("HWKV_TP_FUSED_AR", "0") != "0"
        self._norm_key: tuple[int, torch.dtype] | None = None  # (hidden size, dtype): fixed at the first call
        # programmatic dependent launch, as the decode GEMVs (kernels/allreduce.py); HWKV_PUSH_PDL=0: off (A/B)
        self.pdl = os.environ.get("HWKV_PUSH_PDL", "1") != "0" and _use_pdl(self.device)
        self.one_shot_max = one_shot_max if symm else 0
        self.two_shot_max = two_shot_max if symm else 0
        ops = torch.ops.symm_mem
        if not hasattr(ops, "one_shot_all_reduce_out"):
            self.one_shot_max = 0
        if not hasattr(ops, "two_shot_all_reduce_"):
            self.two_shot_max = 0
        # a group name unique in every rank's process (symmetric memory's group info is set once, forever)
        store = comm.store
        if self.rank == 0:
            store.set("symm_mem_name", f"{comm.group_name}-{uuid.uuid4().hex[:12]}")
        self.name = store.get("symm_mem_name").decode()
        self._store = store
        self._bufs: list[Any] = []
        self._tokens: list[Any] = []
        self._mover: Any = None
        self.symm_error = ""
        ok, err = 1, None
        try:
            with torch.cuda.device(self.device):
                self._setup_push()
                torch.cuda.synchronize(self.device)  # zeroed before any peer pushes (the agreement below)
        except Exception as e:  # noqa: BLE001 - agreed below: every rank gives up together
            ok, err = 0, e
        if comm.all_reduce_min(ok) == 0:
            self.close()
            raise err or RuntimeError("another rank could not map the peer buffers")
        ok, err = 1, None
        try:
            with torch.cuda.device(self.device):
                self._self_test()
        except Exception as e:  # noqa: BLE001 - agreed below
            ok, err = 0, e
        if comm.all_reduce_min(ok) == 0:
            self.close()
            raise err or RuntimeError("another rank's push kernels failed their self-test")
        # the optional paths: a failure turns only that one off, on every rank
        if self.fused and (why := self._agreed(comm, self._self_test_fused,
                                               "another rank's fused all-reduce failed its self-test")):
            self.fused, self.fused_error = False, why
            warnings.warn(f"all-reduce inside the decode GEMVs off (the push kernel instead): {why}", stacklevel=2)
        if self.ll_max and (why := self._agreed(comm, self._self_test_ll,
                                                "another rank's low-latency push failed its self-test")):
            self.ll_max, self.ll_error = 0, why
            warnings.warn(f"low-latency push off: {why}", stacklevel=2)
        from hwkv_cuda.ce_allreduce import ce_enabled

        if ce_enabled():  # optional: a failure turns only it off, on every rank
            self._setup_ce(comm)
        if (self.one_shot_max or self.two_shot_max) and _same_device_index(comm, self.device):
            # every rank sees its GPU at the same index (a tensor-parallel engine's workers each see one GPU
            # as cuda:0): symmetric memory's rendezvous refuses that ("allocations from overlapping devices"),
            # and a process's second rendezvous waits forever for peers whose first it is (the store
            # exchange counts rendezvous per process: the second tp=2 engine of a process hung in it on
            # 2 x H200, batch 3 of 2026-11-28), so it is not tried
            self.one_shot_max = self.two_shot_max = 0
            self.symm_error = "every rank sees its GPU at the same index (one GPU per process): not tried"
        if self.one_shot_max or self.two_shot_max:
            # PyTorch's ops are optional: a failure only turns them off, on every rank (agreed before the
            # rendezvous too, so no rank waits in it for a peer that already gave up)
            for step in (self._prepare_symm, self._rendezvous_symm):
                ok = 1
                try:
                    step(comm)
                except Exception as e:  # noqa: BLE001
                    ok, self.symm_error = 0, f"{type(e).__name__}: {e}"
                if comm.all_reduce_min(ok) == 0:
                    self.one_shot_max = self.two_shot_max = 0
                    self.symm_error = self.symm_error or "another rank could not set up symmetric memory"
                    break

    def _agreed(self, comm: Any, step: Callable[[], Any], peer_failed: str) -> str:
        """Run ``step`` on this rank's device, then agree with every rank: ``""`` when it passed on all of them,
        else why not (this rank's exception, or ``peer_failed`` when only another rank's step failed) - every rank
        gets a non-empty answer together, so all turn the same path off."""
        ok, err = 1, ""
        try:
            with torch.cuda.device(self.device):
                step()
        except Exception as e:  # noqa: BLE001 - agreed below
            ok, err = 0, f"{type(e).__name__}: {e}"
        return "" if comm.all_reduce_min(ok) == 1 else (err or peer_failed)

    def _setup_ce(self, comm: Any) -> None:
        """The copy-engine all-reduce (:mod:`hwkv_cuda.ce_allreduce`) for messages of at least ``ce_min``
        bytes: its buffers mapped, then its flag path probed without any device wait (each rank writes a
        scratch flag into its peers' buffers, every rank checks what arrived after a host barrier: a
        driver that refuses stream memory operations on peer memory cannot leave a rank waiting), then
        one self-test all-reduce on small integers. Memory operations first, one-thread kernels if they
        fail; every step agreed by all ranks."""
        from hwkv_cuda import ce_allreduce as ce

        ok, err = 1, ""
        try:
            with torch.cuda.device(self.device):
                self._ce, self._ce_stream = ce.make_ce(self.rank, self.world_size, torch.device(self.device),
                                                       self._peer_buffer,
                                                       int(os.environ.get("HWKV_CE_CHUNK_MAX", ce.CHUNK_MAX)),
                                                       mode=ce.ce_mode())
                self.ce_mode = ce.ce_mode()
                torch.cuda.synchronize(self.device)
        except Exception as e:  # noqa: BLE001 - agreed below
            ok, err = 0, f"{type(e).__name__}: {e}"
        if comm.all_reduce_min(ok) == 0:
            self.ce_error = err or "another rank could not map the copy-engine buffers"
            warnings.warn(f"copy-engine all-reduce off: {self.ce_error}", stacklevel=3)
            return
        modes = [os.environ["HWKV_CE_SIGNAL"]] if os.environ.get("HWKV_CE_SIGNAL") else ["memop", "kernel"]
        for i, mode in enumerate(modes):
            self._ce.t.mode = mode
            why = self._agreed(comm, lambda v=1000 + i: self._probe_ce_flags(comm, v),
                               "another rank's flag probe failed")
            if not why:
                break
            self.ce_error = f"{mode}: {why}"
        else:
            warnings.warn(f"copy-engine all-reduce off: {self.ce_error}", stacklevel=3)
            return
        if why := self._agreed(comm, self._self_test_ce, "another rank's copy-engine self-test failed"):
            self.ce_error = why
            warnings.warn(f"copy-engine all-reduce off: {why}", stacklevel=3)
            return
        self.ce_min, self.ce_signal, self.ce_error = int(os.environ.get("HWKV_CE_MIN", ce.CE_MIN)), mode, ""

    def _probe_ce_flags(self, comm: Any, value: int) -> None:
        """Each rank raises its reduce-scatter flag in every peer's buffer to ``value`` and waits on its own
        flags only once they are known to hold it (never blocking): checks that flag writes reach the
        peers and that the wait returns, with no rank able to hang. The flags are reset after."""
        c, t = self._ce, self._ce.t
        t.stream = self._ce_stream
        t.stream.wait_stream(torch.cuda.current_stream(self.device))
        for j in range(self.world_size):
            if j != self.rank:
                t.signal(c._flag(j, 0, self.rank), value)
        t.stream.synchronize()
        comm.all_reduce_min(1)  # every rank's writes are done
        flags = c.local[c.flags_offset:].view(torch.int64)
        got = [int(v) for v in flags[: c.ws].tolist()]
        bad = [j for j in range(self.world_size) if j != self.rank and got[j] != value]
        if bad:
            raise RuntimeError(f"flags from ranks {bad} did not arrive ({got})")
        for j in range(self.world_size):
            if j != self.rank:
                t.wait(c._flag(self.rank, 0, j), value)
        t.stream.synchronize()
        comm.all_reduce_min(1)  # every rank read its flags before they are reset
        flags.zero_()
        torch.cuda.synchronize(self.device)
        comm.all_reduce_min(1)

    def _self_test_ce(self) -> None:
        """One copy-engine all-reduce on small integers (every sum exact), over a ragged length and two
        rounds (a message longer than one round's buffers), and one through ``all_reduce_start``."""
        ws, dev = self.world_size, self.device
        per_round = ws * self._ce.chunk_max // 2
        n = per_round + 3 * 4096 + 7 if per_round <= (8 << 20) and self.ce_mode != "oneshot" else 3 * 4096 + 7
        base = torch.arange(n, device=dev, dtype=torch.float32) % 13
        want = ws * base + ws * (ws - 1) // 2
        problems = []
        got = self._ce_run((base + self.rank).to(torch.bfloat16))
        if not torch.equal(got.float(), want):
            problems.append("sum")
        x = (base[: 4096 * 3] + self.rank).to(torch.bfloat16)
        got = self._ce_start(x)()
        if not torch.equal(got.float(), want[: 4096 * 3]):
            problems.append("sum started and waited for")
        if self.ce_mode == "oneshot":  # two calls in flight (both parities, the consumed flags)
            from hwkv.model.layers import add_rms_norm

            rows = [(base[i * 1024: (i + 2) * 1024] + self.rank).to(torch.bfloat16).view(2, 1024) for i in range(3)]
            res, w = torch.ones_like(rows[0]), torch.full((1024,), 0.5, dtype=torch.bfloat16, device=dev)
            waits = [self._ce.start(r, norm=(res, w, 1e-5)) for r in rows[:2]]
            got = [waits[0]()]
            waits.append(self._ce.start(rows[2], norm=(res, w, 1e-5)))  # with the call before in flight
            got += [waits[1](), waits[2]()]
            for i, (o, h) in enumerate(got):
                want_out, want_h = add_rms_norm(want[i * 1024: (i + 2) * 1024].view(2, 1024).to(torch.bfloat16),
                                                res, w, 1e-5)
                if not torch.equal(h, want_h) or not torch.allclose(o.float(), want_out.float(), rtol=2e-2,
                                                                    atol=1e-2):
                    problems.append(f"sum + residual + RMSNorm, call {i}")
        if problems:
            raise RuntimeError(f"copy-engine all-reduce self-test failed on rank {self.rank}: {', '.join(problems)}")

    def _ce_start(self, t: torch.Tensor) -> Any:
        """Start the copy-engine all-reduce of ``t`` on its side stream (after what the current stream
        enqueued); the returned ``wait()`` orders the current stream after it and returns ``t``."""
        if self.ce_mode == "oneshot":
            return self._ce.start(t)
        cur, side = torch.cuda.current_stream(self.device), self._ce_stream
        side.wait_stream(cur)
        self._ce.all_reduce(t)
        done = torch.cuda.Event()
        done.record(side)

        def wait() -> torch.Tensor:
            torch.cuda.current_stream(self.device).wait_event(done)
            return t

        return wait

    def _ce_run(self, t: torch.Tensor) -> torch.Tensor:
        return self._ce_start(t)()

    def _ce_eligible(self, t: torch.Tensor) -> bool:
        """Whether the copy-engine path takes ``t`` (the same answer on every rank: sizes, capture and the calls
        in flight are the same on all). The one-shot form: a message within its slot, at most one call in flight
        (its module doc: no deadlock)."""
        if not self.ce_min or self._eligible(t) < self.ce_min or torch.cuda.is_current_stream_capturing():
            return False
        return self.ce_mode != "oneshot" or (self._ce.fits(t) and self._ce.can_start())

    def all_reduce_start(self, t: torch.Tensor) -> Any:
        """``Communicator.all_reduce_start`` for what the copy engines take (else ``None``: the caller's)."""
        return self._ce_start(t) if self._ce_eligible(t) else None

    def all_reduce_add_rms_norm_start(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                      eps: float) -> Any:
        """``Communicator.all_reduce_add_rms_norm_start``: the one-shot copy-engine path's sum fused into the
        norm when the caller waits (else ``None``)."""
        if self.ce_mode != "oneshot" or not self._ce_eligible(t) or t.dim() != 2 or residual.shape != t.shape \
                or residual.dtype != t.dtype or not residual.is_contiguous() or weight.shape != (t.shape[1],) \
                or not weight.is_contiguous() or t.shape[1] > 16384:
            return None
        return self._ce.start(t, norm=(residual, weight, eps))

    def _peer_buffer(self, nbytes: int, tag: str) -> tuple[torch.Tensor, torch.Tensor]:
        """A zeroed local buffer of ``nbytes`` and the int64 tensor of every rank's buffer address as
        mapped here (CUDA IPC handles exchanged through the group's store; peers are opened with
        lazy peer access: NVLink loads and stores, no multicast)."""
        from hwkv_cuda.ipc import CudaIpcMover

        if self._mover is None:
            self._mover = CudaIpcMover(self.device, method="memcpy", streams=1)
        buf = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        self._bufs.append(buf)
        key = f"ar/{self.name}/{tag}/"
        try:
            mine = self._mover.export(buf.data_ptr(), nbytes)
        except Exception:
            self._store.set(key + str(self.rank), b"")  # peers waiting for this key learn it failed
            raise
        self._store.set(key + str(self.rank), struct.pack("<qQ", os.getpid(), buf.data_ptr()) + mine)
        ptrs = []
        for r in range(self.world_size):
            if r == self.rank:
                ptrs.append(buf.data_ptr())
                continue
            raw = self._store.get(key + str(r))
            if not raw:
                raise RuntimeError(f"rank {r} could not export its {tag} buffer")
            pid, base = struct.unpack("<qQ", raw[:16])
            ptr, token = self._mover.attach(pid, base, nbytes, raw[16:])
            self._tokens.append(token)
            ptrs.append(ptr)
        return buf, torch.tensor(ptrs, dtype=torch.int64, device=self.device)

    def _setup_push(self) -> None:
        if self.push_max:
            from hwkv_cuda.kernels.allreduce import REGION

            self.programs = -(-self.push_max // REGION)
            self.slot_bytes = self.programs * REGION
            data = 2 * self.world_size * self.slot_bytes
            self.buf, self.peers = self._peer_buffer(data + self.programs * self.world_size * 8, "push")
            self.flags = self.buf[data:].view(torch.int64)
            self.flag_off = data // 8
            self.epochs = torch.zeros(self.programs, dtype=torch.int64, device=self.device)
            self.error = torch.zeros(1, dtype=torch.int32, device=self.device)
        if self.norm_max:
            rows = self.norm_max // MIN_ROW_BYTES
            data = 2 * self.world_size * self.norm_max
            self.nbuf, self.npeers = self._peer_buffer(data + rows * self.world_size * 8, "norm")
            self.nflags = self.nbuf[data:].view(torch.int64)
            self.nflag_off = data // 8
            self.nepochs = torch.zeros(rows, dtype=torch.int64, device=self.device)
        if self.ll_max:  # [2 parities][rank] slots of int64 words (two 16-bit elements + the epoch each)
            from hwkv_cuda.kernels.allreduce import REGION

            self.ll_programs = -(-self.ll_max // REGION)
            self.ll_slot_w = self.ll_programs * REGION // 4
            self.lbuf, self.lpeers = self._peer_buffer(2 * self.world_size * self.ll_slot_w * 8, "ll")
            self.lepochs = torch.zeros(self.ll_programs, dtype=torch.int64, device=self.device)
            self.g_programs = -(-GATHER_MAX // REGION)
            self.g_slot_w = self.g_programs * REGION // 4
            self.gbuf, self.gpeers = self._peer_buffer(2 * self.world_size * self.g_slot_w * 8, "llg")
            self.gepochs = torch.zeros(self.g_programs, dtype=torch.int64, device=self.device)
        if self.fused:  # [site][rank] slots, then int64 [arrivals per site (one per peer and call) | finished
            # consumer programs per site | finished producer programs per site]
            data = FUSED_SITES * self.world_size * FUSED_SLOT
            self.fbuf, self.fpeers = self._peer_buffer(data + 3 * FUSED_SITES * 8, "fused")
            self.fcnt = self.fbuf[data:].view(torch.int64)
            self.fcnt_off = data // 8
            if not hasattr(self, "error"):
                self.error = torch.zeros(1, dtype=torch.int32, device=self.device)

    def _self_test(self) -> None:
        """One call of every push kernel on known values (small integers: every sum exact), checked
        here, before any forward relies on them: a kernel this Triton cannot compile or peer memory
        that does not carry the stores raises (every rank then falls back to NCCL together) instead of
        failing or corrupting the first forward. Every rank runs the same calls (the epochs stay equal)."""
        from hwkv.model.layers import add_rms_norm
        from hwkv_cuda.kernels.allreduce import REGION

        ws, dev = self.world_size, self.device
        base = torch.arange(3 * REGION // 2 + 5, device=dev, dtype=torch.float32) % 13  # a ragged last program
        want = ws * base + ws * (ws - 1) // 2
        problems = []
        if self.push_max:
            got = self._push((base + self.rank).to(torch.bfloat16), None)
            if not torch.equal(got.float(), want):
                problems.append("push")
            one = torch.ones_like(base, dtype=torch.bfloat16)
            got = self._push((base + self.rank).to(torch.bfloat16), one)
            if not torch.equal(got.float(), want + 1):
                problems.append("push + residual")
        if self.norm_max:
            rows = (base[: 2 * 256] + self.rank).to(torch.bfloat16).view(2, 256)
            res, w = torch.ones_like(rows), torch.full((256,), 0.5, dtype=torch.bfloat16, device=dev)
            got = self._push_norm(rows, res, w, 1e-5)  # (the model's first call fixes the hidden size)
            want_out, want_h = add_rms_norm(want[: 2 * 256].view(2, 256).to(torch.bfloat16), res.clone(), w, 1e-5)
            if not torch.equal(got[1], want_h) or not torch.allclose(got[0].float(), want_out.float(), rtol=2e-2,
                                                                    atol=1e-2):
                problems.append("push + residual + RMSNorm")
        if (self.push_max or self.norm_max) and int(self.error.item()):
            problems.append("a peer's flag never came")
        if problems:
            raise RuntimeError(f"push all-reduce self-test failed on rank {self.rank}: {', '.join(problems)}")

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Every rank's ``[R, S]`` ``t`` side by side along the last dim (``Communicator.all_gather``) by the
        low-latency gather, or ``None`` to decline: not set up, not taken (``HWKV_PUSH_GATHER``), not a contiguous 2-D
        16-bit tensor gathered along its last dim, or a part over ``GATHER_MAX`` bytes."""
        if not self.ll_max or os.environ.get(GATHER_ENV, "0") != "1" or t.dim() != 2 or dim not in (-1, 1) \
                or t.element_size() != 2 or t.dtype not in DTYPES or not t.is_cuda or not t.is_contiguous() \
                or t.numel() * 2 > GATHER_MAX:
            return None
        return self._gather(t)

    def _gather(self, t: torch.Tensor) -> torch.Tensor:
        from hwkv_cuda.kernels.allreduce import REGION, push_ll_gather_kernel

        r, s = t.shape
        out = torch.empty((r, s * self.world_size), dtype=t.dtype, device=t.device)
        if t.numel() == 0:
            return out
        block = REGION // 2
        push_ll_gather_kernel[(-(-t.numel() // block),)](
            t, out, self.gbuf.view(torch.int64), self.gpeers, self.gepochs, self.error, t.numel(), s, RANK=self.rank,
            WS=self.world_size, SLOT_W=self.g_slot_w, BLOCK=block, PDL=self.pdl, num_warps=4,
            **({"launch_pdl": True} if self.pdl else {}))
        return out

    def _self_test_ll(self) -> None:
        """The low-latency push on known values (small integers: every sum exact), plain and with the residual,
        bf16 and fp16, over more than one program (the epochs of every program advance alike on every rank)."""
        from hwkv_cuda.kernels.allreduce import REGION

        ws, dev = self.world_size, self.device
        n = min(self.ll_max // 2, 3 * REGION // 4 + 5)  # a ragged last program
        base = torch.arange(n, device=dev, dtype=torch.float32) % 13
        want = ws * base + ws * (ws - 1) // 2
        problems = []
        for dt in (torch.bfloat16, torch.float16):
            if not torch.equal(self._push((base + self.rank).to(dt), None, ll=True).float(), want):
                problems.append(f"{dt} push")
            one = torch.ones_like(base, dtype=dt)
            if not torch.equal(self._push((base + self.rank).to(dt), one, ll=True).float(), want + 1):
                problems.append(f"{dt} push + residual")
        x = (torch.arange(2 * 1537, device=dev, dtype=torch.float32).view(2, 1537) % 11 + 16 * self.rank)
        want_g = torch.cat([x - 16 * self.rank + 16 * r for r in range(ws)], dim=1)
        for dt in (torch.bfloat16, torch.float16):
            if not torch.equal(self._gather(x.to(dt)).float(), want_g):
                problems.append(f"{dt} gather")
        if int(self.error.item()):
            problems.append("a peer's words never came")
        if problems:
            raise RuntimeError(f"low-latency push self-test failed on rank {self.rank}: {', '.join(problems)}")

    def _self_test_fused(self) -> None:
        """The all-reduce inside the decode GEMVs on known values (an identity weight, small integers:
        every sum exact): a projection pushing its output, then the sum alone and the sum inside an
        RMSNorm GEMV (both sites, so the model's first forward finds them as a forward leaves them)."""
        from hwkv.model.layers import add_rms_norm
        from hwkv_cuda.decode_ops import TritonDecodeOps, TritonRankSum

        ws, dev, k = self.world_size, self.device, 256
        red = TritonRankSum(TritonDecodeOps(), self)
        base = torch.arange(k, device=dev, dtype=torch.float32)[None, :] % 7
        x, eye = (base + self.rank).to(torch.bfloat16), torch.eye(k, dtype=torch.bfloat16, device=dev)
        res = torch.ones_like(x)
        want = (ws * base + ws * (ws - 1) // 2 + 1).to(torch.bfloat16)
        problems = []
        if not torch.equal(red.sum(red.linear(x, eye, None), res), want):
            problems.append("sum")
        nw = torch.full((k,), 0.5, dtype=torch.bfloat16, device=dev)
        out, h = red.norm_linear(red.linear(x, eye, None), res, nw, 1e-5, eye, None)
        want_out, _ = add_rms_norm(want - 1, torch.ones_like(want), nw, 1e-5)
        if not torch.equal(h, want) or not torch.allclose(out.float(), want_out.float(), rtol=2e-2, atol=1e-2):
            problems.append("sum in the RMSNorm prologue")
        if int(self.error.item()):
            problems.append("a peer's arrivals never came")
        if problems:
            raise RuntimeError(f"fused all-reduce self-test failed on rank {self.rank}: {', '.join(problems)}")

    def _prepare_symm(self, comm: Any) -> None:
        """PyTorch's one-shot/two-shot ops rendezvous under ``self.name``: group info set from this
        group's store (and, where torch resolves groups by name, a registered ProcessGroup wrapping
        this group's NCCL backend); the staging buffer allocated."""
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem
        from torch._C._distributed_c10d import _SymmetricMemory

        symm_store = dist.PrefixStore("symm_mem/", self._store)
        with contextlib.suppress(Exception):  # newer torch may resolve the group instead of this map
            _SymmetricMemory.set_group_info(self.name, self.rank, self.world_size, symm_store)
        # keep torch's Python helper (which looks the group up in its own world) from redoing it
        getattr(symm_mem, "_group_name_to_store", {}).setdefault(self.name, symm_store)
        self._symm_group = _register_group(self.name, comm, symm_store)
        self._registered = self._symm_group is not None
        get_backend = getattr(symm_mem, "get_backend", None)
        if get_backend is not None and get_backend(self.device) not in (None, "CUDA"):
            symm_mem.set_backend("CUDA")  # peer mappings through the CUDA driver
        with torch.cuda.device(self.device):
            self.staging = symm_mem.empty(max(self.one_shot_max, self.two_shot_max), dtype=torch.uint8,
                                          device=self.device)
        self._bufs.append(self.staging)

    def _rendezvous_symm(self, comm: Any) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        with torch.cuda.device(self.device):
            symm_mem.rendezvous(self.staging, self.name)

    def _use_ll(self, t: torch.Tensor) -> bool:
        return bool(self.ll_max) and t.element_size() == 2 and t.numel() * 2 <= self.ll_max \
            and os.environ.get(LL_ENV, "0") == "1"

    def _push(self, t: torch.Tensor, residual: torch.Tensor | None, ll: bool | None = None) -> torch.Tensor:
        """The push all-reduce (+ ``residual``); ``ll``: the low-latency form (None: where it applies and is on)."""
        from hwkv_cuda.kernels.allreduce import REGION, push_all_reduce_kernel, push_ll_kernel

        flat = t.view(-1)
        out = flat if residual is None else torch.empty_like(flat)
        block = REGION // t.element_size()
        if self._use_ll(t) if ll is None else ll:
            push_ll_kernel[(-(-flat.numel() // block),)](
                flat, residual.view(-1) if residual is not None else flat, out, self.lbuf.view(torch.int64),
                self.lpeers, self.lepochs, self.error, flat.numel(), RANK=self.rank, WS=self.world_size,
                SLOT_W=self.ll_slot_w, BLOCK=block, HAS_RES=residual is not None, PDL=self.pdl, num_warps=4,
                **({"launch_pdl": True} if self.pdl else {}))
            return out.view(t.shape)
        push_all_reduce_kernel[(-(-flat.numel() // block),)](
            flat, residual.view(-1) if residual is not None else flat, out, self.buf.view(t.dtype), self.flags,
            self.peers, self.epochs, self.error, flat.numel(), RANK=self.rank, WS=self.world_size,
            SLOT=self.slot_bytes // t.element_size(), FLAG_OFF=self.flag_off, BLOCK=block,
            HAS_RES=residual is not None, PDL=self.pdl, num_warps=4, **({"launch_pdl": True} if self.pdl else {}))
        return out.view(t.shape)

    def _eligible(self, t: torch.Tensor) -> int:
        """The message's bytes, or 0 when no path here takes it."""
        if t.dtype not in DTYPES or not t.is_cuda or not t.is_contiguous():
            return 0
        return t.numel() * t.element_size()

    def __call__(self, t: torch.Tensor) -> torch.Tensor | None:
        nbytes = self._eligible(t)
        if not nbytes:
            return None
        if nbytes <= self.push_max:
            self._push(t, None)
            return t
        if self._ce_eligible(t):
            return self._ce_run(t)
        if nbytes <= self.one_shot_max and nbytes % 16 == 0:
            flat = t.view(-1)
            buf = self.staging[:nbytes].view(t.dtype)
            buf.copy_(flat)
            torch.ops.symm_mem.one_shot_all_reduce_out(buf, "sum", self.name, flat)
            return t
        if nbytes <= self.two_shot_max and nbytes % (16 * self.world_size) == 0:
            flat = t.view(-1)
            buf = self.staging[:nbytes].view(t.dtype)
            buf.copy_(flat)
            torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.name)
            flat.copy_(buf)
            return t
        return None

    def all_reduce_add(self, t: torch.Tensor, residual: torch.Tensor) -> torch.Tensor | None:
        nbytes = self._eligible(t)
        if not nbytes or nbytes > self.push_max or residual.shape != t.shape or residual.dtype != t.dtype \
                or not residual.is_contiguous():
            return None
        return self._push(t, residual)

    def all_reduce_add_rms_norm(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(rms_norm(h) * weight, h)`` with ``h = residual + sum of t``, one kernel (rows of one
        hidden size per group: the first call fixes it, other sizes are declined). Messages the one-shot
        copy-engine path takes: its sum fused into the norm, in stream order."""
        if (wait := self.all_reduce_add_rms_norm_start(t, residual, weight, eps)) is not None:
            return wait()
        nbytes = self._eligible(t)
        if not nbytes or nbytes > self.norm_max or t.dim() != 2 or residual.shape != t.shape \
                or residual.dtype != t.dtype or not residual.is_contiguous() or weight.shape != (t.shape[1],) \
                or not weight.is_contiguous() or t.shape[1] * t.element_size() < MIN_ROW_BYTES:
            return None
        key = (t.shape[1], t.dtype)
        if self._norm_key is None:
            self._norm_key = key
        elif key != self._norm_key:
            return None
        return self._push_norm(t, residual, weight, eps)

    def _push_norm(self, t: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        from hwkv_cuda.kernels.allreduce import push_all_reduce_norm_kernel

        out, h = torch.empty_like(t), torch.empty_like(t)
        push_all_reduce_norm_kernel[(t.shape[0],)](
            t, residual, weight, out, h, self.nbuf.view(t.dtype), self.nflags, self.npeers, self.nepochs, self.error,
            t.shape[1], eps, RANK=self.rank, WS=self.world_size, SLOT=self.norm_max // t.element_size(),
            FLAG_OFF=self.nflag_off, BLOCK=triton_next_pow2(t.shape[1]), PDL=self.pdl,
            num_warps=self.norm_warps or (8 if t.shape[1] >= 4096 else 4), **({"launch_pdl": True} if self.pdl else {}))
        return out, h

    def failed(self) -> bool:
        """Whether a push ever gave up waiting for a peer (a host sync: diagnostics only)."""
        return bool(self.push_max) and bool(self.error.item())

    def close(self) -> None:
        if self._registered:
            from torch._C._distributed_c10d import _unregister_process_group

            _unregister_process_group(self.name)
            self._registered, self._symm_group = False, None
        mover, self._mover = getattr(self, "_mover", None), None
        for token in getattr(self, "_tokens", []):
            with contextlib.suppress(Exception):  # closing: a peer may already be gone
                mover.detach(token)
        self._tokens = []
        self._bufs.clear()
        self.staging = self.buf = self.nbuf = self.fbuf = None  # type: ignore[assignment]
        self._ce = self._ce_stream = None


def _register_group(name: str, comm: Any, store: Any) -> Any:
    """Register ``comm``'s NCCL backend under ``name`` in c10d's group registry (what symmetric
    memory's rendezvous resolves) and return the group, which the caller must keep: the registry
    holds a weak reference (the first two-GPU run of this path failed on "process group ... has
    already been destroyed"). ``None`` where this torch has no such registry."""
    try:
        from torch._C._distributed_c10d import ProcessGroup, _register_process_group
    except ImportError:
        return None
    backend = getattr(comm, "torch_group", None)
    pg = ProcessGroup(store, comm.rank, comm.world_size)
    kind = ProcessGroup.BackendType.NCCL
    pg._set_default_backend(kind)
    if backend is not None:
        pg._register_backend(torch.device("cuda"), kind, backend)
    if hasattr(pg, "_set_group_name"):
        pg._set_group_name(name)
    _register_process_group(name, pg)
    return pg


def _same_device_index(comm: Any, device: Any) -> bool:
    """Whether every rank's device has the same index (collective: every rank calls it)."""
    idx = torch.device(device).index or 0
    return comm.all_reduce_min(idx) == -comm.all_reduce_min(-idx)


def _use_pdl(device: Any) -> bool:
    from hwkv_cuda.launch import use_pdl

    return use_pdl(torch.device(device))


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()
