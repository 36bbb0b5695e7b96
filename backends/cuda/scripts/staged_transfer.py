"""KV blocks from one GPU cache into another over Mooncake tcp, staged through pinned host buffers:
the path the CUDA backend declares where no RDMA device exists. Checks every byte and times the
three legs (GPU -> pinned host batched copy, Mooncake tcp write between two endpoints, pinned host ->
GPU). ``backends/cuda/tests/test_staged_transfer.py`` runs it small; on the device (after
``source backends/cuda/scripts/carry.sh``):

    python3 backends/cuda/scripts/staged_transfer.py --blocks 256 --out "$OUT/staged-transfer.json"
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hwkv.interfaces import KVCacheSpec


def _leg(fn, sync) -> float:
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def round_trip(backend, spec: KVCacheSpec, src_ids: list[int], dst_ids: list[int], repeats: int = 1) -> dict:
    """Move ``src_ids`` of a random GPU cache to ``dst_ids`` of a zeroed one ``repeats`` times through
    two tcp endpoints; raise ``AssertionError`` unless exactly those bytes arrived, and return the
    median seconds per leg. Every registration is released, also on failure."""
    dev, layout = backend.device, backend.attention.kv_layout
    gpu_src, gpu_dst = (dev.allocate_kv_cache(spec, layout) for _ in range(2))
    host_src, host_dst = (dev.allocate_kv_cache(spec, layout, host=True) for _ in range(2))
    g = torch.Generator(device=dev.torch_device).manual_seed(0)
    for t in gpu_src.tensors:
        t.copy_(torch.randn(t.shape, generator=g, device=t.device, dtype=torch.float32).to(t.dtype))
    for t in gpu_dst.tensors:
        t.zero_()
    legs: dict[str, list[float]] = {"d2h": [], "tcp": [], "h2d": []}
    eps = [backend.create_transfer(protocol="tcp")]
    try:
        eps.append(backend.create_transfer(protocol="tcp"))
        a, b = eps
        regs = []  # exactly what registered, to release also when a later register fails
        try:
            for ep, t in [(a, t) for t in host_src.tensors] + [(b, t) for t in host_dst.tensors]:
                ep.register(t.data_ptr(), t.numel() * t.element_size())
                regs.append((ep, t.data_ptr()))
            src_ptrs, dst_ptrs, lengths = host_src.paired_addresses(host_dst, src_ids, dst_ids)
            for _ in range(repeats):
                legs["d2h"].append(_leg(lambda: dev.copy_blocks(gpu_src, host_src, [(s, s) for s in src_ids]),
                                        dev.synchronize))
                legs["tcp"].append(_leg(lambda: a.write(b.endpoint(), src_ptrs, dst_ptrs, lengths), lambda: None))
                legs["h2d"].append(_leg(lambda: dev.copy_blocks(host_dst, gpu_dst, [(d, d) for d in dst_ids]),
                                        dev.synchronize))
        finally:
            for ep, ptr in regs:
                ep.unregister(ptr)
        # released by the unregisters themselves (close() would release them anyway)
        assert a.registered_buffers() == [] and b.registered_buffers() == []
    finally:
        for ep in eps:
            ep.close()
    moved = torch.zeros(spec.num_blocks, dtype=torch.bool)
    moved[dst_ids] = True
    for ti, (ts, td) in enumerate(zip(gpu_src.tensors, gpu_dst.tensors)):
        assert torch.equal(td[dst_ids], ts[src_ids]), f"tensor {ti}: moved blocks differ"
        assert not td[~moved.to(td.device)].any(), f"tensor {ti}: a block that was not moved changed"
    nbytes = sum(lengths)
    med = {k: sorted(v)[len(v) // 2] for k, v in legs.items()}
    return {"bytes": nbytes, "segments": len(lengths), "blocks": len(src_ids),
            **{f"{k}_s": v for k, v in med.items()},
            **{f"{k}_GBps": nbytes / v / 1e9 for k, v in med.items()},
            "total_GBps": nbytes / sum(med.values()) / 1e9}


def main() -> None:
    from hwkv_cuda.backend import CudaBackend

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=256, help="blocks moved, a multiple of 4 (of 2x as many per cache)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    backend = CudaBackend()
    # Llama-3.2-1B's cache: 16 layers x 8 KV heads x head 128, bf16, 16-token blocks (1 MiB a block)
    spec = KVCacheSpec(args.layers, 2 * args.blocks, 16, 8, 128, torch.bfloat16)
    # runs of 4 consecutive source blocks in shuffled order, into consecutive destinations: a
    # segment per run and tensor, as blocks freed and reallocated together come out of the pool
    order = torch.randperm(args.blocks // 4, generator=torch.Generator().manual_seed(1)).tolist()
    src = [4 * r + i for r in order for i in range(4)]
    dst = list(range(args.blocks, args.blocks + len(src)))
    res = round_trip(backend, spec, src, dst, args.repeats)
    res.update(device=torch.cuda.get_device_name(), torch=torch.__version__,
               transfer=backend.capabilities.transfer_reason, spec=str(spec), repeats=args.repeats)
    print(json.dumps(res, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
