"""Request: one generation request's state as the scheduler and cache manager see it."""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KVS = enum.auto()  # a KV connector is loading this request's prefix
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after PREEMPTED is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # its execution failed (RequestOutput.error says how)

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return {
            RequestStatus.FINISHED_STOPPED: "stop",
            RequestStatus.FINISHED_LENGTH_CAPPED: "length",
            RequestStatus.FINISHED_ABORTED: "abort",
            RequestStatus.FINISHED_ERROR: "error",
        }.get(self)


BlockHasher = Callable[["Request"], list[bytes]]


@dataclass(eq=False)
class Request:
    """Token state of one request.

    ``block_hashes`` holds the chained hash of every *full* block of ``all_token_ids``; it is
    extended by ``block_hasher`` whenever tokens are appended (decode-filled blocks included).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: Any = None
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    lora_id: int | None = None
    mm_hashes: list[str] = field(default_factory=list)
    block_hasher: BlockHasher | None = None
    eos_token_ids: frozenset[int] = frozenset()
    max_tokens: int = 16
    priority: int = 0  # priority scheduling: lower runs first (ties by arrival_time)
    # KV connector parameters: in from the caller (e.g. where a remote prefill left the KV), replaced
    # on finish by what the connector returns from request_finished (e.g. where this KV can be fetched)
    kv_transfer_params: dict[str, Any] | None = None

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit on first schedule; -1 until then
    num_preemptions: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    spec_token_ids: list[int] = field(default_factory=list)
    # async scheduling: tokens of planned/launched steps not yet appended (<= 1 when planning)
    num_output_placeholders: int = 0
    stop_reason: int | str | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        self._update_hashes()

    def _update_hashes(self) -> None:
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._update_hashes()

    def append_output_token(self, token_id: int) -> None:
        """:meth:`append_output_token_ids` of one token (the per-step decode path)."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_spec(self) -> int:
        return len(self.all_token_ids) + len(self.spec_token_ids)

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt (or recomputing after preemption) tokens."""
        return self.num_computed_tokens < self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, prompt={self.num_prompt_tokens}, "
            f"out={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
