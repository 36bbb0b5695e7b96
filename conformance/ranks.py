"""Rank processes of the multi-device tests: ``python -m conformance.ranks SPEC RANK WORLD PORT SCENARIO OUT``.

Each rank rebuilds the backend under test from ``SPEC`` (``plugin:NAME`` or ``mutant:NAME``), joins
a group through :class:`~hwkv.parallel.communicator.TorchDistCommunicator` on the parent's
rendezvous store at ``PORT``, runs ``SCENARIO`` and writes its findings as JSON to ``OUT``: a list of
checks ``[what, ok, detail]``, a digest of every result's bytes (the ranks' digests must match:
results are bitwise identical on every rank) and the argument coverage of the rank's interface calls
(the backend seen through :func:`conformance.coverage.recording`, plus the communicator and custom
all-reduce calls), which the parent merges into the report's.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
import zlib
from typing import Any

import torch

from conformance.coverage import Coverage, recording

COV = Coverage()  # this rank's argument coverage (written to OUT)


def note(method: str, **args: Any) -> None:
    COV.note(method, args)

# one element .. tens of MiB (float32: 4 B .. 32 MiB); odd counts (no vector width divides them)
SIZES = (1, 3, 4097, (1 << 20) + 3, (8 << 20) + 1)
CAPTURE_SIZES = (1, 4097, (1 << 20) + 3, (8 << 20) + 1)  # captured too: 1 element .. tens of MiB


def build(spec: str) -> Any:
    kind, _, name = spec.partition(":")
    if kind == "plugin":
        from hwkv.plugins import get_backend

        return get_backend(name)
    if kind == "mutant":
        from conformance.mutants import controls, load

        return controls()[name] if name.startswith("control") else load()[name].build()
    raise ValueError(f"backend spec {spec!r}: need plugin:NAME or mutant:NAME")


def values(dtype: torch.dtype, n: int, rank: int, salt: str = "") -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{dtype}-{n}-{rank}-{salt}".encode()))
    return (torch.randn(n, generator=g) * 3).to(dtype)


class Checks:
    def __init__(self) -> None:
        self.items: list[list[Any]] = []
        self.digest = hashlib.sha256()

    def same(self, what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        got, want = got.detach().cpu(), want.detach().cpu()
        self.digest.update(got.contiguous().view(torch.uint8).numpy().tobytes() if got.numel() else b"")
        if got.shape != want.shape or got.dtype != want.dtype:
            self.items.append([what, False, f"shape/dtype {tuple(got.shape)} {got.dtype} != {tuple(want.shape)} "
                                            f"{want.dtype}"])
            return
        diff = got.float() != want.float()
        n = int(diff.sum())
        first = int(diff.nonzero()[0]) if n else -1
        self.items.append([what, n == 0, f"{n} of {got.numel()} elements differ" + (
            f" (first at {first}: {float(got.reshape(-1)[first])} vs {float(want.reshape(-1)[first])})" if n else "")])

    def close(self, what: str, got: torch.Tensor, want: torch.Tensor, rtol: float, scale: torch.Tensor) -> None:
        """``got`` within ``rtol * scale`` of ``want`` elementwise (``scale``: the sum of the terms'
        magnitudes; a fused kernel may round once where the unfused order rounds twice)."""
        got, want = got.detach().cpu().float(), want.detach().cpu().float()
        self.digest.update(got.contiguous().view(torch.uint8).numpy().tobytes() if got.numel() else b"")
        if got.shape != want.shape:
            self.items.append([what, False, f"shape {tuple(got.shape)} != {tuple(want.shape)}"])
            return
        bad = (got - want).abs() > rtol * scale
        n = int(bad.sum())
        self.items.append([what, n == 0, f"{n} of {got.numel()} elements outside rtol={rtol}"])

    def ok(self, what: str, cond: bool, detail: str = "") -> None:
        self.items.append([what, bool(cond), detail])


def collectives(backend: Any, comm: Any, rank: int, world: int, ck: Checks) -> None:
    dev, caps = backend.device, backend.capabilities
    on = dev.torch_device
    for dtype in caps.dtypes:
        dn = str(dtype).removeprefix("torch.")
        for n in SIZES:
            t = values(dtype, n, rank).to(on)
            ptr = t.data_ptr()
            note("Communicator.all_reduce", t=t)
            out = comm.all_reduce(t)
            want = values(dtype, n, 0)
            for r in range(1, world):  # a + b rounds once, whatever the order, for two ranks
                want = want + values(dtype, n, r)
            ck.ok(f"all_reduce {dn} x{n}: returns its argument, reduced in place", out is t and t.data_ptr() == ptr)
            ck.same(f"all_reduce {dn} x{n}", t, want)
        for dim, shape in ((-1, (3, 5)), (0, (4, 7))):
            t = values(dtype, shape[0] * shape[1], rank, "g").reshape(shape).to(on)
            want = torch.cat([values(dtype, shape[0] * shape[1], r, "g").reshape(shape) for r in range(world)], dim)
            note("Communicator.all_gather", t=t, dim=dim)
            ck.same(f"all_gather {dn} {shape} dim={dim}", comm.all_gather(t, dim), want)
        src = world - 1
        t = values(dtype, 4099, rank, "b").to(on)
        note("Communicator.broadcast", t=t, src=src)
        ck.same(f"broadcast {dn} x4099 from rank {src}", comm.broadcast(t, src), values(dtype, 4099, src, "b"))
        custom = dev.custom_all_reduce(comm)
        note("Device.custom_all_reduce", comm=comm, returned=custom)
        if custom is not None:
            for n in SIZES:
                t = values(dtype, n, rank, "c").to(on)
                note("CustomAllReduce.__call__", t=t)
                if custom(t) is None:
                    continue  # declined: the communicator's own all-reduce runs instead
                want = values(dtype, n, 0, "c")
                for r in range(1, world):
                    want = want + values(dtype, n, r, "c")
                ck.same(f"custom_all_reduce {dn} x{n}", t, want)
            add = getattr(custom, "all_reduce_add", None)
            for n in SIZES[:3] if add is not None else ():
                # residual + the sum over ranks (the residual is the same on every rank, as in TP)
                t, res = values(dtype, n, rank, "a").to(on), values(dtype, n, 0, "res").to(on)
                note("CustomAllReduce.all_reduce_add", t=t, residual=res)
                out = add(t, res)
                note("CustomAllReduce.all_reduce_add", fused=out is not None)
                if out is None:
                    continue  # declined
                parts = [values(dtype, n, r, "a").float() for r in range(world)] + [values(dtype, n, 0, "res").float()]
                want = parts[0]
                for p in parts[1:]:
                    want = want + p
                scale = sum(p.abs() for p in parts)
                ck.close(f"custom all_reduce_add {dn} x{n}", out, want, 2**-22 if dtype == torch.float32 else 2**-7,
                         scale)
                ck.same(f"custom all_reduce_add {dn} x{n}: residual untouched", res, values(dtype, n, 0, "res"))
            if getattr(custom, "all_reduce_add_rms_norm", None) is not None:
                add_norm(custom, dtype, on, rank, world, ck)
                if caps.graph_capture and comm.capturable and dtype == caps_dtype(backend):
                    fused_captured(backend, custom, dtype, rank, world, ck)
    dev.synchronize()
    if caps.graph_capture and comm.capturable:
        captured(backend, comm, rank, world, ck)


NORM_HIDDEN, NORM_ROWS, NORM_EPS = 4099, (1, 7, 64), 1e-5  # one hidden size per group: a kernel may fix it
# (3.2) eps per row count: Llama's 1e-5, Qwen's 1e-6 and a large one the result visibly depends on (a kernel
# that hard-codes its eps passes at 1e-5 / 1e-6 within the float32 bound, not at 1e-2)
NORM_EPS_ROWS = {1: 1e-5, 7: 1e-6, 64: 1e-2}


def add_norm(custom: Any, dtype: torch.dtype, on: Any, rank: int, world: int, ck: Checks) -> None:
    """``all_reduce_add_rms_norm(t, residual, weight, eps)``: ``h = residual + (t summed over the ranks)``
    with the rounding of ``add_rms_norm`` after the all-reduce (the sum rounded, then the add: bit-exact for
    two ranks), ``rms_norm(h, weight, eps)`` from that ``h``; residual and weight untouched; the same
    answer on every rank (the digest). Rows with massive activations and a zero sum check the norm."""
    from hwkv.model.layers import rms_norm

    dn = str(dtype).removeprefix("torch.")
    w = (1 + 0.2 * values(torch.float32, NORM_HIDDEN, 0, "nw")).to(dtype)
    for rows in NORM_ROWS:
        n, eps = rows * NORM_HIDDEN, NORM_EPS_ROWS[rows]
        parts = [values(dtype, n, r, f"nt{rows}").reshape(rows, NORM_HIDDEN) for r in range(world)]
        res = values(dtype, n, 0, f"nres{rows}").reshape(rows, NORM_HIDDEN)
        if rows > 1:
            parts = [p.clone() for p in parts]
            for p in parts:
                p[0] *= 64  # massive activations: float16 squares overflow past 256
                p[1] = 0
            res[1] = 0  # h = 0: finite only with eps inside the root
        # copies (on a host device .to() would hand back the very tensors the expectation is computed from)
        t, r_dev, w_dev = (x.to(on, copy=True) for x in (parts[rank], res, w))
        note("CustomAllReduce.all_reduce_add_rms_norm", t=t, residual=r_dev, weight=w_dev, eps=eps)
        out = custom.all_reduce_add_rms_norm(t, r_dev, w_dev, eps)
        note("CustomAllReduce.all_reduce_add_rms_norm", fused=out is not None)  # declined calls show in coverage
        if out is None:
            continue  # declined: the caller runs all_reduce and its own add + norm
        y, h = out
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        want_h = total + res
        what = f"custom all_reduce_add_rms_norm {dn} [{rows}, {NORM_HIDDEN}] eps {eps:g}"
        if world == 2:
            ck.same(f"{what}: h = residual + sum", h.reshape(-1), want_h.reshape(-1))
        else:
            ck.close(f"{what}: h = residual + sum", h.reshape(-1), want_h.reshape(-1), 2**-22 if dtype == torch.float32
                     else 2**-7, (sum(p.abs().float() for p in parts) + res.abs().float()).reshape(-1))
        want_y = rms_norm(h.detach().cpu(), w, eps)  # from the h it returned: the norm's own error only
        ck.close(f"{what}: rms_norm(h)", y.reshape(-1), want_y.reshape(-1), 2**-18 if dtype == torch.float32 else 2**-6,
                 want_y.abs().float().reshape(-1) + 1e-6)
        ck.same(f"{what}: residual untouched", r_dev.reshape(-1), res.reshape(-1))
        ck.same(f"{what}: weight untouched", w_dev, w)


def fused_captured(backend: Any, custom: Any, dtype: torch.dtype, rank: int, world: int, ck: Checks) -> None:
    """``all_reduce_add_rms_norm`` and ``all_reduce_add`` captured into one graph (the engine captures its
    decode steps with them) and replayed after t, residual and weight changed in place: each replay
    reduces, adds and normalises the new contents. A call declined inside the capture is allowed."""
    from hwkv.model.layers import rms_norm

    dev, on = backend.device, backend.device.torch_device
    rows, n = 7, 7 * NORM_HIDDEN
    t, res, w = (torch.zeros(rows, NORM_HIDDEN, dtype=dtype, device=on) for _ in range(3))
    t2, res2 = (torch.zeros(4099, dtype=dtype, device=on) for _ in range(2))
    w.fill_(1)
    if custom.all_reduce_add_rms_norm(t, res, w, NORM_EPS) is None:  # warm-up outside the capture
        return
    add = getattr(custom, "all_reduce_add", None)
    if add is not None:
        add(t2, res2)  # its warm-up too: no kernel compiles inside the capture
    dev.synchronize()

    def step():
        return custom.all_reduce_add_rms_norm(t, res, w, NORM_EPS), add(t2, res2) if add is not None else None

    graph, (out, out2) = dev.capture_graph(step, dev.graph_pool(), dev.new_stream())
    note("CustomAllReduce.all_reduce_add_rms_norm", captured=True, fused=out is not None)
    for trial in range(2):
        parts = [values(dtype, n, r, f"cf{trial}").reshape(rows, NORM_HIDDEN) for r in range(world)]
        r_new, w_new = values(dtype, n, 0, f"cfr{trial}").reshape(rows, NORM_HIDDEN), values(dtype, NORM_HIDDEN, 0,
                                                                                              f"cfw{trial}")
        p2 = [values(dtype, 4099, r, f"ca{trial}") for r in range(world)]
        r2 = values(dtype, 4099, 0, f"car{trial}")
        for dst, src in ((t, parts[rank]), (res, r_new), (w, w_new), (t2, p2[rank]), (res2, r2)):
            dst.copy_(src.to(on))
        graph.replay()
        dev.synchronize()
        what = f"captured all_reduce_add_rms_norm {str(dtype).removeprefix('torch.')} [{rows}, {NORM_HIDDEN}], " \
               f"replay {trial} after its inputs changed in place"
        if out is not None:
            y, h = out
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            if world == 2:
                ck.same(f"{what}: h", h.reshape(-1), (total + r_new).reshape(-1))
            want_y = rms_norm(h.detach().cpu(), w_new, NORM_EPS)
            ck.close(f"{what}: rms_norm(h)", y.reshape(-1), want_y.reshape(-1),
                     2**-18 if dtype == torch.float32 else 2**-6, want_y.abs().float().reshape(-1) + 1e-6)
        if out2 is not None:
            want = sum(p.float() for p in p2) + r2.float()
            ck.close(f"captured all_reduce_add, replay {trial}", out2, want,
                     2**-22 if dtype == torch.float32 else 2**-7, sum(p.abs().float() for p in p2) + r2.abs().float())
    del graph


def captured(backend: Any, comm: Any, rank: int, world: int, ck: Checks) -> None:
    """all_reduce captured into a graph, replayed after the input changed in place."""
    dev = backend.device
    dtype = caps_dtype(backend)
    pool, stream = dev.graph_pool(), dev.new_stream()
    for n in CAPTURE_SIZES:
        t = values(dtype, n, rank, "w").to(dev.torch_device)
        comm.all_reduce(t)  # warm-up outside the capture (lazy communicator state)
        dev.synchronize()
        note("Communicator.all_reduce", t=t, captured=True)
        graph, _ = dev.capture_graph(lambda t=t: comm.all_reduce(t), pool, stream)
        for trial in range(2):
            t.copy_(values(dtype, n, rank, f"r{trial}").to(dev.torch_device))
            graph.replay()
            dev.synchronize()
            want = values(dtype, n, 0, f"r{trial}")
            for r in range(1, world):
                want = want + values(dtype, n, r, f"r{trial}")
            ck.same(f"captured all_reduce x{n}, replay {trial} after the input changed in place", t, want)
        del graph


def caps_dtype(backend: Any) -> torch.dtype:
    caps = backend.capabilities
    return torch.bfloat16 if torch.bfloat16 in caps.dtypes else caps.dtypes[0]


# (offset, length) in bytes: odd offsets and lengths that no page or vector width divides
SEGMENTS = ((1, 1), (7, 3), (8191, 4097), (70001, 65537), ((1 << 21) + 5, (1 << 20) + 1))
BUF_BYTES = 4 << 20


def pattern(rank: int, salt: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"bytes-{rank}-{salt}".encode()))
    return torch.randint(0, 256, (BUF_BYTES,), generator=g, dtype=torch.uint8)


def direct_transfer(backend: Any, comm: Any, rank: int, world: int, ck: Checks) -> None:
    """Each rank writes segments of its device buffer into the next rank's (on another device), in
    two batches in flight at once waited in reverse order, and reads the previous rank's source
    buffer whole; every declared same-host direct protocol."""
    import json

    from hwkv.transfer.direct import DIRECT_PROTOCOLS

    dev, on = backend.device, backend.device.torch_device
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    for protocol in [p for p in backend.capabilities.transfer_protocols if p in DIRECT_PROTOCOLS]:
        t = backend.create_transfer(protocol=protocol, timeout_s=30.0)
        try:
            src, dst = pattern(rank, protocol).to(on), torch.zeros(BUF_BYTES, dtype=torch.uint8, device=on)
            got = torch.zeros(BUF_BYTES, dtype=torch.uint8, device=on)
            dev.synchronize()
            for b in (src, dst, got):
                t.register(b.data_ptr(), BUF_BYTES)
            comm.store.set(f"xfer/{protocol}/{rank}",
                           json.dumps({"ep": t.endpoint(), "src": src.data_ptr(), "dst": dst.data_ptr()}))
            peer = json.loads(comm.store.get(f"xfer/{protocol}/{nxt}"))  # waits: registered before published
            prev = json.loads(comm.store.get(f"xfer/{protocol}/{prv}"))
            halves = (SEGMENTS[::2][::-1], SEGMENTS[1::2])  # one batch in descending address order
            batches = [t.submit_write(peer["ep"], [src.data_ptr() + o for o, _ in h], [peer["dst"] + o for o, _ in h],
                                      [n for _, n in h]) for h in halves]
            read = t.submit_read(prev["ep"], [got.data_ptr()], [prev["src"]], [BUF_BYTES])
            for b in (read, *reversed(batches)):  # completed out of submission order
                t.wait(b, timeout_s=60.0)
            comm.all_reduce(torch.ones(1, device=on))  # every rank's writes done
            dev.synchronize()
            want = torch.zeros(BUF_BYTES, dtype=torch.uint8)
            theirs = pattern(prv, protocol)
            for o, n in SEGMENTS:
                want[o : o + n] = theirs[o : o + n]
            ck.same(f"{protocol}: segments written by rank {prv} (device {prv}) into rank {rank}'s buffer; nothing "
                    "else changed", dst, want)
            ck.same(f"{protocol}: rank {prv}'s whole buffer read by rank {rank}", got, theirs)
            comm.all_reduce(torch.ones(1, device=on))  # nobody closes while a peer still reads
        finally:
            t.close()


SCENARIOS = {"collectives": collectives, "direct_transfer": direct_transfer}


def main(argv: list[str]) -> int:
    spec, rank, world, port, scenario, out = argv
    rank, world, port = int(rank), int(world), int(port)
    from hwkv.parallel.communicator import TorchDistCommunicator

    ck = Checks()
    t0 = time.monotonic()
    result: dict[str, Any] = {"rank": rank}
    try:
        backend = build(spec)
        comm = TorchDistCommunicator(backend.device, rank, world, port, timeout_s=120.0)
        try:
            SCENARIOS[scenario](recording(backend, COV), comm, rank, world, ck)
        finally:
            comm.close()
    except Exception as e:  # reported to the parent, which fails the test with it
        result["error"] = f"{type(e).__name__}: {e}"[:2000]
    result.update(checks=ck.items, digest=ck.digest.hexdigest(), seconds=round(time.monotonic() - t0, 2),
                  coverage=COV.state())
    with open(out, "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
