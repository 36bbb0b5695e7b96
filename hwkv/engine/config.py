"""Engine configuration: what users pass, and what the engine runs with.

:class:`EngineArgs` holds the keyword arguments of :class:`hwkv.Engine` flat, as given (``None``
meaning "choose for me"), and checks each one's type and range. :meth:`EngineArgs.resolve` turns
them, once the backend is chosen and the model loaded, into :class:`EngineConfig`: grouped, frozen
configs with every default computed in this one step (block size, KV pool size, ``max_model_len``,
token budget, graphs, async scheduling, fused ops) and every cross-field rule checked, each error
naming the field and what is allowed. Groups (vLLM's config layout): ``model``, ``cache``,
``scheduler``, ``parallel``, ``runtime``, ``kv_transfer``, ``speculative``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hwkv.core.sched_config import SchedulerConfig
from hwkv.core.sched_policy import POLICIES

DEFAULT_TOKEN_BUDGET = 2048  # max_num_batched_tokens with chunked prefill (as vLLM)


@dataclass
class EngineArgs:
    """The options of :class:`hwkv.Engine` (one field per keyword; ``hwkv serve`` makes a flag of each)."""

    model: str
    backend: Any = "cpu"  # a registered backend name, or a Backend instance (emulators, tests)
    dtype: Any = None  # None/"auto": the checkpoint's dtype (float32 when it names none)
    max_model_len: int | None = None  # None: the model's, capped by the KV pool
    block_size: int | None = None  # tokens per KV block; None: the backend's default
    num_kv_blocks: int | None = None  # KV pool size; None: memory_fraction of free device memory
    memory_fraction: float = 0.9  # share of device memory the engine may fill (weights included)
    max_num_seqs: int = 256  # requests running at once
    max_num_batched_tokens: int | None = None  # tokens per step; None: 2048, or max_model_len without chunking
    enable_prefix_caching: bool = True  # reuse KV of identical prompt prefixes (hash-chained blocks)
    enable_chunked_prefill: bool = True  # split long prompts over steps, mixed with decodes
    long_prefill_token_threshold: int = 0  # >0: cap on one request's prefill chunk per step
    max_num_partial_prefills: int = 1  # requests allowed to be mid-prefill at once
    seed: int = 0  # global seed (per-request seeds: SamplingParams.seed)
    enforce_eager: bool = False  # True: never capture graphs (every step runs eagerly)
    fuse_elementwise: bool | None = None  # torch.compile RMSNorm/RoPE/SiLU·mul; None: when graphs are on
    async_scheduling: bool | None = None  # plan step N+1 while step N runs; None: when graphs are on
    decode_ops: bool | None = None  # the backend's fused DecodeOps for forwards of few tokens; None: if offered
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (lower SamplingParams.priority first, preempting)
    reserve_full_prompt: bool = True  # admit only when the whole prompt fits in free blocks (not just a chunk)
    speculative_config: Any = None  # dict (or JSON object text): hwkv.spec_decode.SpeculativeConfig; None: off
    tensor_parallel_size: int = 1  # ranks (one process and device each) the model is sharded over
    kv_cache_dtype: str = "auto"  # "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (docs/fp8-kv-cache.md)
    kv_cache_scales: Any = None  # fp8 KV dequantisation scales (hwkv.interfaces.kv_quant.parse_scales); None: 1.0

    def __post_init__(self) -> None:
        def need(name: str, ok: bool, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        need("backend", (isinstance(self.backend, str) and bool(self.backend)) or hasattr(self.backend, "attention"),
             "a backend name or a Backend instance")
        for name in ("max_num_seqs", "max_num_partial_prefills", "tensor_parallel_size"):
            need(name, _is_int(getattr(self, name)) and getattr(self, name) >= 1, "an int >= 1")
        for name in ("max_model_len", "block_size", "num_kv_blocks", "max_num_batched_tokens"):
            v = getattr(self, name)
            need(name, v is None or (_is_int(v) and v >= 1), "None or an int >= 1")
        need("memory_fraction", isinstance(self.memory_fraction, (int, float)) and 0 < self.memory_fraction <= 1,
             "in (0, 1]")
        need("long_prefill_token_threshold",
             _is_int(self.long_prefill_token_threshold) and self.long_prefill_token_threshold >= 0, "an int >= 0")
        need("seed", _is_int(self.seed), "an int")
        need("scheduling_policy", self.scheduling_policy in POLICIES, f"one of {sorted(POLICIES)}")
        for name in ("enforce_eager", "enable_prefix_caching", "enable_chunked_prefill", "reserve_full_prompt"):
            need(name, isinstance(getattr(self, name), bool), "a bool")
        for name in ("fuse_elementwise", "async_scheduling", "decode_ops"):
            need(name, getattr(self, name) is None or isinstance(getattr(self, name), bool), "None or a bool")
        from hwkv.interfaces.kv_quant import KV_CACHE_DTYPES

        need("kv_cache_dtype", self.kv_cache_dtype in KV_CACHE_DTYPES, f"one of {sorted(KV_CACHE_DTYPES)}")
        if self.kv_cache_scales is not None and KV_CACHE_DTYPES[self.kv_cache_dtype] is None:
            raise ValueError(f"kv_cache_scales needs a quantised kv_cache_dtype (allowed: fp8, fp8_e4m3), "
                             f"got kv_cache_dtype {self.kv_cache_dtype!r}")
        if KV_CACHE_DTYPES[self.kv_cache_dtype] is not None and self.tensor_parallel_size > 1:
            raise ValueError(f"kv_cache_dtype {self.kv_cache_dtype!r} is not implemented with tensor_parallel_size "
                             f"{self.tensor_parallel_size} (the worker ranks allocate model-dtype KV; allowed: 1)")
        from hwkv.spec_decode.config import SpeculativeConfig

        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)  # ValueError naming the key
        if self.speculative_config is not None and self.async_scheduling:
            raise ValueError("speculative_config needs async_scheduling False or None (a step's drafts come "
                             "from its own sampled tokens, so steps cannot overlap)")

    def resolve(self, backend: Any, model: Any, kv_connector: Any = None,
                extra_kv_bytes_per_block: Any = None, agree: Any = None) -> EngineConfig:
        """Every default computed once, every cross-field rule checked (``ValueError`` naming the
        field). ``model`` is the loaded model (weights already on the device: the KV pool is sized
        from the memory left); ``kv_connector`` the connector, or ``None``;
        ``extra_kv_bytes_per_block(block_size)``: bytes per block of another cache indexed by the
        same block ids (a draft model's KV), counted when sizing the pool; ``agree(n)`` (tensor
        parallelism: the communicator's ``all_reduce_min``): the pool every rank can hold."""
        from hwkv.engine.kv_alloc import check_backend, pool_blocks
        from hwkv.interfaces.connector import NoOpConnector

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
        if extra_kv_bytes_per_block is not None:
            per_block += extra_kv_bytes_per_block(block_size)
        n = pool_blocks(self, backend, per_block, block_size, max_len)
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
            budget = DEFAULT_TOKEN_BUDGET if self.enable_chunked_prefill else max(DEFAULT_TOKEN_BUDGET, max_len)

        if type(kv_connector) is NoOpConnector:  # acts on nothing: the fast paths stay on
            kv_connector = None
        if kv_connector is not None and self.tensor_parallel_size > 1 and not kv_connector.supports_tensor_parallel:
            raise ValueError(f"kv_connector {kv_connector.name!r} does not run tensor-parallel (its worker side "
                             "would see one rank's KV shard only; allowed at tensor_parallel_size > 1: offload, pool, "
                             "or a connector declaring supports_tensor_parallel = True)")
        # graphs for pure-decode steps where the backend declares capture; a connector costs them only
        # if it runs per-layer host work inside the forward (KVConnectorBase.capturable_layer_hooks)
        graphs = not self.enforce_eager and backend.capabilities.graph_capture and (
            kv_connector is None or not kv_connector.layerwise or kv_connector.capturable_layer_hooks)
        async_ = graphs if self.async_scheduling is None else self.async_scheduling
        if self.speculative_config is not None:  # drafts of step N+1 come from step N's tokens
            async_ = False
        fuse = graphs if self.fuse_elementwise is None else self.fuse_elementwise
        sched = SchedulerConfig(self.max_num_seqs, budget, max_len, self.enable_chunked_prefill,
                                self.long_prefill_token_threshold, self.max_num_partial_prefills, async_,
                                self.scheduling_policy, self.reserve_full_prompt)
        return EngineConfig(
            model=ModelOptions(str(self.model), self.dtype, max_len, self.seed),
            cache=CacheConfig(block_size, n, self.memory_fraction, self.enable_prefix_caching, self.kv_cache_dtype),
            scheduler=sched,
            parallel=ParallelConfig(self.tensor_parallel_size),
            runtime=RuntimeConfig(graphs, min(self.max_num_seqs, budget) if graphs else 0, fuse, async_,
                                  self.decode_ops),
            kv_transfer=KVTransferConfig(kv_connector) if kv_connector is not None else None,
            speculative=self.speculative_config,
        )


@dataclass(frozen=True)
class ModelOptions:
    path: str  # the Hugging Face model directory
    dtype: Any  # as requested (None/"auto": the checkpoint's); the loaded model's is model.dtype
    max_model_len: int  # prompt + output tokens one request may hold
    seed: int


@dataclass(frozen=True)
class CacheConfig:
    block_size: int  # tokens per KV block
    num_blocks: int  # KV pool size
    memory_fraction: float
    enable_prefix_caching: bool
    kv_cache_dtype: str = "auto"  # as given: "auto", "fp8", "fp8_e4m3" (the storage dtype: kv_cache.spec.dtype)


@dataclass(frozen=True)
class ParallelConfig:
    """``tensor_parallel_size`` ranks, one process and device each (docs/parallelism.md);
    pipeline parallelism is reserved."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1


@dataclass(frozen=True)
class RuntimeConfig:
    graphs: bool  # pure-decode steps replay captured graphs (Capabilities.graph_capture, not enforce_eager)
    graph_max_batch: int  # largest batch bucket captured (0 without graphs)
    fuse_elementwise: bool
    async_scheduling: bool
    decode_ops: bool | None  # None: the backend's fused decode ops where offered and usable


@dataclass(frozen=True)
class KVTransferConfig:
    connector: Any  # a KVConnectorBase that acts (a no-op connector resolves to no kv_transfer)


@dataclass(frozen=True)
class EngineConfig:
    """The resolved configuration an engine runs with (``Engine.config``)."""

    model: ModelOptions
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    runtime: RuntimeConfig = field(default_factory=lambda: RuntimeConfig(False, 0, False, False, None))
    kv_transfer: KVTransferConfig | None = None
    speculative: Any = None  # a hwkv.spec_decode.SpeculativeConfig, or None (no speculative decoding)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
