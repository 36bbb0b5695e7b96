"""Engine construction: the parts of an :class:`~hwkv.engine.engine.Engine` and the order they are built in.

Order matters: the connector is checked before the model loads; tensor-parallel workers start before
the weights load (each loads its shard); a speculative proposer loads before the KV pool is sized
(a draft model's weights and KV take memory too); the KV cache is allocated before anything that
binds to it (scheduler, runner, graphs); decode ops and fusion change the model before graphs capture it.
"""

from __future__ import annotations

from typing import Any

from hwkv.connectors import bind_connector, make_connector
from hwkv.core.hashing import make_block_hasher
from hwkv.core.kv_cache_manager import KVCacheManager
from hwkv.core.kv_groups import GroupedKVCacheManager
from hwkv.core.scheduler import Scheduler
from hwkv.engine.config import EngineArgs
from hwkv.engine.kv_groups import GroupedKVCache
from hwkv.engine.model_runner import ModelRunner
from hwkv.engine.spec_config import ProposerTarget, make_proposer, spec_runner
from hwkv.engine.tp.executor import TPExecutor, check_supported
from hwkv.engine.tp.messages import DecodeOps
from hwkv.engine.tp.runner import DriverRunner
from hwkv.interfaces.kv_quant import kv_storage_dtype, shard_scales
from hwkv.model import load_model
from hwkv.model.fuse import fuse_elementwise
from hwkv.model.tokenizer import has_tokenizer
from hwkv.parallel.sharding import kv_head_start
from hwkv.plugins import get_backend


def build_parts(engine: Any, args: EngineArgs) -> None:
    """Build and set ``engine``'s parts in order: ``connector``, ``backend``, ``_tp``, ``model``, ``model_config``,
    ``tokenizer``, ``generation_config``, ``proposer``, ``config``, ``block_size``, ``max_model_len``,
    ``kv_cache``, ``vocab_size``, ``eos_token_ids``, ``kv_cache_manager``, ``_hasher``,
    ``async_scheduling``, ``scheduler``, ``runner``.

    ``engine`` is passed, not returned into, because the proposer factory reads the parts built
    before it. Raises ``ValueError`` / ``BackendUnavailable`` naming a bad option; tensor-parallel
    workers started before a failure are stopped when ``engine`` is collected."""
    # the one resolution of kv_connector (+ kv_connector_config): an acting connector or None; checked
    # before the model loads. Host memory is taken only once the KV cache exists.
    engine.connector = connector = make_connector(args.kv_connector, args.kv_connector_config)
    # ValueError (unknown name) / BackendUnavailable (why); an instance is used as given
    backend = engine.backend = get_backend(args.backend) if isinstance(args.backend, str) else args.backend
    backend.device.seed(args.seed)
    # max_num_seqs / token budget from the device and entry point where left None (engine/defaults.py),
    # before tensor-parallel workers start: they size their pools with the same numbers
    args = args.with_device_defaults(backend.device)
    engine._tp = tp = None  # tensor parallelism: ranks 1..N-1 (docs/parallelism.md); rank 0 is this process
    if args.tensor_parallel_size > 1:
        import weakref

        check_supported(args, backend, connector)
        engine._tp = tp = TPExecutor(args, backend)  # each worker builds its own connector from the options
        weakref.finalize(engine, tp.close)  # collected, failed __init__ or interpreter exit: no worker left

    has_tok = has_tokenizer(args.model)
    engine.model, engine.model_config, engine.tokenizer, engine.generation_config = load_model(
        args.model, backend, dtype=args.dtype, max_model_len=args.max_model_len, load_tokenizer=has_tok,
        tp=tp.shard if tp else None,
    )
    model = engine.model

    model.kv_cache_dtype = kv_storage_dtype(args.kv_cache_dtype, model.dtype)  # the spec resolve sizes the pool by
    if connector is not None:  # its worker side serves rank 0's shard
        bind_connector(connector, backend, args.model, engine.model_config, 0, args.tensor_parallel_size)
    engine.proposer = proposer = None
    if args.speculative_config is not None:  # loaded first: a draft model's weights and KV size the pool too
        engine.proposer = proposer = make_proposer(args.speculative_config,
                                                   ProposerTarget(model, engine.model_config, backend))
    engine.config = cfg = args.resolve(backend, model, connector, proposer.kv_bytes_per_block if proposer else None,
                                       tp.agree if tp else None)
    cc, rt, spec = cfg.cache, cfg.runtime, cfg.speculative
    engine.block_size, engine.max_model_len = cc.block_size, cfg.model.max_model_len
    if cfg.kv_groups:  # hybrid models: a KV cache and a block pool per group (docs/hybrid-models.md)
        engine.kv_cache = kv_cache = GroupedKVCache.allocate(
            cfg.kv_groups, model.kv_cache_spec(cc.num_kv_blocks, cc.block_size), backend.device,
            backend.attention.kv_layout)
    else:
        engine.kv_cache = kv_cache = backend.device.allocate_kv_cache(
            model.kv_cache_spec(cc.num_kv_blocks, cc.block_size), backend.attention.kv_layout)
    set_kv_scales(kv_cache, model, args.kv_cache_scales)
    model.bind_kv_cache(kv_cache)
    if proposer is not None:
        proposer.allocate(cc.num_kv_blocks, cc.block_size, engine.max_model_len)
    engine.vocab_size = engine.model_config.vocab_size
    engine.eos_token_ids = frozenset(eos_ids(engine.model_config, engine.generation_config))
    engine.kv_cache_manager = (
        GroupedKVCacheManager(cfg.kv_groups, cc.block_size, cc.enable_prefix_caching,
                              cfg.scheduler.max_num_batched_tokens + (spec.num_lookahead_tokens if spec else 0))
        if cfg.kv_groups
        else KVCacheManager(cc.num_kv_blocks, cc.block_size, cc.enable_prefix_caching))
    engine._hasher = make_block_hasher(cc.block_size)
    engine.async_scheduling = rt.async_scheduling
    engine.scheduler = Scheduler(cfg.scheduler, engine.kv_cache_manager, connector,
                                 spec.num_lookahead_tokens if spec is not None else 0)
    runner_args = (model, backend, kv_cache, cc.block_size, cfg.scheduler.max_num_seqs, engine.max_model_len,
                   tuple(engine.eos_token_ids), connector)
    if tp:
        engine.runner = DriverRunner(*runner_args, executor=tp, fuse=rt.fuse_elementwise)
    elif spec is None:
        engine.runner = ModelRunner(*runner_args)
    else:
        engine.runner = spec_runner()(*runner_args, spec_config=spec, proposer=proposer)
    if rt.fuse_elementwise:
        fuse_elementwise(model, kernels=backend.elementwise_ops())
    _set_decode_ops(backend, model, proposer, kv_cache, rt.decode_ops)
    if tp:  # every rank runs the driver's forward (its collectives pair up with the others')
        tp.send(DecodeOps(model.decode_ops is not None))
    if rt.graphs:
        engine.runner.enable_graphs(rt.graph_max_batch)


def _set_decode_ops(backend: Any, model: Any, proposer: Any, kv_cache: Any, wanted: bool | None) -> None:
    """Give the model (and a draft model) the backend's fused decode ops. ``wanted``: ``True`` requires
    them (ValueError saying why not), ``None`` uses them where offered and able, ``False`` never."""
    ops = backend.decode_ops() if wanted is not False else None
    if wanted and ops is None:
        raise ValueError(f"decode_ops=True but backend {backend.name!r} offers none (allowed: False or None)")
    if proposer is not None and proposer.needs_plain_forward:  # EAGLE-3 hooks inside the target's layers
        ops = None
    try:
        model.set_decode_ops(ops, kv_cache.spec.dtype)
    except ValueError:  # the ops cannot serve this model: True says why, None runs without them
        if wanted:
            raise
    if ops is not None and proposer is not None:
        proposer.set_decode_ops(ops)  # a draft model's few-token forwards (where the ops serve it)


def eos_ids(mc: Any, gen_cfg: Any) -> list[int]:
    """End-of-sequence token ids: the model config's, then generation_config's not already among them."""
    ids = list(getattr(mc, "eos_token_ids", None) or [])
    g = getattr(gen_cfg, "eos_token_ids", None) if not isinstance(gen_cfg, dict) else gen_cfg.get("eos_token_id")
    if isinstance(g, int):
        g = [g]
    return ids + [i for i in (g or []) if i not in ids]


def set_kv_scales(kv_cache: Any, model: Any, given: Any) -> None:
    """An fp8 KV cache's scales: ``given`` (``kv_cache_scales``), else the checkpoint's, else the 1.0
    it was allocated with; a model-dtype cache has none. Scales are per the checkpoint's KV heads: a
    tensor-parallel rank (``model.tp``) keeps its own heads' (``hwkv.parallel.sharding.kv_head_start``)."""
    if kv_cache.scales is None:
        return
    if given is None:
        given = getattr(model, "checkpoint_kv_scales", None)
    if given is None:
        return
    spec, tp, full = kv_cache.spec, getattr(model, "tp", None), getattr(model, "full_config", None)
    sharded = tp is not None and full is not None
    heads = full.num_kv_heads if sharded else spec.num_kv_heads
    start = kv_head_start(heads, tp.rank, tp.size) if sharded else 0
    kv_cache.set_scales(shard_scales(given, spec.num_layers, heads, start, spec.num_kv_heads))

