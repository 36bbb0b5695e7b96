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


def param_of(err: ValueError, default: str | None) -> str | None:
    """The request field a validation error is about (``SamplingParams.x`` → ``x``)."""
    if isinstance(err, BadRequest) and err.param:
        return err.param
    if match := re.search(r"SamplingParams\.(\w+)", str(err)):
        return match.group(1)
    if str(err).startswith("priority"):
        return "priority"
    return "max_tokens" if "exceeds max_model_len" in str(err) else default


MAX_N = 128  # choices per prompt (parallel sampling)
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


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
    include_stop_str_in_output: bool = False
    add_special_tokens: bool | None = None  # default: True for completions, False for chat (the template's)
    prompt_logprobs: int | None = None
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted, ignored: one grammar engine (llguidance)

    def structured(self) -> tuple[dict[str, Any], str] | None:
        """``(structured_outputs spec, field it came from)``; at most one of the ways to ask."""
        asks: list[tuple[dict[str, Any], str]] = []
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                asks.append(({"json_object": True}, "response_format"))
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema", {}), (dict, bool)):
                    raise BadRequest("response_format.json_schema must be {\"name\": ..., \"schema\": {...}}",
                                     "response_format")
                asks.append(({"json": js.get("schema", {})}, "response_format"))
            elif kind != "text":
                raise BadRequest(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                                 "response_format")
        if self.structured_outputs:
            asks.append((dict(self.structured_outputs), "structured_outputs"))
        for name, key in _GUIDED.items():
            if getattr(self, name) is not None:
                asks.append(({key: getattr(self, name)}, name))
        if len(asks) > 1:
            raise BadRequest(f"{' and '.join(a[1] for a in asks)} both constrain the output: give one", asks[1][1])
        return asks[0] if asks else None

    def sampling_overrides(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """SamplingParams fields this request sets (the rest keep the model's defaults)."""
        if not 1 <= self.n <= MAX_N:
            raise BadRequest(f"n must be in [1, {MAX_N}], got {self.n}", "n")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
                raise BadRequest(f"prompt_logprobs must be null or an integer in [0, {MAX_LOGPROBS}], got "
                                 f"{self.prompt_logprobs}", "prompt_logprobs")
            if self.stream and self.prompt_logprobs > 0:  # as vLLM
                raise BadRequest("prompt_logprobs are not available when stream=true (allowed: null or 0)",
                                 "prompt_logprobs")
        names = ("temperature", "top_p", "stop", "seed", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                 "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids", "skip_special_tokens",
                 "cache_salt", "kv_transfer_params", "prompt_logprobs")
        kw = {k: v for k in names if (v := getattr(self, k)) is not None}
        if self.logit_bias:
            try:
                kw["logit_bias"] = {int(k): v for k, v in self.logit_bias.items()}
            except ValueError:
                raise BadRequest("logit_bias keys must be token ids (integers as strings, e.g. {\"50256\": -100})",
                                 "logit_bias") from None
        if (so := self.structured()) is not None:
            kw["structured_outputs"] = so[0]
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
        if self.best_of not in (None, 1, self.n):  # as vLLM v1: no best_of beyond n
            raise BadRequest(f"best_of is not supported (as in vLLM v1): it must equal n or be null, got "
                             f"{self.best_of}; use n for several samples", "best_of")
        if self.suffix:
            raise BadRequest("suffix is not supported", "suffix")


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the template

    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None

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
    chat_template: str | None = None  # a Jinja template for this request instead of the model's
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs=true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's ``/tokenize``: ``prompt`` (text) or chat ``messages`` (rendered by the chat template)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template's)
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]
