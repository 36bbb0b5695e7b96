"""OpenAI-compatible request bodies (pydantic) and their mapping onto SamplingParams.

Field names and defaults follow the OpenAI API; the vLLM extensions users rely on are accepted too
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``skip_special_tokens``, ``cache_salt``, ``priority``) plus ``return_token_ids`` (each choice / chunk carries
its token ids — the only output of a model without a tokenizer). Unknown fields are ignored, as
OpenAI clients send fields a server may not know. Unsupported features are refused by name.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hwkv.sampling_params import MAX_LOGPROBS


class BadRequest(ValueError):
    """A request the server refuses (400); ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def param_of(err: ValueError, default: str) -> str:
    """The request field a validation error is about (``SamplingParams.x`` → ``x``)."""
    if isinstance(err, BadRequest) and err.param:
        return err.param
    if match := re.search(r"SamplingParams\.(\w+)", str(err)):
        return match.group(1)
    if str(err).startswith("priority"):
        return "priority"
    return "max_tokens" if "exceeds max_model_len" in str(err) else default


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    priority: int = 0  # lower runs first; needs a server with --scheduling-policy priority
    return_token_ids: bool = False
    # KV connector parameters, in and out as vLLM's (e.g. {"do_remote_decode": true} on a prefill server)
    kv_transfer_params: dict[str, Any] | None = None

    def sampling_overrides(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """SamplingParams fields this request sets (the rest keep the model's defaults)."""
        if self.n != 1:
            raise BadRequest(f"n must be 1 (parallel sampling is not supported), got {self.n}", "n")
        if self.logit_bias:
            raise BadRequest("logit_bias is not supported", "logit_bias")
        names = ("temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                 "cache_salt", "kv_transfer_params")
        kw = {k: v for k in names if (v := getattr(self, k)) is not None}
        if max_tokens is not None:
            kw["max_tokens"] = max_tokens
        if logprobs is not None:
            kw["logprobs"] = logprobs
        return kw


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise BadRequest("prompt must not be empty", "prompt")
        return list(p)  # type: ignore[arg-type]

    def check(self) -> None:
        if self.best_of not in (None, 1):
            raise BadRequest(f"best_of must be 1 (got {self.best_of})", "best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: str
    content: str | list[TextPart] | None = None

    def as_dict(self) -> dict[str, Any]:
        d = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            d["content"] = "".join(p.text for p in self.content)
        return d


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
