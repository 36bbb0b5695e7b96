"""Size the paged KV pool and check the backend supports the configuration (used by
:meth:`hwkv.engine.config.EngineArgs.resolve`)."""

from __future__ import annotations

from typing import Any


def check_backend(backend: Any, model: Any, block_size: int) -> None:
    """``ValueError`` listing every reason the backend cannot run this model / block size."""
    mc = model.config
    spec = model.kv_cache_spec(1, block_size)
    reasons = backend.capabilities.validate(spec, mc.num_heads, backend.attention.kv_layout,
                                            model_dtype=getattr(model, "dtype", None),
                                            attention_features=tuple(getattr(model, "attention_features", ())))
    if reasons:
        raise ValueError(f"backend {backend.name!r} cannot run {mc.path or 'this model'}: " + "; ".join(reasons))


def pool_blocks(args: Any, backend: Any, bytes_per_block: int, block_size: int, max_model_len: int,
                reserved_bytes: int = 0) -> int:
    """``args.num_kv_blocks``, else what ``memory_fraction`` of device memory leaves after everything
    already allocated (weights included) and ``reserved_bytes`` (KV-cache window groups), capped at what
    ``max_num_seqs`` full-length requests use."""
    if args.num_kv_blocks is not None:
        return int(args.num_kv_blocks)
    free, total = backend.device.memory_info()
    budget = free - int(total * (1.0 - args.memory_fraction)) - reserved_bytes
    n = budget // bytes_per_block
    if n < 1:
        raise ValueError(
            f"memory_fraction {args.memory_fraction} leaves no memory for the KV cache on {backend.device.name} "
            f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB); raise memory_fraction or set num_kv_blocks"
        )
    return int(min(n, args.max_num_seqs * -(-max_model_len // block_size)))
