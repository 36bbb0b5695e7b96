"""Sampler: logits ``[R, V]`` → one token per row, with vLLM semantics.

Order (as vLLM v1): min_tokens suppression → penalties (repetition over prompt + output,
frequency/presence over output) → greedy argmax, or temperature → min-p → top-k → top-p → draw.

Draws are inverse-CDF with one uniform per row, an exact draw from ``p``. A seeded request draws
its uniform from its own ``torch.Generator`` and every row is processed independently, so its
tokens do not depend on which other requests share the batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hwkv.sampling_params import SamplingParams


def make_generator(seed: int, device: torch.device | str = "cpu") -> torch.Generator:
    """A request's private generator; create it once per request and pass it every step."""
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class SamplingBatch:
    """Per-row inputs of one :func:`sample` call (row ``i`` ↔ logits row ``i``).

    ``generators[i]`` is row ``i``'s private generator (seeded requests) or ``None`` to draw from
    the shared ``generator`` (``None``: torch's default). ``prompt_token_ids`` is needed only when
    a row uses ``repetition_penalty``. ``eos_token_ids`` are suppressed (unless ``ignore_eos``),
    together with ``stop_token_ids``, while a row has fewer than ``min_tokens`` outputs.
    """

    params: list[SamplingParams]
    output_token_ids: list[list[int]]
    prompt_token_ids: list[list[int]] | None = None
    generators: list[torch.Generator | None] | None = None
    generator: torch.Generator | None = None
    eos_token_ids: Sequence[int] = field(default_factory=tuple)
    # the caller vouches every row is greedy with no penalties, min_tokens or logprobs: the tokens
    # are the argmax (a large batch skips a pass over its params per check)
    plain: bool = False
    # structured outputs: packed allowed-token bits [R, ceil(V / 32)] int32 on the logits' device
    bitmask: torch.Tensor | None = None
    # the non-greedy rows' U[0, 1) draws, if made already (:func:`draw_uniforms`; None: drawn in sampling)
    uniforms: torch.Tensor | None = None


@dataclass
class SamplerOutput:
    """``token_ids[i]`` for row ``i``; ``logprobs[i]`` is ``{token: logprob}`` (top-n in descending
    order, then the sampled token if not among them) for rows that asked, else ``None``."""

    token_ids: list[int]
    logprobs: list[dict[int, float] | None] | None = None


def _flat_keys(ids: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """``row * vocab + token`` for every token of every row (one tensor, no per-row launch)."""
    lens = torch.tensor([len(r) for r in ids], dtype=torch.long)
    rows = torch.repeat_interleave(torch.arange(len(ids)), lens)
    flat = torch.tensor([t for r in ids for t in r], dtype=torch.long)
    return (rows * vocab + flat).to(device)


def apply_penalties(
    logits: torch.Tensor, prompt_ids: list[list[int]] | None, output_ids: list[list[int]],
    repetition: torch.Tensor, frequency: torch.Tensor, presence: torch.Tensor,
) -> torch.Tensor:
    """vLLM penalties on contiguous float32 ``logits [R, V]`` (modified in place and returned).

    Only (row, token) pairs that occur are touched, so the cost scales with the number of prompt
    and output tokens, not with ``R × V``.
    """
    vocab = logits.shape[1]
    flat = logits.view(-1)
    # sort + unique_consecutive: torch.unique(return_counts=True) takes a much slower path on CPU
    out_keys, out_counts = _flat_keys(output_ids, vocab, logits.device).sort().values.unique_consecutive(
        return_counts=True)
    if bool((repetition != 1.0).any()):
        seen = out_keys
        if prompt_ids is not None:
            seen = torch.cat([out_keys, _flat_keys(prompt_ids, vocab, logits.device)]).unique()
        vals, pen = flat[seen], repetition[seen // vocab]
        flat[seen] = torch.where(vals > 0, vals / pen, vals * pen)
    rows = out_keys // vocab
    flat[out_keys] -= frequency[rows] * out_counts + presence[rows]
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below ``min_p`` × the row's top probability."""
    probs = logits.softmax(-1)
    thresh = probs.amax(-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < thresh, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's ``k`` largest logits (``k >= V``: all), then its smallest set of tokens with
    cumulative probability ``>= p`` (the top token always survives); the rest become ``-inf``."""
    vocab = logits.shape[1]
    max_k = int(k.max()) if k is not None else vocab
    if max_k <= vocab // 8:
        # Every row is k-limited to a few tokens: work on the top-max_k candidates (no full sort).
        assert k is not None
        vals, idx = logits.topk(max_k, dim=-1)
        vals = vals.masked_fill(torch.arange(max_k, device=logits.device) >= k.unsqueeze(1), float("-inf"))
        if p is not None:
            probs = vals.softmax(-1)
            above = probs.cumsum(-1) - probs  # probability mass ranked above each token
            vals = vals.masked_fill(above >= p.unsqueeze(1), float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(-1, idx, vals)
    srt, idx = logits.sort(dim=-1, descending=False)
    if k is not None:
        kth = srt.gather(1, (vocab - k).clamp(min=0).unsqueeze(1))
        srt = srt.masked_fill(srt < kth, float("-inf"))
    if p is not None:
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum <= (1 - p).unsqueeze(1)
        drop[:, -1] = False
        srt = srt.masked_fill(drop, float("-inf"))
    return srt.scatter(-1, idx, srt)


def draw_uniforms(batch: SamplingBatch, device: torch.device) -> torch.Tensor | None:
    """The U[0, 1) draws :func:`sample_tokens` would make for ``batch``'s non-greedy rows, made now
    (``None`` if every row is greedy): the same generators in the same order, so the tokens do not
    change. A caller launches them before waiting for something the draws do not depend on (a
    structured-output mask: a seeded batch's per-row draws are a launch or two per row)."""
    rand = [i for i, sp in enumerate(batch.params) if not sp.greedy]
    return _uniforms(rand, batch, device) if rand else None


def _uniforms(rows: list[int], batch: SamplingBatch, device: torch.device) -> torch.Tensor:
    """One U[0, 1) per row: from the row's own generator, else from the shared one."""
    gens = batch.generators or [None] * len(batch.params)
    u = torch.rand(len(rows), generator=batch.generator, device=device)
    for j, r in enumerate(rows):
        if gens[r] is not None:
            u[j] = torch.rand((), generator=gens[r], device=device)
    return u


def draw(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw of one token per row of ``probs [n, V]`` from ``u [n]`` ~ U[0, 1).

    Token ``i`` owns the interval ``(cdf[i-1], cdf[i]]`` of length ``p_i``, so zero-probability
    tokens own nothing; scaling by the row total absorbs float rounding in the cumsum. One random
    number per row (not one per vocab entry) keeps seeded draws cheap on every device.
    """
    cdf = probs.cumsum(-1)
    x = (u * cdf[:, -1]).clamp_(min=torch.finfo(torch.float32).tiny)
    return torch.searchsorted(cdf, x.unsqueeze(1)).squeeze(1).clamp_(max=probs.shape[1] - 1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits [R, V]`` with ``-inf`` where ``bitmask [R, ceil(V / 32)]`` (int32; bit ``j`` of word
    ``w`` = token ``32 w + j``) has a 0. Plain tensor ops on the device: no host sync, no vendor
    kernel, capturable in a graph once the first call made the device's constants; out of place
    (logprobs keep the model's distribution).

    The words are read as bytes (little-endian, as every device hwkv runs on: byte ``k`` of a word
    holds its bits ``8k .. 8k + 7``) and spread by eight shifts into a ``uint8 [R, 32 W]`` mask, one
    select. One path for every device: a byte-to-addends table's gather cost 251 us at [64, 49152]
    on an H200 (19x an argmax of the same logits: ``bench/results/structured-*-H200-*``), and 32
    shifts of the int32 words write four times the bytes of this and ran 2x slower than the table on
    a CPU; the byte shifts are on a par with the table there."""
    shifts = _SHIFTS.get(logits.device)
    if shifts is None:
        shifts = _SHIFTS[logits.device] = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((bitmask.view(torch.uint8).unsqueeze(-1) >> shifts) & 1).view(bitmask.shape[0], -1)
    return torch.where(allowed[:, : logits.shape[1]].bool(), logits, float("-inf"))


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _suppress_stops(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    rows: list[int] = []
    cols: list[int] = []
    for i, (sp, out) in enumerate(zip(batch.params, batch.output_token_ids)):
        if len(out) < sp.min_tokens:
            ids = set(sp.stop_token_ids or ()) | (set() if sp.ignore_eos else set(batch.eos_token_ids))
            rows += [i] * len(ids)
            cols += sorted(ids)
    if rows:
        logits[torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device)] = float("-inf")
    return logits


def logprobs_of(raw: torch.Tensor, tokens: torch.Tensor, params: list[SamplingParams]) -> list[dict[int, float] | None]:
    lp = raw.float().log_softmax(-1)
    n = max(sp.logprobs or 0 for sp in params)
    top_v, top_i = lp.topk(n, dim=-1) if n else (lp[:, :0], lp[:, :0].long())
    chosen = lp.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
    top_v, top_i, toks = top_v.tolist(), top_i.tolist(), tokens.tolist()
    out: list[dict[int, float] | None] = []
    for i, sp in enumerate(params):
        if sp.logprobs is None:
            out.append(None)
            continue
        d = dict(zip(top_i[i][: sp.logprobs], top_v[i][: sp.logprobs]))
        d.setdefault(toks[i], chosen[i])
        out.append(d)
    return out


def sample(logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
    """One token per row of float32 ``logits [R, V]`` following ``batch.params``."""
    tokens, logprobs = sample_tokens(logits, batch)
    return SamplerOutput(token_ids=tokens.tolist(), logprobs=logprobs)


Logprobs = list[dict[int, float] | None]


ARGMAX_CHUNKS = 1024  # most chunks argmax_rows splits a row into (0: the plain argmax everywhere)


def _chunks(v: int) -> int:
    """The most chunks (at most ARGMAX_CHUNKS, each at least 128 wide) that split a row of ``v`` evenly; 0 if none
    (>= 64)."""
    return next((c for c in range(min(ARGMAX_CHUNKS, v // 128), 63, -1) if v % c == 0), 0)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` of ``[R, V]`` logits, over chunks of each row first (ARGMAX_CHUNKS = 0: not): torch
    reduces a row in one thread block, so the argmax of one row of 128,256 logits took 37 us on an H200 (one SM;
    batch-1 decode, bench/results/issue36-b1-batch1b-H200-2026-11-29-312154c.md) - as long as two decoder layers.
    The max of each chunk (first occurrence, NaN as the maximum, as argmax), then the argmax over the chunk maxima:
    the same index as ``x.argmax(-1)``, in four small launches that spread over the SMs (~12 us on the H200 in
    batch 2 with one launch more)."""
    r, v = x.shape
    c = _chunks(v) if x.is_contiguous() else 0
    if not c:
        return x.argmax(-1)
    vals, idx = x.view(r, c, v // c).max(-1)
    best = vals.argmax(-1, keepdim=True)
    return idx.gather(1, best).add_(best, alpha=v // c).squeeze(1)  # the chunk's offset added in place


def sample_tokens(logits: torch.Tensor, batch: SamplingBatch, argmax: Callable[[torch.Tensor], torch.Tensor | None]
                  | None = None) -> tuple[torch.Tensor, Logprobs | None]:
    """:func:`sample` leaving the tokens on the device (int64 ``[R]``): no host sync unless a row
    asks for logprobs (those are returned as host dicts). ``argmax``: a backend's argmax of float32 logits
    (:meth:`hwkv.interfaces.decode_ops.DecodeOps.argmax`) for a batch of plain greedy rows; ``None`` from it, or
    none given: :func:`argmax_rows`."""
    if batch.plain:
        if batch.bitmask is not None:
            logits = apply_token_bitmask(logits, batch.bitmask)
        x = logits.float()
        tokens = argmax(x) if argmax is not None else None
        return (tokens if tokens is not None else argmax_rows(x)), None
    params = batch.params
    x = processed_logits(logits, batch)
    rand = [i for i, sp in enumerate(params) if not sp.greedy]
    if len(rand) < len(params):
        tokens = x.argmax(-1)
    if rand:
        rows = torch.tensor(rand, device=x.device)
        sub = x if len(rand) == len(params) else x.index_select(0, rows)
        u = batch.uniforms if batch.uniforms is not None else _uniforms(rand, batch, x.device)
        drawn = draw(warped_probs(sub, [params[i] for i in rand]), u)
        tokens = drawn if len(rand) == len(params) else tokens.index_copy(0, rows, drawn)
    logprobs = logprobs_of(logits, tokens, params) if any(sp.logprobs is not None for sp in params) else None
    return tokens, logprobs


def processed_logits(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """float32 ``logits [R, V]`` after min_tokens suppression and penalties: the greedy rows' argmax
    input and the input of :func:`warped_probs` (speculative verification shares both)."""
    params = batch.params
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(batch.output_token_ids) != len(params):
        raise ValueError(f"logits {tuple(logits.shape)} do not match {len(params)} params / output lists")
    dev, raw = logits.device, logits
    x = logits.float().contiguous()
    if any(len(o) < sp.min_tokens for sp, o in zip(params, batch.output_token_ids)):
        x = _suppress_stops(x.clone(), batch)
    if any(sp.logit_bias for sp in params):
        rows = [i for i, sp in enumerate(params) for _ in (sp.logit_bias or ())]
        cols = [t for sp in params for t in (sp.logit_bias or ())]
        bias = [b for sp in params for b in (sp.logit_bias or {}).values()]
        x = x.clone() if x is raw else x
        x[torch.tensor(rows, device=dev), torch.tensor(cols, device=dev)] += torch.tensor(bias, device=dev)
    if batch.bitmask is not None:
        x = apply_token_bitmask(x, batch.bitmask)
    if any(sp.uses_penalties for sp in params):
        f32 = lambda vals: torch.tensor(vals, dtype=torch.float32, device=dev)
        x = apply_penalties(
            x.clone() if x is raw else x, batch.prompt_token_ids, batch.output_token_ids,
            f32([sp.repetition_penalty for sp in params]), f32([sp.frequency_penalty for sp in params]),
            f32([sp.presence_penalty for sp in params]),
        )
    return x


def warped_probs(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a non-greedy row draws from: processed logits ``x [n, V]`` → temperature →
    min-p → top-k → top-p → softmax (row ``i`` follows ``params[i]``)."""
    dev, vocab = x.device, x.shape[1]
    temps = torch.tensor([sp.temperature for sp in params], device=dev).unsqueeze(1)
    sub = x / temps
    if any(sp.min_p > 0 for sp in params):
        sub = apply_min_p(sub, torch.tensor([sp.min_p for sp in params], device=dev))
    use_k = any(sp.top_k > 0 for sp in params)
    use_p = any(sp.top_p < 1.0 for sp in params)
    if use_k or use_p:
        k = torch.tensor([sp.top_k if sp.top_k > 0 else vocab for sp in params], device=dev) if use_k else None
        p = torch.tensor([sp.top_p for sp in params], dtype=torch.float32, device=dev) if use_p else None
        sub = apply_top_k_top_p(sub, k, p)
    return sub.softmax(-1)
