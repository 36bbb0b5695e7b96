"""Engine configuration: the options users pass, grouped, and what the engine runs with.

Every option of :class:`hwkv.Engine` is a keyword-only field of one group (vLLM's config layout):
:class:`ModelOptions`, :class:`RuntimeOptions`, :class:`CacheOptions`, the scheduler's
:class:`~hwkv.core.sched_config.SchedulerOptions`, :class:`ParallelOptions`,
:class:`KVTransferOptions`, :class:`KVEventsOptions`, :class:`SpeculativeOptions`. A group declares its fields (``None``
meaning "choose for me") and checks their types and ranges (``check``, each error naming the
field and what is allowed). :class:`EngineArgs` is all the groups together, so ``Engine(model,
**options)``, ``hwkv serve``'s flags and the tensor-parallel workers see a new option without
being touched: adding one means its group here and its consumer.

:meth:`EngineArgs.resolve` turns them, once the backend is chosen and the model loaded, into
:class:`EngineConfig`: the same groups with every default computed in this one step
(block size, KV pool size, ``max_model_len``, token budget, graphs, async scheduling, fused ops)
and every cross-field rule checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hwkv.core.sched_config import SchedulerConfig, SchedulerOptions
from hwkv.engine.defaults import MAX_GRAPH_BATCH, USAGE_CONTEXTS, scheduler_defaults
from hwkv.engine.kv_alloc import check_backend, pool_blocks
from hwkv.engine.kv_groups import grouping_blockers, plan_groups, window_reserve
from hwkv.engine.spec_config import SpeculativeConfig
from hwkv.interfaces.kv_quant import KV_CACHE_DTYPES


def _need(obj: Any, name: str, ok: bool, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name} must be {allowed}, got {getattr(obj, name)!r}")


def _optional_count(obj: Any, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        _need(obj, name, v is None or (_is_int(v) and v >= 1), "None or an int >= 1")


def _optional_bool(obj: Any, *names: str) -> None:
    for name in names:
        _need(obj, name, getattr(obj, name) is None or isinstance(getattr(obj, name), bool), "None or a bool")


@dataclass(kw_only=True)
class ModelOptions:
    model: str  # the Hugging Face model directory
    dtype: Any = None  # None/"auto": the checkpoint's dtype (float32 when it names none)
    max_model_len: int | None = None  # prompt + output tokens per request; None: the model's, capped by the KV pool
    seed: int = 0  # global seed (per-request seeds: SamplingParams.seed)

    def check(self) -> None:
        _optional_count(self, "max_model_len")
        _need(self, "seed", _is_int(self.seed), "an int")


@dataclass(kw_only=True)
class RuntimeOptions:
    backend: Any = "cpu"  # a registered backend name, or a Backend instance (emulators, tests)
    enforce_eager: bool = False  # True: never capture graphs (every step runs eagerly)
    fuse_elementwise: bool | None = None  # torch.compile RMSNorm/RoPE/SiLU·mul; None: when graphs are on
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None: when graphs are on
    decode_ops: bool | None = None  # the backend's fused DecodeOps for forwards of few tokens; None: if offered
    # the entry point the defaults are chosen for (hwkv.engine.defaults): "offline" (None: Engine, generate)
    # or "server" (the serving core sets it)
    usage_context: str | None = None

    def check(self) -> None:
        _need(self, "usage_context", self.usage_context is None or self.usage_context in USAGE_CONTEXTS,
              f"None or one of {list(USAGE_CONTEXTS)}")
        _need(self, "backend", (isinstance(self.backend, str) and bool(self.backend))
              or hasattr(self.backend, "attention"), "a backend name or a Backend instance")
        _need(self, "enforce_eager", isinstance(self.enforce_eager, bool), "a bool")
        _optional_bool(self, "fuse_elementwise", "async_scheduling", "decode_ops")


@dataclass(kw_only=True)
class CacheOptions:
    block_size: int | None = None  # tokens per KV block; None: the backend's default
    num_kv_blocks: int | None = None  # KV pool size; None: memory_fraction of free device memory
    memory_fraction: float = 0.9  # share of device memory the engine may fill (weights included)
    enable_prefix_caching: bool = True  # reuse KV of identical prompt prefixes (hash-chained blocks)
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (docs/fp8-kv-cache.md)
    kv_cache_scales: Any = None  # fp8 KV dequantisation scales (hwkv.interfaces.kv_quant.parse_scales); None: 1.0
    # sliding-window layers in their own KV-cache groups, freeing blocks that left the window
    # (docs/hybrid-models.md); True: required (ValueError saying what prevents it), None: where possible
    kv_cache_groups: bool | None = None

    def check(self) -> None:
        _optional_count(self, "block_size", "num_kv_blocks")
        _need(self, "memory_fraction", isinstance(self.memory_fraction, (int, float))
              and 0 < self.memory_fraction <= 1, "in (0, 1]")
        _need(self, "enable_prefix_caching", isinstance(self.enable_prefix_caching, bool), "a bool")
        _optional_bool(self, "kv_cache_groups")
        _need(self, "kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, f"one of {sorted(KV_CACHE_DTYPES)}")
        if self.kv_cache_scales is not None and KV_CACHE_DTYPES[self.kv_cache_dtype] is None:
            raise ValueError(f"kv_cache_scales needs a quantised kv_cache_dtype (allowed: fp8, fp8_e4m3), "
                             f"got kv_cache_dtype {self.kv_cache_dtype!r}")


@dataclass(kw_only=True)
class ParallelOptions:
    """``tensor_parallel_size`` ranks, one process and device each (docs/parallelism.md)."""

    tensor_parallel_size: int = 1

    def check(self) -> None:
        _need(self, "tensor_parallel_size", _is_int(self.tensor_parallel_size) and self.tensor_parallel_size >= 1,
              "an int >= 1")


@dataclass(kw_only=True)
class KVTransferOptions:
    kv_connector: Any = None  # a registered connector name, "package.module:Class", or an instance; None: none
    kv_connector_config: dict[str, Any] | None = None  # a named connector's keyword arguments

    def check(self) -> None:  # checked where it is resolved: hwkv.connectors.make_connector (needs the registry)
        pass


@dataclass(kw_only=True)
class KVEventsOptions:
    """KV-cache events for cache-aware routers (vLLM's ``KVEventsConfig``; docs/kv-events.md)."""

    kv_events_endpoint: str | None = None  # ZMQ PUB address ("tcp://127.0.0.1:5557", port * = free); None: off
    kv_events_replay_endpoint: str | None = None  # ZMQ ROUTER address serving missed batches; None: no replay

    def check(self) -> None:
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            v = getattr(self, name)
            _need(self, name, v is None or (isinstance(v, str) and v.startswith(("tcp://", "ipc://", "inproc://"))),
                  "None or a ZMQ endpoint ('tcp://127.0.0.1:5557', 'tcp://127.0.0.1:*', 'ipc:///path')")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint (the events' PUB address), got None")


@dataclass(kw_only=True)
class SpeculativeOptions:
    speculative_config: Any = None  # dict (or JSON object text): hwkv.engine.spec_config.SpeculativeConfig; None: off

    def check(self) -> None:
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the key


GROUPS = (ModelOptions, RuntimeOptions, CacheOptions, SchedulerOptions, ParallelOptions, KVTransferOptions,
          KVEventsOptions, SpeculativeOptions)


# fields come in reverse base order: the model's first, the speculative group's last
@dataclass(kw_only=True)
class EngineArgs(SpeculativeOptions, KVEventsOptions, KVTransferOptions, ParallelOptions, SchedulerOptions,
                 CacheOptions, RuntimeOptions, ModelOptions):
    """The options of :class:`hwkv.Engine`, keyword-only: every group's fields (``hwkv serve`` makes a
    flag of each)."""

    def __post_init__(self) -> None:
        for group in GROUPS:
            group.check(self)
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError("speculative_config needs async_scheduling False or None (a step's drafts come "
                             "from its own sampled tokens, so steps cannot overlap)")

    def with_device_defaults(self, device: Any) -> EngineArgs:
        """A copy with ``max_num_seqs`` / ``max_num_batched_tokens`` chosen for ``device`` and
        ``usage_context`` where left ``None`` (:mod:`hwkv.engine.defaults`; chunking off: the budget is
        raised to ``max_model_len`` in :meth:`resolve`)."""
        import copy

        d = scheduler_defaults(device, self.usage_context)
        out = copy.copy(self)  # fields already checked (and speculative_config parsed): no __post_init__ again
        out.max_num_seqs = self.max_num_seqs or d.max_num_seqs
        if self.max_num_batched_tokens is None and self.enable_chunked_prefill:
            out.max_num_batched_tokens = d.max_num_batched_tokens
        return out

    def group(self, options: type, config: type | None = None, **chosen: Any) -> Any:
        """The group ``options`` as ``config`` (default: itself) with the values ``chosen`` in resolve."""
        return (config or options)(**{**{f.name: getattr(self, f.name) for f in fields(options)}, **chosen})

    def resolve(self, backend: Any, model: Any, kv_connector: Any = None,
                extra_kv_bytes_per_block: Any = None, agree: Any = None) -> EngineConfig:
        """Every default computed once, every cross-field rule checked (``ValueError`` naming the
        field). ``model`` is the loaded model (weights already on the device: the KV pool is sized
        from the memory left); ``kv_connector`` the connector, or ``None``;
        ``extra_kv_bytes_per_block(block_size)``: bytes per block of another cache indexed by the
        same block ids (a draft model's KV), counted when sizing the pool; ``agree(n)`` (tensor
        parallelism: the communicator's ``all_reduce_min``): the pool every rank can hold."""
        if self.max_num_seqs is None or (self.max_num_batched_tokens is None and self.enable_chunked_prefill):
            return self.with_device_defaults(backend.device).resolve(backend, model, kv_connector,
                                                                     extra_kv_bytes_per_block, agree)
        mc = model.config
        block_size = self.block_size or backend.capabilities.default_block_size
        check_backend(backend, model, block_size)
        model_max = mc.max_model_len
        if self.max_model_len is not None:
            mc.check_max_model_len(self.max_model_len)
            if self.max_model_len > model_max:
                raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's {model_max} "
                                 f"(allowed: 1..{model_max})")
        max_len = self.max_model_len or model_max
        per_block = model.kv_cache_spec(1, block_size).bytes_per_block
        extra = extra_kv_bytes_per_block(block_size) if extra_kv_bytes_per_block is not None else 0
        grouped = self._grouped(model, kv_connector)
        reserved = 0
        if grouped:  # the window groups' blocks are set aside; the full group shares the rest
            # the step budget resolved below is at most this one (max_len only shrinks): the reserve covers it
            step = self.max_num_batched_tokens or max(
                scheduler_defaults(backend.device, self.usage_context).max_num_batched_tokens, max_len)
            full, reserved = window_reserve(model, block_size, self.max_num_seqs, step,
                                            model.kv_cache_spec(1, block_size).bytes_per_block // mc.num_layers,
                                            self._lookahead())
            per_block = full or per_block
            reserved = reserved if full else 0
        per_block += extra  # a proposer's KV: indexed by the (full) group 0's block ids
        n = pool_blocks(self, backend, per_block, block_size, max_len, reserved)
        if agree is not None:
            n = agree(n)
        if self.max_model_len is None:
            max_len = min(max_len, n * block_size)
        elif n * block_size < max_len:
            raise ValueError(
                f"max_model_len {max_len} needs {-(-max_len // block_size)} KV blocks of {block_size} tokens but "
                f"the pool has {n} (raise num_kv_blocks / memory_fraction or lower max_model_len)"
            )
        budget = self.max_num_batched_tokens
        if budget is None:  # without chunking a whole prompt must fit one step (as vLLM)
            budget = max(scheduler_defaults(backend.device, self.usage_context).max_num_batched_tokens, max_len)

        # graphs for pure-decode steps where the backend declares capture; a connector costs them only
        # if it runs per-layer host work inside the forward (KVConnectorBase.capturable_layer_hooks)
        # (and a model whose forward can be captured: model.graph_capturable, default True)
        graphs = not self.enforce_eager and backend.capabilities.graph_capture and (
            kv_connector is None or not kv_connector.layerwise or kv_connector.capturable_layer_hooks) and (
            getattr(model, "graph_capturable", True))
        async_ = graphs if self.async_scheduling is None else self.async_scheduling
        if self.speculative_config is not None:  # drafts of step N+1 come from step N's tokens
            async_ = False
        fuse = graphs if self.fuse_elementwise is None else self.fuse_elementwise
        return EngineConfig(
            model=self.group(ModelOptions, model=str(self.model), max_model_len=max_len),
            cache=self.group(CacheOptions, block_size=block_size, num_kv_blocks=n),
            scheduler=self.group(SchedulerOptions, SchedulerConfig, max_num_batched_tokens=budget,
                                 max_model_len=max_len, async_scheduling=async_),
            parallel=self.group(ParallelOptions, ParallelConfig),
            runtime=self.group(RuntimeOptions, RuntimeConfig, fuse_elementwise=fuse, async_scheduling=async_,
                               graphs=graphs,
                               graph_max_batch=min(self.max_num_seqs, budget, MAX_GRAPH_BATCH) if graphs else 0),
            kv_transfer=self.group(KVTransferOptions) if kv_connector is not None else None,
            speculative=self.speculative_config,
            kv_groups=plan_groups(model, n, block_size, self.max_num_seqs, budget, self._lookahead()) if grouped
            else (),
        )

    def _lookahead(self) -> int:
        """Speculative slots the scheduler holds per request beyond a step's tokens (0: none)."""
        spec = self.speculative_config
        return spec.num_lookahead_tokens if spec is not None else 0

    def _grouped(self, model: Any, kv_connector: Any) -> bool:
        """Whether the engine runs KV-cache groups (``kv_cache_groups``; ValueError when True cannot be met)."""
        if self.kv_cache_groups is False:
            return False
        reasons = grouping_blockers(self, kv_connector, model)
        if reasons and self.kv_cache_groups:
            raise ValueError("kv_cache_groups=True cannot be met: " + "; ".join(reasons) + " (allowed: False or None)")
        return not reasons


@dataclass(kw_only=True)
class ParallelConfig(ParallelOptions):
    pipeline_parallel_size: int = 1  # reserved


@dataclass(kw_only=True)
class RuntimeConfig(RuntimeOptions):
    fuse_elementwise: bool = False
    async_scheduling: bool = False
    graphs: bool = False  # pure-decode steps replay captured graphs (Capabilities.graph_capture, not enforce_eager)
    graph_max_batch: int = 0  # largest batch bucket captured (0 without graphs)


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The resolved configuration an engine runs with (``Engine.config``): the option groups with
    every ``None`` chosen (``model.max_model_len``, ``cache.block_size`` / ``num_kv_blocks``, ...)."""

    model: ModelOptions
    cache: CacheOptions
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    kv_transfer: KVTransferOptions | None = None  # None: no connector acts; the object is engine.connector
    speculative: Any = None  # a hwkv.engine.spec_config.SpeculativeConfig, or None (no speculative decoding)
    kv_groups: tuple = ()  # hwkv.core.kv_groups.KVCacheGroup per group; (): one group of every layer


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
