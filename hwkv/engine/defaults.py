"""Device- and entry-point-aware defaults of the scheduler limits (vLLM's ``_set_default_args``).

The token budget per step (``max_num_batched_tokens``) and the running-request cap
(``max_num_seqs``) are chosen from the device's memory and the entry point when left ``None``:

| device | entry point | ``max_num_batched_tokens`` | ``max_num_seqs`` |
| --- | --- | --- | --- |
| accelerator with >= 70 GiB | offline (``Engine`` / ``generate``) | 16384 | 1024 |
| accelerator with >= 70 GiB | server (``hwkv serve``, the serving core) | 8192 | 1024 |
| smaller accelerator | offline | 8192 | 256 |
| smaller accelerator | server | 2048 | 256 |
| host (CPU reference) | any | 2048 | 256 |

The same numbers as vLLM v1 (``UsageContext.LLM_CLASS`` / ``OPENAI_API_SERVER``, 70 GiB threshold):
offline throughput wants large prefill chunks, a server keeps chunks short for the inter-token
latency of the running decodes. Without chunked prefill the budget is at least ``max_model_len``
(a prompt must fit one step). Graphs are captured up to ``MAX_GRAPH_BATCH`` (256) requests, hwkv's
capture range before these defaults (vLLM captures up to 512): a larger decode batch runs eagerly,
where the host cost per token is already small; capture time stays what it was. The table is
docs/engine.md's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

USAGE_CONTEXTS = ("offline", "server")
BIG_DEVICE_BYTES = 70 * 2**30
MAX_GRAPH_BATCH = 256


class SchedulerDefaults(NamedTuple):
    max_num_batched_tokens: int
    max_num_seqs: int
    why: str  # "host", "accelerator >= 70 GiB, offline", ...


def scheduler_defaults(device: Any, usage_context: str | None) -> SchedulerDefaults:
    """The table above for ``device`` (an hwkv Device: ``async_copies``, ``memory_info()``) and
    ``usage_context`` (``None`` = ``"offline"``). A device without ``async_copies`` is the host itself
    (its memory is the machine's: no accelerator row applies)."""
    ctx = usage_context or "offline"
    if ctx not in USAGE_CONTEXTS:
        raise ValueError(f"usage_context must be one of {list(USAGE_CONTEXTS)} or None, got {usage_context!r}")
    if not device.async_copies:
        return SchedulerDefaults(2048, 256, "host")
    total = device.memory_info()[1]
    if total >= BIG_DEVICE_BYTES:
        return SchedulerDefaults(16384 if ctx == "offline" else 8192, 1024, f"accelerator >= 70 GiB, {ctx}")
    return SchedulerDefaults(8192 if ctx == "offline" else 2048, 256, f"accelerator < 70 GiB, {ctx}")
