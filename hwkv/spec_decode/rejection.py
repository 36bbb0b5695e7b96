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

Everything is batched over requests and positions (no per-token loop); a seeded request draws its
``k + 1`` uniforms from its own generator, so its output does not depend on the batch.
"""

from __future__ import annotations

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


def rejection_sample(logits: torch.Tensor, draft_token_ids: list[list[int]], batch: SamplingBatch,
                     draft_probs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify the drafts of ``R`` requests in one batched pass.

    ``logits``: ``[sum(k_r + 1), V]``, request ``r``'s ``k_r + 1`` rows consecutive, in request order.
    ``draft_token_ids[r]``: its ``k_r`` drafts (may be empty: plain sampling). ``batch``: one row per
    request (params, outputs so far, prompts for repetition penalty, generators). ``draft_probs``:
    ``[sum(k_r), V]`` draft distributions the drafts were sampled from, or ``None`` (deterministic
    proposer: one-hot). Returns ``(tokens [R, K + 1], num_tokens [R])`` on the device: request ``r``
    emits ``tokens[r, :num_tokens[r]]`` (its accepted drafts, then one recovered or bonus token);
    the rest is ``-1``.
    """
    R = len(draft_token_ids)
    ks = [len(d) for d in draft_token_ids]
    n_rows = sum(ks) + R
    if len(batch.params) != R or logits.dim() != 2 or logits.shape[0] != n_rows:
        raise ValueError(f"logits {tuple(logits.shape)} must have sum(k + 1) = {n_rows} rows for "
                         f"{R} requests with {ks} drafts and {len(batch.params)} params")
    if draft_probs is not None and tuple(draft_probs.shape) != (sum(ks), logits.shape[1]):
        raise ValueError(f"draft_probs {tuple(draft_probs.shape)} must be [{sum(ks)}, {logits.shape[1]}]")
    dev, V, K = logits.device, logits.shape[1], max(ks, default=0)
    x = processed_logits(logits, expand_batch(batch, draft_token_ids))

    # Padded [R, K + 1] views: row index of (request, position) and the drafts (-1 where none).
    k_t = torch.tensor(ks, dtype=torch.long, device=dev)
    start = torch.cumsum(k_t + 1, 0) - (k_t + 1)
    pos = torch.arange(K + 1, device=dev)
    valid = pos.unsqueeze(0) <= k_t.unsqueeze(1)  # [R, K + 1]
    rows = torch.where(valid, start.unsqueeze(1) + pos, start.unsqueeze(1) + k_t.unsqueeze(1))
    drafts = torch.full((R, K), -1, dtype=torch.long, device=dev)
    if K:
        flat = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long, device=dev)
        drafts[pos[:K].unsqueeze(0) < k_t.unsqueeze(1)] = flat
    has = drafts >= 0  # [R, K]
    safe = drafts.clamp(min=0)

    greedy = torch.tensor([sp.greedy for sp in batch.params], dtype=torch.bool, device=dev)
    accept = torch.zeros((R, K), dtype=torch.bool, device=dev)
    top = x.argmax(-1)  # greedy rows' answer at every position
    if bool(greedy.any()):
        accept = greedy.unsqueeze(1) & has & (top[rows[:, :K]] == drafts)
    rand = [r for r, sp in enumerate(batch.params) if not sp.greedy]
    if rand:
        rand_t = torch.tensor(rand, device=dev)
        # p for every row of every random request (greedy requests' rows stay zero); rows on the host
        rand_rows = [start_r + j for r, start_r in zip(rand, _starts(ks, rand)) for j in range(ks[r] + 1)]
        row_params = [batch.params[r] for r in rand for _ in range(ks[r] + 1)]
        idx = torch.tensor(rand_rows, dtype=torch.long, device=dev)
        p = torch.zeros((n_rows, V), dtype=torch.float32, device=dev)
        p[idx] = warped_probs(x.index_select(0, idx), row_params)
        u = _uniforms(rand, ks, K, batch, dev)  # [len(rand), K + 1]
        sub_rows, sub_safe, sub_has = rows[rand_t], safe[rand_t], has[rand_t]
        p_d = p[sub_rows[:, :K], sub_safe] if K else p.new_zeros((len(rand), 0))
        if draft_probs is None:
            q_d = torch.ones_like(p_d)
        else:
            q_row = sub_rows[:, :K] - torch.arange(R, device=dev)[rand_t].unsqueeze(1)  # draft row = target row - r
            q_d = draft_probs[q_row.clamp(max=max(sum(ks) - 1, 0)), sub_safe].float()
        ok = sub_has & (u[:, :K] * q_d < p_d)
        accept[rand_t] = ok
    n_acc = torch.cumprod(accept.long(), dim=1).sum(1) if K else torch.zeros(R, dtype=torch.long, device=dev)
    final_rows = start + n_acc  # the row whose distribution the last emitted token comes from
    final = top[final_rows]
    if rand:
        a = n_acc[rand_t]
        fr = final_rows[rand_t]
        dist = p[fr]
        rejected = a < k_t[rand_t]
        if bool(rejected.any()):
            if draft_probs is None:
                q_last = torch.zeros_like(dist)
                d_at = sub_safe.gather(1, a.clamp(max=max(K - 1, 0)).unsqueeze(1)) if K else None
                q_last.scatter_(1, d_at, 1.0)
            else:
                q_idx = (fr - torch.arange(R, device=dev)[rand_t]).clamp(max=max(sum(ks) - 1, 0))
                q_last = draft_probs[q_idx].float()
            resid = (dist - q_last).clamp_(min=0)
            # p == q leaves nothing (rejection then has probability 0; guard float noise): draw from p
            empty = resid.sum(-1, keepdim=True) <= 0
            resid = torch.where(empty, dist, resid)
            dist = torch.where(rejected.unsqueeze(1), resid, dist)
        final[rand_t] = draw(dist, u.gather(1, k_t[rand_t].unsqueeze(1)).squeeze(1))
    out = torch.full((R, K + 1), -1, dtype=torch.long, device=dev)
    if K:
        out[:, :K] = torch.where(pos[:K].unsqueeze(0) < n_acc.unsqueeze(1), drafts, out[:, :K])
    out.scatter_(1, n_acc.unsqueeze(1), final.unsqueeze(1))
    return out, n_acc + 1


def _starts(ks: list[int], rows: list[int]) -> list[int]:
    """First logits row of each request in ``rows`` (request ``r`` owns ``ks[r] + 1`` rows)."""
    first = [0]
    for k in ks:
        first.append(first[-1] + k + 1)
    return [first[r] for r in rows]


def _uniforms(rand: list[int], ks: list[int], K: int, batch: SamplingBatch, dev: torch.device) -> torch.Tensor:
    """``[len(rand), K + 1]`` U[0, 1): acceptance tests in columns ``< k``, the final draw in column ``k``.
    A seeded request draws exactly ``k + 1`` numbers from its own generator."""
    gens = batch.generators or [None] * len(batch.params)
    u = torch.rand((len(rand), K + 1), generator=batch.generator, device=dev)
    for j, r in enumerate(rand):
        if gens[r] is not None:
            u[j, : ks[r] + 1] = torch.rand(ks[r] + 1, generator=gens[r], device=dev)
    return u
