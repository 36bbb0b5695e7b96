"""Tool calling for chat: the grammar a ``tool_choice`` imposes, and the parsers that find tool calls
in a model's text, one per model family (vLLM's ``--tool-call-parser`` names).

* ``tool_choice: "required"`` — the output is constrained to a JSON array (at least one item; one
  with ``parallel_tool_calls: false``) of ``{"name": <one of the tools>, "parameters": <that tool's
  schema>}``, as vLLM does; each item is a call.
* ``tool_choice: {"type": "function", "function": {"name": N}}`` — the output is constrained to N's
  parameters schema; the whole output is N's arguments.
* ``tool_choice: "auto"`` (the default when ``tools`` are given) — the model decides; the server's
  parser (``hwkv serve --tool-call-parser hermes|llama3_json``) extracts the calls from its text:
  ``hermes`` (Hermes, Qwen 2.5 / 3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, the text before the first one is the content; ``llama3_json`` (Llama 3.1 / 3.2 JSON tool
  calling): the output is ``{"name": ..., "parameters": {...}}`` objects (``;``-separated,
  optionally after ``<|python_tag|>``).
* ``tool_choice: "none"`` — the tools reach the chat template, no call is parsed.

Streaming (:class:`CallStream`, as vLLM's parsers stream): a call's first delta carries its index,
id, type and name (``arguments: ""``) once the name string is complete; then its arguments stream
as the model writes them, the raw JSON text of the value (the deltas concatenate to valid JSON).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from hwkv.serving.protocol import BadRequest

PARSERS = ("hermes", "llama3_json")


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise BadRequest(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                             "\"parameters\": {...}}}", "tools")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise BadRequest(f"tools[{i}].function.parameters must be a JSON schema object", "tools")
        out[fn["name"]] = params
    return out


def grammar(tools: list[dict[str, Any]] | None, tool_choice: Any,
            parallel: bool | None = None) -> dict[str, Any] | None:
    """The ``structured_outputs`` spec ``tool_choice`` imposes (``None``: unconstrained);
    ``parallel=False`` (OpenAI's ``parallel_tool_calls``): at most one call."""
    if tool_choice in (None, "none", "auto"):
        return None
    if not tools:
        raise BadRequest(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
    fns = _functions(tools)
    if tool_choice == "required":
        items = [{"type": "object", "properties": {"name": {"const": name}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False} for name, schema in fns.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
        return {"json": {**array, "maxItems": 1} if parallel is False else array}
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in fns:
            raise BadRequest(f"tool_choice names function {name!r}, which is not in tools "
                             f"(allowed: {', '.join(fns)})", "tool_choice")
        return {"json": fns[name]}
    raise BadRequest(f"tool_choice must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"function\": "
                     f"{{\"name\": ...}}}}, got {tool_choice!r}", "tool_choice")


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": args}}


def forced_calls(text: str, tool_choice: Any) -> list[dict[str, Any]]:
    """The calls of an output constrained by :func:`grammar` (``required`` or a named function)."""
    try:
        value = json.loads(text)
    except ValueError:  # cut short by max_tokens: not a call
        return []
    if tool_choice == "required":
        return [_call(v["name"], v.get("parameters", {})) for v in value if isinstance(v, dict) and "name" in v]
    return [_call(tool_choice["function"]["name"], text)]


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse(parser: str, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool calls)`` of a model's text under ``parser`` (no call: the text is the content)."""
    if parser == "hermes":
        if "<tool_call>" not in text:
            return text, []
        calls = []
        for body in _HERMES.findall(text):
            try:
                v = json.loads(body)
            except ValueError:
                continue
            if isinstance(v, dict) and isinstance(v.get("name"), str):
                calls.append(_call(v["name"], v.get("arguments", v.get("parameters", {}))))
        if not calls:
            return text, []
        content = text[: text.index("<tool_call>")].strip()
        return content or None, calls
    if parser == "llama3_json":
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        dec = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                v, end = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            if not isinstance(v, dict) or not isinstance(v.get("name"), str):
                return text, []
            calls.append(_call(v["name"], v.get("parameters", v.get("arguments", {}))))
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls
    raise ValueError(f"unknown tool-call parser {parser!r} (allowed: {', '.join(PARSERS)})")


def may_start_call(parser: str, text: str) -> int:
    """Where a tool call could begin in streamed ``text`` (its length if nowhere): content before it
    can be streamed, the rest is held until the output is complete."""
    if parser == "hermes":
        i = text.find("<tool_call>")
        if i >= 0:
            return i
        for k in range(min(len(text), len("<tool_call>") - 1), 0, -1):  # a partial marker at the end
            if "<tool_call>".startswith(text[-k:]):
                return len(text) - k
        return len(text)
    stripped = text.lstrip()
    if not stripped or stripped.startswith(("{", "<|python_tag|>")) or "<|python_tag|>".startswith(stripped):
        return 0
    return len(text)


# ---- streaming ----------------------------------------------------------------------------------
_WS = " \t\r\n"


def _skip(s: str, i: int, chars: str = _WS) -> int:
    while i < len(s) and s[i] in chars:
        i += 1
    return i


def _string_end(s: str, i: int) -> int | None:
    """Index after the JSON string starting at ``s[i] == '"'``; ``None`` while it is open."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _value_end(s: str, i: int) -> int | None:
    """Index after the JSON value starting at ``s[i]``; ``None`` while it may still grow."""
    c = s[i]
    if c == '"':
        return _string_end(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                e = _string_end(s, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in _WS + ",}]":
        j += 1
    return j if j < len(s) else None


def _members(s: str, i: int) -> tuple[dict[str, tuple[int, int, bool]], int | None]:
    """Top-level members of the JSON object at ``s[i] == '{'``: key -> (value start, end so far,
    complete), and the index after the object (``None`` while open or malformed)."""
    out: dict[str, tuple[int, int, bool]] = {}
    j = i + 1
    while True:
        j = _skip(s, j, _WS + ",")
        if j >= len(s) or s[j] != '"':
            return out, (j + 1 if j < len(s) and s[j] == "}" else None)
        e = _string_end(s, j)
        if e is None:
            return out, None
        try:
            key = json.loads(s[j:e])
        except ValueError:
            return out, None
        j = _skip(s, e)
        if j >= len(s) or s[j] != ":":
            return out, None
        j = _skip(s, j + 1)
        if j >= len(s):
            return out, None
        e = _value_end(s, j)
        out[key] = (j, len(s) if e is None else e, e is not None)
        if e is None:
            return out, None
        j = e


def _object_calls(s: str, starts: list[int]) -> list[tuple[str | None, str]]:
    """``(name once complete, raw arguments text so far)`` of the call objects at ``starts``."""
    calls = []
    for i in starts:
        m, _ = _members(s, i)
        name = None
        if "name" in m and m["name"][2]:
            try:
                v = json.loads(s[m["name"][0] : m["name"][1]])
                name = v if isinstance(v, str) else None
            except ValueError:
                pass
        key = "arguments" if "arguments" in m else "parameters"
        a = m.get(key)
        calls.append((name, s[a[0] : a[1]].rstrip(_WS) if a else ""))
    return calls


def _starts(kind: str, s: str) -> list[int]:
    """Where each call object of ``kind``'s format begins in ``s`` (those begun so far)."""
    out: list[int] = []
    if kind == "hermes":
        for m in re.finditer(re.escape("<tool_call>"), s):
            j = _skip(s, m.end())
            if j < len(s) and s[j] == "{":
                out.append(j)
        return out
    if kind == "llama3_json":
        j = _skip(s, 0)
        if s.startswith("<|python_tag|>", j):
            j = _skip(s, j + len("<|python_tag|>"))
        sep = _WS + ";"
    else:  # required: a JSON array of call objects
        j = _skip(s, 0)
        if j >= len(s) or s[j] != "[":
            return out
        j, sep = j + 1, _WS + ","
    while True:
        j = _skip(s, j, sep)
        if j >= len(s) or s[j] != "{":
            return out
        out.append(j)
        e = _value_end(s, j)
        if e is None:
            return out
        j = e


class CallStream:
    """The tool-call deltas of one streamed choice. ``kind``: a parser name, ``"required"``, or
    ``("named", function name)``; :meth:`update` takes the choice's whole text so far and returns
    the new deltas (``{"index", "id", "type", "function": {"name", "arguments": ""}}`` when a call's
    name is complete, then ``{"index", "function": {"arguments": piece}}``)."""

    def __init__(self, kind: Any):
        self.kind = kind
        self.sent: list[list[Any]] = []  # per call: [id, name, arguments chars sent]

    def _calls(self, text: str) -> list[tuple[str | None, str]]:
        if isinstance(self.kind, tuple):  # named: the whole output is the arguments
            return [(self.kind[1], text.strip(_WS))]
        return _object_calls(text, _starts(self.kind, text))

    def update(self, text: str) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        for k, (name, args) in enumerate(self._calls(text)):
            if k == len(self.sent):
                if name is None:
                    break  # calls stream in order: the next one waits for this one's name
                cid = f"call_{uuid.uuid4().hex[:24]}"
                self.sent.append([cid, name, 0])
                deltas.append({"index": k, "id": cid, "type": "function",
                               "function": {"name": name, "arguments": ""}})
            st = self.sent[k]
            if len(args) > st[2] and args.startswith(args[: st[2]]):
                deltas.append({"index": k, "function": {"arguments": args[st[2] :]}})
                st[2] = len(args)
        return deltas
