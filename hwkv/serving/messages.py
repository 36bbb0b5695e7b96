"""Messages between the front end and the engine-core process: msgspec structs over msgpack.

Front end → core (input socket): ``AddRequest``, ``Abort``, ``Utility``, ``Shutdown``.
Core → front end (output socket): ``Ready`` (once, after the engine is built) or ``Failed`` (the
engine could not be built), then ``StepOutputs`` per step, ``UtilityResult`` per ``Utility``,
``Heartbeat`` when it has sent nothing for a second (``/health``'s deadline), and ``Dead`` if the
core hits an error it cannot survive. Tagged unions, so a message decodes to its
own type; no pickle anywhere (a socket peer must not be able to run code in the other process).
"""

from __future__ import annotations

from typing import Any

import msgspec

from hwkv.sampling_params import SamplingParams


class AddRequest(msgspec.Struct, tag=True):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # stop strings stripped: the front end matches them
    priority: int = 0


class Abort(msgspec.Struct, tag=True):
    request_ids: list[str]


class Utility(msgspec.Struct, tag=True):
    """Ask the core for something off the hot path; ``name`` is ``"stats"`` (the engine stats)."""

    call_id: int
    name: str


class Shutdown(msgspec.Struct, tag=True):
    pass


class CoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's new tokens of one step. ``finish_reason``: ``"stop"``/``"length"``/``"abort"``,
    ``"error"`` when executing it failed, ``"rejected"`` when the core refused to add it (for both,
    ``error`` says why); ``None`` while running."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None  # the stop token id that ended it (EOS / stop_token_ids)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    logprobs: list[dict[int, float]] | None = None  # one per new token, when asked for
    error: str | None = None
    kv_transfer_params: dict[str, Any] | None = None  # the KV connector's, on the final output
    # SamplingParams.prompt_logprobs, with the request's first output token: {token: (logprob, rank)}
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None


class StepOutputs(msgspec.Struct, tag=True):
    outputs: list[CoreOutput]
    stats: dict[str, Any] | None = None  # an engine stats snapshot, at most every STATS_INTERVAL_S


class Ready(msgspec.Struct, tag=True):
    model: str
    backend: str
    device: str
    vocab_size: int
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    eos_token_ids: list[int]
    default_params: SamplingParams
    kv_connector: str | None
    scheduling_policy: str
    pid: int


class Heartbeat(msgspec.Struct, tag=True):
    """The core is alive and looping: sent when it has sent nothing else for ``HEARTBEAT_S``."""


class Failed(msgspec.Struct, tag=True):
    error: str


class Dead(msgspec.Struct, tag=True):
    error: str


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    result: Any = None
    error: str | None = None


ToCore = AddRequest | Abort | Utility | Shutdown
FromCore = StepOutputs | Ready | Failed | Dead | UtilityResult | Heartbeat


class CoreConfig(msgspec.Struct):
    """How the front end asks for an engine: Engine keyword arguments (JSON values only) and a
    KV connector by name; sent to the core process on its command line as JSON."""

    model: str
    engine_kwargs: dict[str, Any]
    input_addr: str
    output_addr: str
    parent_pid: int
    kv_connector: str | None = None
    kv_connector_config: dict[str, Any] = {}


encode = msgspec.msgpack.Encoder().encode
to_core = msgspec.msgpack.Decoder(ToCore)
from_core = msgspec.msgpack.Decoder(FromCore)
