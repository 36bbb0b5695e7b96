"""OpenAI response bodies from engine outputs: whole responses, SSE chunks, usage, logprobs.

A :class:`Responder` serves one HTTP request: it turns the body into engine inputs (prompt,
SamplingParams) — rendering the chat template for chat — and the engine's cumulative outputs into
the deltas OpenAI clients expect (``text_completion`` / ``chat.completion.chunk``).
"""

from __future__ import annotations

import time
from typing import Any

from hwkv.outputs import RequestOutput
from hwkv.serving.protocol import BadRequest, ChatRequest, CompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Responder:
    def __init__(self, engine: Any, body: CompletionRequest | ChatRequest, rid: str, model: str, chat: bool):
        self.engine, self.body, self.id, self.model, self.chat = engine, body, rid, model, chat
        self.created = int(time.time())
        self.tok = engine.tokenizer
        self.inputs: list[tuple[Any, Any]] = []
        if chat:
            assert isinstance(body, ChatRequest)
            ids = self._render_chat(body)
            limit = body.max_completion_tokens or body.max_tokens
            if limit is None:  # as vLLM: whatever room the context leaves
                limit = max(engine.info.max_model_len - len(ids), 1)
            self.inputs.append((ids, engine.make_params(**body.sampling_overrides(limit, body.num_logprobs()))))
            self.echo: list[str] = [""]
        else:
            assert isinstance(body, CompletionRequest)
            body.check()
            limit = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
            params = engine.make_params(**body.sampling_overrides(limit, body.logprobs))
            self.inputs = [(p, params) for p in body.prompts()]
            self.echo = [self._prompt_text(p) if body.echo else "" for p, _ in self.inputs]
        self.num_logprobs = self.inputs[0][1].logprobs
        n = len(self.inputs)
        self.text_len, self.num_ids, self.last = [0] * n, [0] * n, [None] * n

    def _render_chat(self, body: ChatRequest) -> list[int]:
        if self.tok is None:
            raise BadRequest("chat needs a tokenizer and this model directory has no tokenizer.json "
                             "(use /v1/completions with token ids)", "messages")
        if not self.tok.chat_template:
            raise BadRequest("this model has no chat template (tokenizer_config.json has no chat_template); "
                             "use /v1/completions, or add a chat_template to tokenizer_config.json", "messages")
        try:
            text = self.tok.apply_chat_template([m.as_dict() for m in body.messages], body.add_generation_prompt)
        except Exception as e:  # jinja2 errors, raise_exception() in the template
            raise BadRequest(f"messages could not be rendered by the chat template: {e}", "messages") from None
        # The template writes the special tokens it wants (BOS included), as HF apply_chat_template.
        ids = self.tok.encode(text, add_special_tokens=False)
        if not ids:
            raise BadRequest("messages render to no tokens", "messages")
        return ids

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tok.decode(prompt) if self.tok is not None else ""

    def _token(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False) if self.tok is not None else f"token_id:{t}"

    # ---- logprobs -------------------------------------------------------------------------------
    def _top(self, lp: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(lp.items(), key=lambda kv: -kv[1])[: self.num_logprobs or 0]

    def _logprobs(self, out: RequestOutput, a: int, b: int, offset: int) -> dict[str, Any] | None:
        if self.num_logprobs is None or out.logprobs is None:
            return None
        pairs = list(zip(out.token_ids[a:b], out.logprobs[a:b]))
        if self.chat:
            def entry(t: int, v: float) -> dict[str, Any]:
                s = self._token(t)
                return {"token": s, "logprob": v, "bytes": list(s.encode())}

            return {"content": [{**entry(t, lp.get(t, float("-inf"))),
                                 "top_logprobs": [entry(k, v) for k, v in self._top(lp)]} for t, lp in pairs]}
        tokens = [self._token(t) for t, _ in pairs]
        offsets = []
        for s in tokens:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": [lp.get(t) for t, lp in pairs],
                "top_logprobs": [{self._token(k): v for k, v in self._top(lp)} for _, lp in pairs],
                "text_offset": offsets}

    # ---- bodies -------------------------------------------------------------------------------
    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _choice(self, i: int, out: RequestOutput, text: str, a: int, b: int, offset: int,
                delta: bool) -> dict[str, Any]:
        done = out.finished
        c: dict[str, Any] = {"index": i}
        if self.chat:
            c["delta" if delta else "message"] = {"content": text} if delta else {"role": "assistant", "content": text}
        else:
            c["text"] = text
        c["logprobs"] = self._logprobs(out, a, b, offset)
        c["finish_reason"] = out.finish_reason if done else None
        c["stop_reason"] = out.stop_reason if done and out.finish_reason == "stop" else None
        if self.body.return_token_ids:
            c["token_ids"] = out.token_ids[a:b]
        return c

    def _usage(self, outs: list[Any]) -> dict[str, int]:
        p = sum(len(o.prompt_token_ids) for o in outs if o is not None)
        c = sum(len(o.token_ids) for o in outs if o is not None)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = [self._choice(i, o, self.echo[i] + o.text, 0, len(o.token_ids), len(self.echo[i]), False)
                   for i, o in enumerate(finals)]
        kind = "chat.completion" if self.chat else "text_completion"
        out = {**self._head(kind), "choices": choices, "usage": self._usage(finals)}
        if len(finals) == 1 and finals[0] is not None and finals[0].kv_transfer_params is not None:
            out["kv_transfer_params"] = finals[0].kv_transfer_params  # as vLLM: where a decode server finds the KV
        return out

    def opening_chunks(self) -> list[dict[str, Any]]:
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            return [{**self._head("chat.completion.chunk"),
                     "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}]
        return [{**self._head("text_completion"),
                 "choices": [{"index": i, "text": e, "logprobs": None, "finish_reason": None}]}
                for i, e in enumerate(self.echo) if e]

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        a, t0 = self.num_ids[i], self.text_len[i]
        self.num_ids[i], self.text_len[i], self.last[i] = len(out.token_ids), len(out.text), out
        if a == len(out.token_ids) and t0 == len(out.text) and not out.finished:
            return []
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        choice = self._choice(i, out, out.text[t0:], a, len(out.token_ids), len(self.echo[i]) + t0, True)
        return [{**self._head(kind), "choices": [choice]}]

    def usage_chunk(self) -> dict[str, Any] | None:
        opts = self.body.stream_options
        if opts is None or not opts.include_usage:
            return None
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self._usage(self.last)}
