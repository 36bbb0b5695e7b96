"""Tokenizer: a thin wrapper over ``tokenizers.Tokenizer`` loaded from ``tokenizer.json``
(+ ``tokenizer_config.json`` for bos/eos names and the chat template). No transformers needed."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from hwkv.model.config import ModelLoadError, read_json
from hwkv.model.gguf_file import find_gguf, open_gguf


def _token_name(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": ...} form
        value = value.get("content")
    return value if isinstance(value, str) else None


def has_tokenizer(path: str | Path) -> bool:
    """Whether the checkpoint at ``path`` carries a tokenizer: an HF directory's tokenizer.json,
    or a GGUF checkpoint (its vocabulary is in the metadata)."""
    return (Path(path) / "tokenizer.json").is_file() or find_gguf(path) is not None


class Tokenizer:
    """``encode``/``decode`` with the special-token handling of the checkpoint's ``tokenizer.json``
    (its post-processor decides whether a BOS is prepended)."""

    def __init__(self, tokenizer: Any, config: dict[str, Any] | None = None):
        self._tok = tokenizer
        config = config or {}
        self.bos_token = _token_name(config.get("bos_token"))
        self.eos_token = _token_name(config.get("eos_token"))
        self.pad_token = _token_name(config.get("pad_token"))
        template = config.get("chat_template")
        self.chat_template: str | None = template if isinstance(template, str) else None
        self.all_special_ids: frozenset[int] = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if (gguf := find_gguf(path)) is not None:  # vocabulary, merges and chat template from the metadata
            return cls(*open_gguf(gguf).tokenizer())
        file = path / "tokenizer.json"
        if not file.is_file():
            raise ModelLoadError(f"{file}: file not found (a `tokenizers` tokenizer.json is required)")
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # tokenizers raises a bare Exception for malformed files
            raise ModelLoadError(f"{file}: cannot be parsed by tokenizers ({e})") from None
        cfg_file = path / "tokenizer_config.json"
        config = read_json(cfg_file) if cfg_file.is_file() else {}
        return cls(tok, config)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    def to_json(self) -> str:
        """The ``tokenizers`` JSON of this tokenizer (structured outputs build llguidance's from it)."""
        return self._tok.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if len(text) > 4096:  # encode_batch releases the GIL (encode does not): a server thread that
            # tokenizes a long prompt leaves the event loop running
            return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            template: str | None = None, tools: list[dict[str, Any]] | None = None,
                            **kwargs: Any) -> str:
        """Render ``messages`` with the checkpoint's Jinja chat template, or ``template`` (needs
        ``jinja2``); ``tools`` and ``kwargs`` (e.g. ``enable_thinking``) reach the template as
        transformers' ``apply_chat_template`` passes them."""
        template = template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat_template (tokenizer_config.json)")
        return _compiled_template(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
            **{"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kwargs},
        )


@functools.lru_cache(maxsize=32)
def _compiled_template(template: str) -> Any:
    import json

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # A template is checkpoint- or client-supplied code: render it sandboxed, as transformers does.
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
    # transformers' tojson: plain JSON (jinja2's own escapes <, >, & for HTML)
    env.filters["tojson"] = lambda x, indent=None, separators=None, sort_keys=False, ensure_ascii=False: json.dumps(
        x, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)
    return env.from_string(template)
