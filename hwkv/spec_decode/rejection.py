"""Exact rejection sampling of draft tokens against the target model (vLLM v1's rejection sampler).

A request with ``k`` draft tokens ``d_1..d_k`` gets ``k + 1`` target logits rows: row ``j`` is the
target's next-token distribution after the verified tokens plus ``d_1..d_j``. Each row is turned
into the distribution ``p_j`` that non-speculative sampling would draw from — the same code
(:func:`hwkv.model.sampler.processed_logits` and :func:`~hwkv.model.sampler.warped_probs`), with
the drafts before the row counted as outputs for penalties and ``min_tokens`` — so the target
distribution is exactly the non-speculative one for every sampling setting.

Random rows: ``d_j`` is accepted with probability ``min(1, p_j(d_j) / q_j(d_j))`` (``q_j``: the
draft's distribution; ``None`` means the proposer picked ``d_j`` deterministically, ``q_j`` one-hot).
At the first rejection the token is drawn from the residual ``max(p_j - q_j, 0)`` (normalised) and
the step ends; when all ``k`` are accepted a bonus token is drawn from ``p_k``. Each emitted token
is then distributed exactly as ``p`` (Leviathan et al. 2023; Chen et al. 2023).

Greedy rows: ``d_j`` is accepted while it equals the argmax of row ``j``; the first mismatch emits
that argmax (the bonus is the argmax of row ``k``) — the non-speculative greedy output.

Everything is batched over requests and positions (no per-token loop) and nothing reads the device
back: the host-side indices go to the device in one copy, and the result is one ``[R, K + 2]`` tensor
(tokens and counts) that the caller reads in one transfer. A seeded request draws its ``k + 1``
uniforms from its own generator, so its output does not depend on the batch.

:func:`greedy_verify` is the fast path of a batch whose requests are all plain greedy (no penalties,
``min_tokens`` or logprobs): ``p_j`` is then one-hot at the argmax of the raw logits, so the caller
reads back one argmax per logits row and the acceptance is a comparison on the host — no
probabilities are built.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hwkv.model.sampler import SamplingBatch, draw, processed_logits, warped_probs


def expand_batch(batch: SamplingBatch, draft_token_ids: list[list[int]]) -> SamplingBatch:
    """One sampling row per target logits row: request ``r``'s row ``j`` has the request's params and
    outputs ``output_token_ids[r] + drafts[r][:j]`` (what it will have generated if ``d_1..d_j`` are
    accepted), so penalties and ``min_tokens`` see exactly what non-speculative sampling would."""
    params, outs, prompts = [], [], []
    for r, drafts in enumerate(draft_token_ids):
        sp, out = batch.params[r], batch.output_token_ids[r]
        # only penalties and a pending min_tokens read the outputs: skip the copies otherwise
        exact = sp.uses_penalties or len(out) < sp.min_tokens
        for j in range(len(drafts) + 1):
            params.append(sp)
            outs.append(out + drafts[:j] if j and exact else out)
            if batch.prompt_token_ids is not None:
                prompts.append(batch.prompt_token_ids[r])
    return SamplingBatch(params, outs, prompts if batch.prompt_token_ids is not None else None, None,
                         batch.generator, batch.eos_token_ids)


def greedy_verify(top: np.ndarray, drafts: np.ndarray, ks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Greedy verification on the host (every request plain greedy): ``top [R, K + 1]`` the target's
    argmax at each position (row ``j`` of request ``r``: after its verified tokens and ``d_1..d_j``;
    columns past ``ks[r]`` are ignored), ``drafts [R, K]`` (columns past ``ks[r]`` ignored). Returns
    ``(tokens [R, K + 1], num [R])`` as :func:`rejection_sample`: the accepted drafts, then the
    target's token at the first mismatch (or the bonus), ``-1`` after."""
    R, K = drafts.shape
    cols = np.arange(K + 1)
    match = (top[:, :K] == drafts) & (cols[:K] < ks[:, None])
    n_acc = np.logical_and.accumulate(match, axis=1).sum(1) if K else np.zeros(R, dtype=np.int64)
    out = np.where(cols[:K] < n_acc[:, None], drafts, -1) if K else np.zeros((R, 0), dtype=np.int64)
    out = np.concatenate([out, np.full((R, 1), -1, dtype=out.dtype)], axis=1)
    rows = np.arange(R)
    out[rows, n_acc] = top[rows, n_acc]
    return out, n_acc + 1


def greedy_accept(top: list[list[int]], drafts: list[Any]) -> list[list[int]]:
    """:func:`greedy_verify` as plain Python per row, for small batches (where a handful of list
    operations per row costs less than numpy's per-call overhead): ``top[r]`` the target's argmax rows of
    request ``r`` (at least ``len(drafts[r]) + 1``), ``drafts[r]`` its drafts. Returns each request's
    emitted tokens: the accepted drafts, then the target's token at the first mismatch (or the bonus)."""
    out = []
    for t, d in zip(top, drafts):
        n = 0
        for a, b in zip(t, d):
            if a != b:
                break
            n += 1
        out.append([*d[:n], t[n]])
    return out


def rejection_sample(logits: torch.Tensor, draft_token_ids: list[list[int]], batch: SamplingBatch,
                     draft_probs: torch.Tensor | None = None, device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of ``R`` requests in one batched pass.

    ``logits``: ``[sum(k_r + 1), V]``, request ``r``'s ``k_r + 1`` rows consecutive, in request order.
    ``draft_token_ids[r]``: its ``k_r`` drafts (may be empty: plain sampling). ``batch``: one row per
    request (params, outputs so far, prompts for repetition penalty, generators). ``draft_probs``:
    ``[sum(k_r), V]`` draft distributions the drafts were sampled from, or ``None`` (deterministic
    proposer: one-hot). ``device``: the backend's :class:`~hwkv.interfaces.device.Device`, to stage
    the host indices without blocking (``None``: a plain copy). Returns ``(tokens [R, K + 1],
    num_tokens [R])`` on the device, views of :func:`verify_packed`'s one tensor: request ``r`` emits
    ``tokens[r, :num_tokens[r]]`` (its accepted drafts, then one recovered or bonus token); the rest
    is ``-1``.
    """
    res = verify_packed(logits, draft_token_ids, batch, draft_probs, device)
    return res[:, :-1], res[:, -1]


def verify_packed(logits: torch.Tensor, draft_token_ids: list[list[int]], batch: SamplingBatch,
                  draft_probs: torch.Tensor | None = None, device: Any = None) -> torch.Tensor:
    """:func:`rejection_sample` as one int64 ``[R, K + 2]`` tensor: columns ``:K + 1`` the tokens, the last
    the count (read back in one transfer). No host synchronisation inside."""
    R = len(draft_token_ids)
    ks = np.fromiter(map(len, draft_token_ids), dtype=np.int64, count=R)
    n_rows = int(ks.sum()) + R
    if len(batch.params) != R or logits.dim() != 2 or logits.shape[0] != n_rows:
        raise ValueError(f"logits {tuple(logits.shape)} must have sum(k + 1) = {n_rows} rows for "
                         f"{R} requests with {ks.tolist()} drafts and {len(batch.params)} params")
    n_drafts = n_rows - R
    if draft_probs is not None and tuple(draft_probs.shape) != (n_drafts, logits.shape[1]):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} must be [{n_drafts}, {logits.shape[1]}]")
    dev, V, K = logits.device, logits.shape[1], int(ks.max(initial=0))
    x = processed_logits(logits, expand_batch(batch, draft_token_ids))

    # Host-side indices, built in numpy and moved in one copy. Padded [R, K + 1] views: the logits row of
    # (request, position) (past k: its last row) and the drafts (-1 where none).
    start = np.cumsum(ks + 1) - (ks + 1)
    pos = np.arange(K + 1)
    rows = start[:, None] + np.minimum(pos, ks[:, None])
    drafts = np.full((R, K), -1, dtype=np.int64)
    if K:
        drafts[pos[:K] < ks[:, None]] = [t for d in draft_token_ids for t in d]
    greedy = np.fromiter((sp.greedy for sp in batch.params), dtype=bool, count=R)
    rand = np.flatnonzero(~greedy)
    rand_rows = rows[rand][pos <= ks[rand, None]]  # every logits row of every random request
    parts = [rows, drafts, ks, start, greedy.astype(np.int64), rand, rand_rows]
    flat = np.concatenate([a.ravel() for a in parts]).astype(np.int64, copy=False)
    t = torch.from_numpy(flat)
    t = device.to_device(t) if device is not None else t.to(dev)
    views, off = [], 0
    for a in parts:
        views.append(t[off : off + a.size].view(a.shape))
        off += a.size
    rows_t, drafts_t, k_t, start_t, greedy_t, rand_t, rand_rows_t = views
    has = drafts_t >= 0  # [R, K]
    safe = drafts_t.clamp(min=0)

    top = x.argmax(-1)  # greedy rows' answer at every position
    accept = greedy_t.bool().unsqueeze(1) & has & (top[rows_t[:, :K]] == drafts_t)
    if len(rand):
        # p for every row of every random request (greedy requests' rows stay zero)
        row_params = [batch.params[r] for r in rand for _ in range(ks[r] + 1)]
        p = torch.zeros((n_rows, V), dtype=torch.float32, device=dev)
        p[rand_rows_t] = warped_probs(x.index_select(0, rand_rows_t), row_params)
        u = _uniforms(rand.tolist(), ks.tolist(), K, batch, dev)  # [len(rand), K + 1]
        sub_rows, sub_safe, sub_has = rows_t[rand_t], safe[rand_t], has[rand_t]
        p_d = p[sub_rows[:, :K], sub_safe] if K else p.new_zeros((len(rand), 0))
        if draft_probs is None:
            q_d = torch.ones_like(p_d)
        else:
            # draft row = target row - r (request r owns one target row more than drafts)
            q_row = sub_rows[:, :K] - rand_t.unsqueeze(1)
            q_d = draft_probs[q_row.clamp(max=max(n_drafts - 1, 0)), sub_safe].float()
        accept[rand_t] = sub_has & (u[:, :K] * q_d < p_d)
    n_acc = torch.cumprod(accept.long(), dim=1).sum(1) if K else torch.zeros(R, dtype=torch.long, device=dev)
    final_rows = start_t + n_acc  # the row whose distribution the last emitted token comes from
    final = top[final_rows]
    if len(rand):
        a = n_acc[rand_t]
        fr = final_rows[rand_t]
        dist = p[fr]
        if K:  # a request that rejected a draft draws from the residual (no host check: computed for all)
            rejected = a < k_t[rand_t]
            if draft_probs is None:
                q_last = torch.zeros_like(dist)
                q_last.scatter_(1, sub_safe.gather(1, a.clamp(max=K - 1).unsqueeze(1)), 1.0)
            else:
                q_last = draft_probs[(fr - rand_t).clamp(max=max(n_drafts - 1, 0))].float()
            resid = (dist - q_last).clamp_(min=0)
            # p == q leaves nothing (rejection then has probability 0; guard float noise): draw from p
            empty = resid.sum(-1, keepdim=True) <= 0
            resid = torch.where(empty, dist, resid)
            dist = torch.where(rejected.unsqueeze(1), resid, dist)
        final[rand_t] = draw(dist, u.gather(1, k_t[rand_t].unsqueeze(1)).squeeze(1))
    out = torch.full((R, K + 2), -1, dtype=torch.long, device=dev)
    if K:
        out[:, :K] = torch.where(torch.arange(K, device=dev) < n_acc.unsqueeze(1), drafts_t, out[:, :K])
    out.scatter_(1, n_acc.unsqueeze(1), final.unsqueeze(1))
    out[:, K + 1] = n_acc + 1
    return out


def _uniforms(rand: list[int], ks: list[int], K: int, batch: SamplingBatch, dev: torch.device) -> torch.Tensor:
    """``[len(rand), K + 1]`` U[0, 1): acceptance tests in columns ``< k``, the final draw in column ``k``.
    A seeded request draws exactly ``k + 1`` numbers from its own generator."""
    gens = batch.generators or [None] * len(batch.params)
    u = torch.rand((len(rand), K + 1), generator=batch.generator, device=dev)
    for j, r in enumerate(rand):
        if gens[r] is not None:
            u[j, : ks[r] + 1] = torch.rand(ks[r] + 1, generator=gens[r], device=dev)
    return u
