"""V1-style KV connector interface: a scheduler side and a worker side (vLLM v1 KVConnectorBase_V1).

The scheduler and model runner call these hooks at fixed points, so a connector (CPU offload,
P/D disaggregation, global pool) plugs in without touching either:

scheduler side, inside ``Scheduler.schedule`` / ``update_from_output``::

    n_ext, load_async = get_num_new_matched_tokens(req, num_local_computed)   # before allocation
    update_state_after_alloc(req, block_ids, n_ext)                             # after allocation
    meta = build_connector_meta(sched_out)                                      # once per step
    update_connector_output(kv_connector_output)                                # after the step
    delay_free, params = request_finished(req, block_ids)                       # on finish
    request_preempted(req)                              # before a preempted request's blocks are freed

worker side, inside ``ModelRunner.execute``::

    bind_device(device); register_kv_caches(kv_cache)   # once, after allocation
    bind_connector_metadata(meta); start_load_kv()
    wait_for_layer_load(i) / save_kv_layer(i, ...)    # per layer (layerwise connectors)
    wait_for_save(); get_finished(finished_req_ids) -> KVConnectorOutput

Contract: a load that fails must be reported in ``KVConnectorOutput.failed_recving`` (the
scheduler then recomputes) — never silently produce wrong KV. A load that failed part-way may say in
``KVConnectorOutput.valid_tokens`` how many of the request's first tokens did land (every block
before the first failed one); only the rest is recomputed. A *synchronous* load (offered with
``load_async=False``) must be reported as failed in the output of the very step that scheduled it:
the scheduler then discards that step's token for the request and recomputes it. ``delay_free=True``
hands the request's blocks to the connector until it reports the request in ``finished_sending``.

Fast path: a connector costs nothing where it declares nothing. ``layerwise`` (per-layer hooks are
called at all) and ``capturable_layer_hooks`` (those hooks only queue device work, so they may be
recorded into a CUDA graph) decide whether the engine keeps graphs; async scheduling and decode ops
stay on for every connector.

Tensor parallelism (as vLLM v1): at ``tensor_parallel_size > 1`` the scheduler side runs once, on
the driver, and the worker side runs in every rank's process against that rank's KV cache shard
(one instance per rank, built from the connector's name and config, told its rank by ``bind_tp``).
The per-step metadata travels to the ranks msgpack-encoded (never pickled) and is decoded there as
``metadata_type``; the driver merges the ranks' outputs: a request's send or load is finished once
every rank reported it, failed if any rank failed it (a synchronous load failed on any rank fails
in that step), ``extra`` job completions (``tp_job_keys``) complete once every rank reported them.
Only a connector that declares ``supports_tensor_parallel`` is accepted there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from hwkv.interfaces.layout import KVCache


class Request(Protocol):
    """What a connector may read of a request (``hwkv.core.request.Request`` is the one the
    scheduler hands it); ``kv_transfer_params`` it may also replace (what the response carries)."""

    request_id: str
    prompt_token_ids: list[int]
    num_prompt_tokens: int
    num_tokens: int  # prompt + output so far
    num_computed_tokens: int
    cache_salt: str | None
    kv_transfer_params: dict[str, Any] | None
    status: Any  # hwkv.core.request.RequestStatus
    block_hashes: list[bytes]  # the prefix-cache chain hash of each full block


class SchedulerOutput(Protocol):
    """What a connector may read of a step's schedule (``hwkv.core.sched_output.SchedulerOutput``)."""

    scheduled_new_reqs: Sequence[Any]  # NewRequestData: req_id, block_ids, num_computed_tokens, ...
    scheduled_cached_reqs: Any  # CachedRequestData: req_ids, new_block_ids, num_computed_tokens
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]
    preempted_req_ids: set[str]


@dataclass
class KVConnectorOutput:
    """Worker-side connector completions reported back to the scheduler."""

    finished_sending: set[str] = field(default_factory=set)  # delayed-free blocks may go now
    finished_recving: set[str] = field(default_factory=set)  # async loads done: may run now
    failed_recving: set[str] = field(default_factory=set)  # loads failed: recompute instead
    # a request of failed_recving -> its first tokens whose KV is valid in its blocks after the failed
    # load (the device hit and the loaded blocks before the first failed one, in every KV-cache
    # group; whole blocks). The scheduler keeps them in the prefix cache, so the request recomputes
    # only the rest. Absent: nothing beyond its device hit.
    valid_tokens: dict[str, int] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)  # connector-specific (e.g. store events)


class KVConnectorBase:
    """Default behaviour of every hook: do nothing (so this class is also the no-op connector)."""

    name = "base"
    # The model calls wait_for_layer_load / save_kv_layer per layer only for a layerwise connector.
    # The engine reads it twice: before the KV cache exists (a layerwise connector without capturable
    # hooks turns graphs off) and after register_kv_caches (whether the model calls the hooks), so a
    # connector may turn it off there, not on.
    layerwise: bool = False
    # A layerwise connector whose per-layer hooks only enqueue device work (no host sync, no host
    # state that changes per step) may be captured into graphs; otherwise pure-decode steps run eagerly.
    capturable_layer_hooks: bool = False
    # Per-layer hooks that only wait for loads (capturable): True lets the engine capture its graphs
    # without them (a captured wait costs ~6 us of every replay on an H100) and call
    # wait_for_all_layer_loads() before each replay; for the steps where loads_layer_by_layer() is
    # True it replays short-query graphs captured with them (a prompt's tail is what a load feeds).
    layer_hooks_only_when_loading: bool = False
    # tensor parallelism (see the module doc): may run one worker side per rank
    supports_tensor_parallel: bool = False
    # KV-cache groups (docs/hybrid-models.md): the connector moves every group's blocks - its scheduler
    # side gets a manager with ``managers`` (one per group), its worker side a KV cache with ``caches``;
    # False: a hybrid model runs with one group (every layer keeps the whole context)
    supports_kv_groups: bool = False
    metadata_type: Any = Any  # what the ranks decode build_connector_meta's result as (msgspec types)
    tp_job_keys: tuple[str, ...] = ()  # extra keys listing job completions ``(job id, ok, *numbers)``
    # finished_sending comes from rank 0 alone (its scheduler side knows when every rank's blocks were
    # read, e.g. through a side channel on the driver); False: once every rank reported it
    tp_sending_from_driver: bool = False
    tp_worker_info_type: Any = Any  # what the driver decodes each rank's tp_worker_info() as
    tp_rank: int = 0
    tp_size: int = 1

    # ---- scheduler side -------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` whose KV this connector can supply, and whether
        they arrive asynchronously (then the request waits in WAITING_FOR_REMOTE_KVS until the
        worker reports it in ``finished_recving``). Must leave at least the last prompt token to
        compute."""
        return 0, False

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """Blocks are allocated for ``request`` (all of its blocks, in order)."""

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        """Per-step metadata for the worker side; attached to the SchedulerOutput."""
        return None

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """Worker-side completions of the last step (store/load events, finished transfers)."""

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``(delay_free, kv_transfer_params)``: with ``delay_free`` the scheduler frees the
        blocks only once the request is reported in ``finished_sending``. A request finished
        (e.g. aborted) while its load is in flight must return ``delay_free=True`` and be reported
        in ``finished_sending`` when the load stops writing, or its blocks could be reused under it."""
        return False, None

    def request_preempted(self, request: Request) -> None:
        """``request`` is preempted (or its failed step rolled back): called just before the
        scheduler frees its blocks, which ``kv_cache_manager.get_blocks(request.request_id)`` still
        returns. ``request.num_computed_tokens`` counts exactly the tokens whose KV steps already
        launched write (tokens scheduled in this step or in a failed one are taken back first). The
        freed blocks may be handed to another request in this very step: a connector that still
        needs their bytes either reads them before this step's forward and loads can write them
        (``offload`` copies them out at the start of ``start_load_kv`` and makes the compute stream
        wait for that copy) or pins them with ``block_pool.touch`` (then the preemption frees fewer
        blocks). The request comes back through ``get_num_new_matched_tokens`` when re-admitted."""

    def bind_model(self, model: str, model_config: Any) -> None:
        """Called once, when the model is loaded: its path or name and its config (a connector that
        shares KV beyond this engine keys it by model identity)."""

    def bind_backend(self, backend: Any) -> None:
        """Called once, right after ``bind_model``: the engine's Backend (e.g. the transfer protocols
        its capabilities declare)."""

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        """Scheduler side, once: the device block pool's manager (to pin blocks while they transfer:
        ``kv_cache_manager.block_pool.touch`` / ``free_blocks``)."""

    def bind_tp(self, rank: int, size: int) -> None:
        """Called once, before ``bind_model``, on every rank's instance of an engine with
        ``tensor_parallel_size = size > 1``: this instance's worker side serves rank ``rank``'s KV
        shard (rank 0 also holds the scheduler side)."""
        self.tp_rank, self.tp_size = rank, size

    def check_tensor_parallel(self, size: int) -> None:
        """Before any worker starts, for ``tensor_parallel_size = size > 1`` (only where
        ``supports_tensor_parallel``): ``ValueError`` naming a configuration that cannot run there."""

    def tp_worker_info(self) -> Any:
        """Worker side at tp > 1, once, after ``register_kv_caches``: what the driver's scheduler
        side needs to know of this rank (e.g. its transfer endpoint and KV addresses), msgspec-encodable."""
        return None

    def bind_tp_worker_info(self, infos: list[Any]) -> None:
        """Driver side at tp > 1, once before the first step: every rank's ``tp_worker_info()``, in rank
        order (rank 0's, this instance's own, first)."""

    def merge_tp_job(self, key: str, a: list[Any], b: list[Any]) -> list[Any]:
        """Driver side at tp > 1: one job's details (after ``job id, ok``) from two ranks of
        ``extra[key]`` combined. Default: summed (e.g. bytes moved by all shards)."""
        return [x + y for x, y in zip(a, b)]

    def merge_tp_extra(self, key: str, values: list[Any]) -> Any:
        """Driver side at tp > 1: ``extra[key]`` (not a job key) from every rank's latest report
        (rank order; ``None`` for a rank that never reported it). Default: the first reported."""
        return next(v for v in values if v is not None)

    def has_pending_transfers(self) -> bool:
        """Transfers in flight that hold device blocks (the scheduler then waits instead of declaring
        a request unservable)."""
        return False

    def stats(self) -> dict[str, Any]:
        """Connector counters for ``engine.stats()["kv_connector"]``: ``loaded_bytes`` and
        ``stored_bytes`` plus any connector-specific ones (the engine adds name, external_hit_tokens,
        load_failures and load_kept_tokens)."""
        return {}

    # KV events (docs/kv-events.md): a connector with cache tiers of its own (host offload, pool)
    # reports what they gain and lose; the engine publishes them with the device cache's events.
    def enable_kv_events(self) -> None:
        """Start recording KV events (called once, before the first step, when events are on)."""

    def take_kv_events(self) -> list[Any]:
        """The ``hwkv.core.kv_events`` events recorded since the last call, in the order they happened
        (``medium`` names the tier); called once per engine step on the scheduler's thread."""
        return []

    def kv_event_snapshot(self) -> list[Any]:
        """``BlockStored`` of every block the connector's tiers hold now (a subscriber's resync)."""
        return []

    # ---- worker side ----------------------------------------------------------------------
    def bind_device(self, device: Any) -> None:
        """Called once before ``register_kv_caches``: the backend's Device (streams, events, copies)."""

    def register_kv_caches(self, kv_cache: KVCache) -> None:
        """Called once with the allocated KV cache (register for transfer, pin, ...)."""

    def bind_connector_metadata(self, metadata: Any) -> None: ...

    def start_load_kv(self) -> None:
        """Before the forward pass: start loading KV named in the bound metadata."""

    def wait_for_layer_load(self, layer: int) -> None: ...

    def wait_for_all_layer_loads(self) -> None:
        """Before a forward captured without the per-layer hooks (``layer_hooks_only_when_loading``):
        make it wait for every layer's loads of this step, as the per-layer waits together would."""

    def loads_layer_by_layer(self) -> bool:
        """After ``start_load_kv``: this step's forward should wait layer by layer (the engine then
        replays graphs captured with the per-layer hooks, where it has them)."""
        return False

    def save_kv_layer(self, layer: int, layer_kv: Any, attn_metadata: Any) -> None: ...

    def wait_for_save(self) -> None:
        """After the forward pass: the KV saves of this step are submitted/complete."""

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput | None:
        """Completions since the last call; ``None`` when there is nothing to report."""
        return None

    def shutdown(self) -> None: ...


class NoOpConnector(KVConnectorBase):
    """``kv_connector="noop"``: resolves to no connector (``None``, the one value of "none": nothing
    is called)."""

    name = "noop"
