"""What the scheduler hands the model runner each step, and what comes back.

The runner keeps persistent per-request state (token ids, block table row), so a request's
prompt and full block list travel only once (``NewRequestData``, also after a preemption, since
the runner drops a preempted request's state); afterwards only appended block ids do
(``CachedRequestData``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hwkv.interfaces.connector import KVConnectorOutput


@dataclass
class NewRequestData:
    """A request scheduled for the first time (or again after preemption)."""

    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # non-empty when resumed after preemption (recompute)
    block_ids: list[int]
    num_computed_tokens: int  # before this step: prefix-cache / connector hit
    sampling_params: Any


@dataclass
class CachedRequestData:
    """Requests that were already running, as parallel lists (cheap for hundreds of decodes)."""

    req_ids: list[str] = field(default_factory=list)
    new_block_ids: list[list[int] | None] = field(default_factory=list)  # None: no new block
    num_computed_tokens: list[int] = field(default_factory=list)  # before this step


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]  # in batch order: cached (running) first, then new
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished since the previous step: the runner drops their state
    preempted_req_ids: set[str]  # preempted in this step: the runner drops their state
    kv_connector_metadata: Any = None
    # speculative decoding: the draft tokens scheduled for verification (counted in
    # num_scheduled_tokens, after the request's last known token); requests without drafts absent
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # KV-cache groups (hwkv.core.kv_groups): per request with new blocks this step, the block ids of
    # groups 1.. (group 0's are block_ids / new_block_ids above): a new request's whole tables, a
    # running one's appended ids (as many as group 0's)
    group_block_ids: dict[str, list[list[int]]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass
class ModelRunnerOutput:
    """Sampled tokens per request; empty list for a partial prefill chunk (nothing sampled). With
    speculative decoding a request's list holds its accepted drafts and then one more token."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Any] | None = None  # req_id -> per-token logprob records
    # req_id -> (first prompt index, records): prompt_logprobs of this step's prompt tokens
    prompt_logprobs: dict[str, tuple[int, list[Any]]] | None = None
    kv_connector_output: KVConnectorOutput | None = None
    # speculative decoding: each sampling request's drafts for its next step (None: not speculating)
    spec_token_ids: dict[str, list[int]] | None = None

