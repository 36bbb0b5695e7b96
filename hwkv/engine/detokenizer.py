"""Incremental detokenization with a prefix-offset window, and stop-string matching.

Decoding only the new token would break multi-byte characters (a UTF-8 character split over
byte-fallback tokens) and word-boundary spaces (SentencePiece ``▁``). So each step decodes a small
window ``ids[prefix:]`` and subtracts the decode of ``ids[prefix:read]`` (the part already
emitted); while the tail decodes to U+FFFD (an incomplete character) nothing is emitted. The
window starts a few prompt tokens back so the first output token gets its leading space right.
"""

from __future__ import annotations

from typing import Any

_INITIAL_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str] | None = None,
                 skip_special_tokens: bool = True, include_stop: bool = False):
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_INITIAL_WINDOW:])
        self.prefix = 0
        self.read = len(self.ids)
        self.text = ""
        self.stop = [s for s in (stop or []) if s]
        self.skip_special = skip_special_tokens
        self.include_stop = include_stop  # the text ends after the stop string instead of before it
        # the tail a stop string could still claim (streamed text only ever grows)
        self.hold = max((len(s) for s in self.stop), default=1) - 1

    @property
    def stable_text(self) -> str:
        """Text that can no longer change: without the tail a stop string could still claim, so
        streamed text only ever grows."""
        hold = self.hold
        return self.text[: len(self.text) - hold] if hold else self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special) if ids else ""

    def add_tokens(self, token_ids: list[int], check_stop: bool = True) -> str | None:
        """Append tokens; return the matched stop string (text is then truncated before it) or None."""
        if self.tokenizer is None:
            return None
        start = len(self.text)
        for tok in token_ids:
            self.ids.append(tok)
            prefix_text = self._decode(self.ids[self.prefix : self.read])
            full = self._decode(self.ids[self.prefix :])
            if len(full) > len(prefix_text) and not full.endswith("\ufffd"):
                self.text += full[len(prefix_text) :]
                self.prefix, self.read = self.read, len(self.ids)
        if not check_stop or not self.stop or len(self.text) == start:
            return None
        return self._match_stop(start)

    def _match_stop(self, start: int) -> str | None:
        # A stop string may straddle old and new text: search from len(stop)-1 chars before.
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, max(0, start - len(s) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        self.text = self.text[: best[0] + (len(best[1]) if self.include_stop else 0)]
        return best[1]
