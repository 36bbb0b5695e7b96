"""Size and allocate the paged KV cache; check the backend supports the configuration."""

from __future__ import annotations

from typing import Any

from hwkv.engine.config import EngineConfig


def check_backend(backend: Any, model: Any, block_size: int) -> None:
    """``ValueError`` listing every reason the backend cannot run this model / block size."""
    mc = model.config
    spec = model.kv_cache_spec(1, block_size)
    reasons = backend.capabilities.validate(spec, mc.num_heads, backend.attention.kv_layout)
    if reasons:
        raise ValueError(f"backend {backend.name!r} cannot run {mc.path or 'this model'}: " + "; ".join(reasons))


def num_kv_blocks(cfg: EngineConfig, backend: Any, bytes_per_block: int, max_model_len: int) -> int:
    """``cfg.num_kv_blocks``, else what ``memory_fraction`` of device memory leaves after everything
    already allocated (weights included), capped at what ``max_num_seqs`` full-length requests use."""
    if cfg.num_kv_blocks is not None:
        return cfg.num_kv_blocks
    free, total = backend.device.memory_info()
    budget = free - int(total * (1.0 - cfg.memory_fraction))
    n = budget // bytes_per_block
    if n < 1:
        raise ValueError(
            f"memory_fraction {cfg.memory_fraction} leaves no memory for the KV cache on {backend.device.name} "
            f"({free / 2**30:.1f} GiB free of {total / 2**30:.1f} GiB); raise memory_fraction or set num_kv_blocks"
        )
    block_size = cfg.block_size or backend.capabilities.default_block_size
    return int(min(n, cfg.max_num_seqs * -(-max_model_len // block_size)))


def allocate_kv_cache(cfg: EngineConfig, backend: Any, model: Any) -> tuple[Any, int, int]:
    """``(kv_cache, block_size, max_model_len)``.

    ``max_model_len`` defaults to the model's, lowered to what the pool can hold; an explicit one
    larger than the model's or than the pool raises ``ValueError`` (a request that cannot be served
    even alone is refused up front instead of stalling the scheduler).
    """
    mc = model.config
    block_size = cfg.block_size or backend.capabilities.default_block_size
    check_backend(backend, model, block_size)
    model_max = mc.max_model_len
    if cfg.max_model_len is not None:
        mc.check_max_model_len(cfg.max_model_len)
        if cfg.max_model_len > model_max:
            raise ValueError(f"max_model_len {cfg.max_model_len} exceeds the model's {model_max} "
                             f"(allowed: 1..{model_max})")
    max_len = cfg.max_model_len or model_max
    spec1 = model.kv_cache_spec(1, block_size)
    n = num_kv_blocks(cfg, backend, spec1.bytes_per_block, max_len)
    if cfg.max_model_len is None:
        max_len = min(max_len, n * block_size)
    elif n * block_size < max_len:
        raise ValueError(
            f"max_model_len {max_len} needs {-(-max_len // block_size)} KV blocks of {block_size} tokens but the pool "
            f"has {n} (raise num_kv_blocks / memory_fraction or lower max_model_len)"
        )
    spec = model.kv_cache_spec(n, block_size)
    return backend.device.allocate_kv_cache(spec, backend.attention.kv_layout), block_size, max_len
