"""Prompt validation shared by the in-process Engine and the serving front end (AsyncEngine)."""

from __future__ import annotations

from typing import Any

Prompt = str | list[int]


def tokenize_prompt(prompt: Prompt, tokenizer: Any, vocab_size: int) -> tuple[str | None, list[int]]:
    """``(text, token ids)`` of a prompt given as text or as token ids (``text`` is None for ids).

    Raises ``ValueError`` naming what is wrong and what is allowed: an empty prompt, text without a
    tokenizer, text that cannot be tokenized (e.g. a lone surrogate) or encodes to nothing, a value
    that is neither str nor a list of ints, a token id outside ``0..vocab_size-1``."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt must not be empty (got '')")
        if tokenizer is None:
            raise ValueError("prompt is a str but the model has no tokenizer.json; pass token ids")
        try:
            prompt.encode("utf-8")
            ids = tokenizer.encode(prompt)
        except Exception as e:  # e.g. a lone surrogate: the tokenizer raises TypeError
            raise ValueError(f"prompt {prompt[:40]!r} cannot be tokenized ({type(e).__name__}: {e}); "
                             "allowed: a valid Unicode string") from None
        if not ids:
            raise ValueError(f"prompt {prompt[:40]!r} encodes to no tokens")
        return prompt, ids
    if not isinstance(prompt, (list, tuple)) or not _all_ints(prompt):
        raise ValueError(f"prompt must be a str or a list of int token ids, got {type(prompt).__name__}")
    if not prompt:
        raise ValueError("prompt must not be empty (got no token ids)")
    # min/max run in C: an 8k-token prompt is checked in ~0.2 ms, not the ~1 ms of a Python loop
    if min(prompt) < 0 or max(prompt) >= vocab_size:
        bad = next(i for i, t in enumerate(prompt) if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {prompt[bad]} at index {bad} is outside the vocabulary "
                         f"(allowed: 0..{vocab_size - 1})")
    return None, list(prompt)


def _all_ints(ids: list[int] | tuple[int, ...]) -> bool:
    """Every element an int and none a bool: the common case (all exactly ``int``) in one C-level pass."""
    kinds = set(map(type, ids))
    return kinds <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
