"""OpenAI response bodies from engine outputs: whole responses, SSE chunks, usage, logprobs, tool calls.

A :class:`Responder` serves one HTTP request: it turns the body into engine inputs (prompt,
SamplingParams) — rendering the chat template for chat, one input per choice — and the engine's
cumulative outputs into the deltas OpenAI clients expect (``text_completion`` /
``chat.completion.chunk``). Construction tokenizes: the server runs it on a worker thread.

``n > 1`` is parallel sampling as vLLM's: each prompt becomes ``n`` requests with the same prompt
(the prefix cache shares its KV blocks; each child gets its own blocks from the first block it
writes alone), a seeded request's child ``j`` seeded ``seed + j``; choice ``p * n + j`` is prompt
``p``'s sample ``j``.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import replace
from typing import Any

from hwkv.outputs import RequestOutput
from hwkv.serving import tools as tool_calls
from hwkv.serving.protocol import BadRequest, ChatRequest, CompletionRequest

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Responder:
    def __init__(self, engine: Any, body: CompletionRequest | ChatRequest, rid: str, model: str, chat: bool,
                 max_prompt_chars: int | None = None, tool_parser: str | None = None):
        self.engine, self.body, self.id, self.model, self.chat = engine, body, rid, model, chat
        self.created = int(time.time())
        self.tok = engine.tokenizer
        self.max_chars = max_prompt_chars
        self.n = body.n
        self.tool_mode: str | None = None  # "forced" (required / named), "parse" (auto with a parser)
        prompts: list[Any]
        if chat:
            assert isinstance(body, ChatRequest)
            ids = self._render_chat(body, tool_parser)
            limit = body.max_completion_tokens or body.max_tokens
            if limit is None:  # as vLLM: whatever room the context leaves
                limit = max(engine.info.max_model_len - len(ids), 1)
            params = engine.make_params(**self._overrides(limit, body.num_logprobs()))
            prompts, self.echo = [ids], [""] * self.n
        else:
            assert isinstance(body, CompletionRequest)
            body.check()
            limit = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
            params = engine.make_params(**self._overrides(limit, body.logprobs))
            prompts = [self._completion_prompt(p) for p in body.prompts()]
            self.echo = [self._prompt_text(p) if body.echo else "" for p in prompts for _ in range(self.n)]
        self.inputs: list[tuple[Any, Any]] = [
            (p, params if self.n == 1 or params.seed is None else replace(params, seed=params.seed + j))
            for p in prompts for j in range(self.n)]
        self.num_logprobs = params.logprobs
        k = len(self.inputs)
        self.text_len, self.num_ids, self.last = [0] * k, [0] * k, [None] * k
        self.held = [False] * k  # tool calls: the rest of this choice's text goes through a CallStream
        self.streams: dict[int, tool_calls.CallStream] = {}

    def _overrides(self, limit: int, logprobs: int | None) -> dict[str, Any]:
        kw = self.body.sampling_overrides(limit, logprobs)
        if self._echo_logprobs():  # as vLLM: echo with logprobs covers the prompt's tokens too
            kw["prompt_logprobs"] = logprobs
        if "structured_outputs" in kw:  # a bad grammar is a 400 naming the field it came from
            try:
                self.engine.check_structured(kw["structured_outputs"])
            except ValueError as e:
                raise BadRequest(str(e), self.body.structured()[1]) from None
        if self.body.include_stop_str_in_output:
            kw["include_stop_str_in_output"] = True
        grammar = getattr(self, "_tool_grammar", None)
        if grammar is not None:
            if "structured_outputs" in kw:
                raise BadRequest("tool_choice and a structured output both constrain the output: give one",
                                 "tool_choice")
            try:
                self.engine.check_structured(grammar)
            except ValueError as e:
                raise BadRequest(str(e), "tools") from None
            kw["structured_outputs"] = grammar
        return kw

    def _check_length(self, text: str, field: str) -> None:
        if self.max_chars is not None and len(text) > self.max_chars:
            raise BadRequest(f"{field} is {len(text)} characters, more than this server accepts ({self.max_chars}: "
                             "no longer text can fit max_model_len; the server's --max-prompt-chars)", field)

    def _completion_prompt(self, p: str | list[int]) -> str | list[int]:
        if not isinstance(p, str):
            return p
        self._check_length(p, "prompt")
        if self.body.add_special_tokens is False and self.tok is not None and p:
            try:
                return self.tok.encode(p, add_special_tokens=False) or p
            except Exception:
                return p  # the engine's validation names the problem
        return p

    def _render_chat(self, body: ChatRequest, tool_parser: str | None) -> list[int]:
        if self.tok is None:
            raise BadRequest("chat needs a tokenizer and this model directory has no tokenizer.json "
                             "(use /v1/completions with token ids)", "messages")
        if not (body.chat_template or self.tok.chat_template):
            raise BadRequest("this model has no chat template (tokenizer_config.json has no chat_template); "
                             "use /v1/completions, pass chat_template, or add a chat_template to "
                             "tokenizer_config.json", "messages")
        self._tool_grammar = None
        choice = body.tool_choice if body.tool_choice is not None else ("auto" if body.tools else "none")
        if body.tools or body.tool_choice not in (None, "none"):
            self._tool_grammar = tool_calls.grammar(body.tools, choice, body.parallel_tool_calls)
            if self._tool_grammar is not None:
                self.tool_mode, self.tool_choice = "forced", choice
            elif choice == "auto":
                if tool_parser is None:
                    raise BadRequest("tool_choice 'auto' needs a server started with --tool-call-parser "
                                     f"({' | '.join(tool_calls.PARSERS)}); allowed here: 'none', 'required' or a "
                                     "named function", "tool_choice")
                self.tool_mode, self.parser = "parse", tool_parser
        for m in body.messages:
            if isinstance(m.content, str):
                self._check_length(m.content, "messages")
        try:
            messages = tool_arguments_as_objects([m.as_dict() for m in body.messages])
            text = self.tok.apply_chat_template(messages, body.add_generation_prompt,
                                                template=body.chat_template, tools=body.tools,
                                                **(body.chat_template_kwargs or {}))
        except Exception as e:  # jinja2 errors, raise_exception() in the template
            raise BadRequest(f"messages could not be rendered by the chat template: {e}", "messages") from None
        self._check_length(text, "messages")
        # The template writes the special tokens it wants (BOS included), as HF apply_chat_template.
        try:
            ids = self.tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
        except Exception as e:  # a lone surrogate from a string the body parser let through
            raise BadRequest(f"messages cannot be tokenized ({type(e).__name__}: {e}); allowed: valid Unicode",
                             "messages") from None
        if not ids:
            raise BadRequest("messages render to no tokens", "messages")
        return ids

    def _echo_logprobs(self) -> bool:
        b = self.body
        return (not self.chat and getattr(b, "echo", False) and b.logprobs is not None and b.prompt_logprobs is None
                and not b.stream)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        if isinstance(prompt, str):
            return prompt
        return self.tok.decode(prompt) if self.tok is not None else ""

    def _token(self, t: int) -> str:
        return self.tok.decode([t], skip_special_tokens=False) if self.tok is not None else f"token_id:{t}"

    # ---- logprobs -------------------------------------------------------------------------------
    def _top(self, lp: dict[int, float]) -> list[tuple[int, float]]:
        return sorted(lp.items(), key=lambda kv: -kv[1])[: self.num_logprobs or 0]

    def _logprobs(self, out: RequestOutput, a: int, b: int, offset: int, echo: bool = False) -> dict[str, Any] | None:
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
        values = [lp.get(t) for t, lp in pairs]
        tops: list[dict[str, float] | None] = [{self._token(k): v for k, v in self._top(lp)} for _, lp in pairs]
        offsets: list[int] = []
        if echo and out.prompt_logprobs is not None:  # the echoed prompt's tokens first, from offset 0
            recs, at = out.prompt_logprobs, 0
            for t in out.prompt_token_ids:
                offsets.append(at)
                at += len(self._token(t))
            offset = at  # offsets index the concatenated token strings
            tokens = [self._token(t) for t in out.prompt_token_ids] + tokens
            values = [None if r is None else r[t][0] for t, r in zip(out.prompt_token_ids, recs)] + values
            tops = [None if r is None else {self._token(k): v for k, (v, rank) in sorted(r.items(), key=lambda kv:
                    kv[1][1]) if rank <= (self.num_logprobs or 0)} for r in recs] + tops
        for s in tokens[len(offsets):]:
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _prompt_logprobs(self, out: RequestOutput | None) -> list[dict[str, Any] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or ``{token id: {logprob,
        rank, decoded_token}}``, the prompt token first, then the top-n by rank; -inf as -9999.0."""
        if out is None or out.prompt_logprobs is None:
            return None
        res: list[dict[str, Any] | None] = []
        for t, rec in zip(out.prompt_token_ids, out.prompt_logprobs):
            if rec is None:
                res.append(None)
                continue
            order = sorted(rec, key=lambda k: (k != t, rec[k][1]))
            res.append({str(k): {"logprob": max(rec[k][0], -9999.0), "rank": rec[k][1],
                                 "decoded_token": self._token(k)} for k in order})
        return res

    # ---- tool calls -----------------------------------------------------------------------------
    def _tool_result(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        if self.tool_mode == "forced":
            calls = tool_calls.forced_calls(text, self.tool_choice)
            return (None if calls else text), calls
        return tool_calls.parse(self.parser, text)

    # ---- bodies -------------------------------------------------------------------------------
    def _head(self, kind: str) -> dict[str, Any]:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _finish_reason(self, out: RequestOutput, calls: list[Any] | None) -> str | None:
        if not out.finished:
            return None
        return "tool_calls" if calls and out.finish_reason == "stop" else out.finish_reason

    def _choice(self, i: int, out: RequestOutput, text: str, a: int, b: int, offset: int,
                delta: bool) -> dict[str, Any]:
        done = out.finished
        c: dict[str, Any] = {"index": i}
        calls = None
        if self.chat:
            if self.tool_mode is not None and done and not delta:
                content, calls = self._tool_result(text)
                msg: dict[str, Any] = {"role": "assistant", "content": content}
                if calls:
                    msg["tool_calls"] = calls
                c["message"] = msg
            else:
                c["delta" if delta else "message"] = {"content": text} if delta else {"role": "assistant",
                                                                                       "content": text}
        else:
            c["text"] = text
        c["logprobs"] = self._logprobs(out, a, b, offset, echo=not delta and bool(self.echo[i]))
        c["finish_reason"] = self._finish_reason(out, calls)
        c["stop_reason"] = out.stop_reason if done and out.finish_reason == "stop" else None
        if self.body.return_token_ids:
            c["token_ids"] = out.token_ids[a:b]
        if not self.chat and not delta and self.body.prompt_logprobs is not None:
            c["prompt_logprobs"] = self._prompt_logprobs(out)
        return c

    def _usage(self, outs: list[Any]) -> dict[str, int]:
        p = sum(len(o.prompt_token_ids) for i, o in enumerate(outs) if o is not None and i % self.n == 0)
        c = sum(len(o.token_ids) for o in outs if o is not None)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def response(self, finals: list[RequestOutput]) -> dict[str, Any]:
        choices = [self._choice(i, o, self.echo[i] + o.text, 0, len(o.token_ids), len(self.echo[i]), False)
                   for i, o in enumerate(finals)]
        kind = "chat.completion" if self.chat else "text_completion"
        out = {**self._head(kind), "choices": choices, "usage": self._usage(finals)}
        if self.chat and self.body.prompt_logprobs is not None:  # vLLM: top level for chat, per choice otherwise
            out["prompt_logprobs"] = self._prompt_logprobs(finals[0])
        if len(finals) == 1 and finals[0] is not None and finals[0].kv_transfer_params is not None:
            out["kv_transfer_params"] = finals[0].kv_transfer_params  # as vLLM: where a decode server finds the KV
        return out

    def opening_chunks(self) -> list[dict[str, Any]]:
        if self.chat:
            delta = {"role": "assistant", "content": ""}
            return [{**self._head("chat.completion.chunk"),
                     "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}]}
                    for i in range(self.n)]
        return [{**self._head("text_completion"),
                 "choices": [{"index": i, "text": e, "logprobs": None, "finish_reason": None}]}
                for i, e in enumerate(self.echo) if e]

    def chunks(self, i: int, out: RequestOutput) -> list[dict[str, Any]]:
        a, t0 = self.num_ids[i], self.text_len[i]
        self.num_ids[i], self.last[i] = len(out.token_ids), out
        if a == len(out.token_ids) and t0 == len(out.text) and not out.finished:
            return []
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        if self.tool_mode is None:
            self.text_len[i] = len(out.text)
            choice = self._choice(i, out, out.text[t0:], a, len(out.token_ids), len(self.echo[i]) + t0, True)
            return [{**self._head(kind), "choices": [choice]}]
        return self._tool_chunks(i, out, a, t0, kind)

    def _tool_chunks(self, i: int, out: RequestOutput, a: int, t0: int, kind: str) -> list[dict[str, Any]]:
        """Chat with tools: content streams until a call may start; then each call's name once complete
        and its arguments as they are written (:class:`~hwkv.serving.tools.CallStream`); a call the
        final parse finds that did not stream comes whole in the last delta."""
        if not self.held[i]:
            stop_at = 0 if self.tool_mode == "forced" else tool_calls.may_start_call(self.parser, out.text)
            self.held[i] = stop_at < len(out.text) or self.tool_mode == "forced"
            new = out.text[t0:max(stop_at, t0)]
            self.text_len[i] = max(stop_at, t0)
        else:
            new = ""
        chunks = []
        if new or (not out.finished and len(out.token_ids) > a and not self.held[i]):
            c = self._choice(i, replace(out, finished=False), new, a, len(out.token_ids), t0, True)
            chunks.append({**self._head(kind), "choices": [c]})
        streamed = self._call_stream(i).update(out.text) if self.held[i] else []
        if streamed and not out.finished:
            chunks.append({**self._head(kind), "choices": [{"index": i, "delta": {"tool_calls": streamed},
                                                            "logprobs": None, "finish_reason": None}]})
        if out.finished:
            delta: dict[str, Any] = {}
            calls: list[Any] = []
            if self.held[i]:
                content, calls = self._tool_result(out.text)
                rest = out.text[self.text_len[i]:] if not calls else ""
                if rest:
                    delta["content"] = rest
                if calls:
                    n = len(self._call_stream(i).sent)
                    delta["tool_calls"] = streamed + [{"index": k, **c} for k, c in enumerate(calls) if k >= n]
            c = {"index": i, "delta": delta, "logprobs": None, "finish_reason": self._finish_reason(out, calls),
                 "stop_reason": out.stop_reason if out.finish_reason == "stop" else None}
            chunks.append({**self._head(kind), "choices": [c]})
        return chunks

    def _call_stream(self, i: int) -> tool_calls.CallStream:
        st = self.streams.get(i)
        if st is None:
            if self.tool_mode == "parse":
                kind: Any = self.parser
            elif self.tool_choice == "required":
                kind = "required"
            else:
                kind = ("named", self.tool_choice["function"]["name"])
            st = self.streams[i] = tool_calls.CallStream(kind)
        return st

    def usage_chunk(self) -> dict[str, Any] | None:
        opts = self.body.stream_options
        if opts is None or not opts.include_usage:
            return None
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(kind), "choices": [], "usage": self._usage(self.last)}


def tool_arguments_as_objects(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat templates read earlier calls' ``arguments`` as objects; OpenAI clients send JSON text."""
    for m in messages:
        for call in m.get("tool_calls") or ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                with contextlib.suppress(ValueError):
                    fn["arguments"] = json.loads(fn["arguments"])
    return messages
