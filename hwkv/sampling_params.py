"""SamplingParams: per-request decoding settings with vLLM names and semantics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Below this a temperature means greedy (as vLLM): dividing by it would overflow.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
# What torch.Generator.manual_seed accepts (a negative seed is taken modulo 2**64).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


@dataclass
class SamplingParams:
    """Decoding settings of one request. Construction validates (``ValueError`` naming the field).

    * ``temperature`` 0 (or < 1e-5) is greedy; penalties still apply before the argmax.
    * ``top_k`` -1 or 0 disables; ``top_p`` 1.0 and ``min_p`` 0.0 disable.
    * ``repetition_penalty`` (1.0 = off) scales logits of tokens in prompt + output;
      ``frequency_penalty``/``presence_penalty`` subtract per output-token count / occurrence.
    * ``seed`` (an integer in ``[-2**63, 2**64 - 1]``) makes this request's draws reproducible
      regardless of the batch it runs in.
    * ``stop`` strings are not included in the output text (``include_stop_str_in_output``: they
      are); ``stop_token_ids`` end like EOS.
    * ``logprobs`` n returns the top-n log-probabilities (of the unmodified model distribution) plus
      the sampled token's; ``None`` returns none.
    * ``prompt_logprobs`` n returns, for every prompt token after the first, its log-probability and
      rank given the tokens before it plus the top-n there (vLLM's semantics; the first entry is
      ``None``). Such a request reads no prefix-cache or connector hits: every prompt token is computed.
    * ``min_tokens`` suppresses EOS / stop token ids until that many tokens were generated.
    * ``cache_salt`` isolates this request's prefix-cache blocks: requests share cached blocks only
      with requests of the same salt (per-tenant isolation).
    * ``logit_bias`` ``{token id: bias}`` (bias in [-100, 100]) is added to those logits before
      penalties (OpenAI's semantics; -100 bans a token).
    * ``structured_outputs`` constrains the output by a grammar, vLLM's keys: one of ``json`` (a JSON
      schema), ``json_object``, ``regex``, ``choice``, ``grammar`` (:mod:`hwkv.engine.structured`).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    cache_salt: str | None = None
    n: int = 1
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # handed to the KV connector as is (as vLLM's)
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``ValueError`` naming the first invalid field, its value and the allowed range.
        With ``vocab_size``, token ids in ``stop_token_ids`` must also lie in ``[0, vocab_size)``."""

        def bad(name: str, allowed: str) -> None:
            raise ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN

        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            bad("kv_transfer_params", "a dict or None")
        if self.n != 1:
            bad("n", "1 (parallel sampling is not supported)")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            bad("max_tokens", "an integer >= 1")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]")
        if not is_num(self.temperature) or self.temperature < 0 or self.temperature == float("inf"):
            bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            bad("top_k", "-1 or 0 (disabled) or an integer >= 1")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            bad("repetition_penalty", "> 0 (1.0 = off)")
        for name in ("frequency_penalty", "presence_penalty"):
            if not is_num(getattr(self, name)) or not -2 <= getattr(self, name) <= 2:
                bad(name, "in [-2, 2] (0 = off)")
        if self.seed is not None and (not is_int(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX):
            bad("seed", f"None or an integer in [{SEED_MIN}, {SEED_MAX}]")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and (not is_int(self.prompt_logprobs)
                                                 or not 0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            bad("prompt_logprobs", f"None or an integer in [0, {MAX_LOGPROBS}]")
        if not all(isinstance(s, str) and s for s in self.stop):  # type: ignore[union-attr]
            bad("stop", "a non-empty string or a list of non-empty strings")
        hi = vocab_size if vocab_size is not None else float("inf")
        if self.logit_bias is not None and (
                not isinstance(self.logit_bias, dict)
                or not all(is_int(t) and 0 <= t < hi and is_num(b) and -100 <= b <= 100
                           for t, b in self.logit_bias.items())):
            bad("logit_bias", f"a dict of token id in [0, {vocab_size if vocab_size is not None else 'vocab'}) "
                "-> bias in [-100, 100]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, dict):
            bad("structured_outputs", "None or a dict with one of json, json_object, regex, choice, grammar")
        if not all(is_int(t) and 0 <= t < hi for t in self.stop_token_ids):  # type: ignore[union-attr]
            bad("stop_token_ids", f"a list of token ids in [0, {vocab_size if vocab_size is not None else 'vocab'})")
