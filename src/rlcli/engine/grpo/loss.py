"""GRPO's loss as pure tensor functions: the policy's token log-probs (chunked over the vocabulary), the
clipped policy loss and its options, and the check that stops a non-finite update.

The update (grpo/update.py) owns models, batching and optimizers; everything here is a function of
tensors, so each option can be checked against hand-computed numbers (tests/unit/test_grpo_math.py).
Positions where the mask is 0 may hold any value (padding, stale logprobs, even inf): they are replaced
before any exp() so they can never turn the loss or its gradient into NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from rlcli.errors import RlcliError


def chunked_token_logprobs(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    token_ids: torch.Tensor,
    *,
    chunk_size: int,
    temperature: float = 1.0,
    entropy: bool = False,
    unwritable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(head(hidden) / temperature)[token_ids] for [N, H] hidden states and [N] ids, and, if asked,
    the entropy in nats of each position's distribution (detached: it is a statistic, not a loss term).
    unwritable: token ids outside the policy's distribution (logit -inf), as the samplers leave them out
    (a vision-language model's image slots, vision.slot_token_ids).

    Only `chunk_size` positions' logits ([chunk_size, V] in float32) exist at any time, in the forward and in
    the backward: with autograd on, each chunk runs under activation checkpointing, which keeps the chunk's
    hidden states and recomputes its logits when the gradient reaches it. So a 150k-token vocabulary costs
    one chunk's logits, not every position's. In float32 at least (bf16 logits are upcast), as TRL's
    selective_log_softmax: gathered logit minus the row's logsumexp. Tokens with probability 0 (logit -inf)
    add 0 to the entropy, not NaN.
    """
    from torch.utils.checkpoint import checkpoint

    logps, entropies = [], []
    for h, ids in zip(hidden.split(chunk_size), token_ids.split(chunk_size)):
        if torch.is_grad_enabled():
            logp, ent = checkpoint(_chunk_logprobs, h, ids, head, temperature, entropy, unwritable, use_reentrant=False)
        else:
            logp, ent = _chunk_logprobs(h, ids, head, temperature, entropy, unwritable)
        logps.append(logp)
        entropies.append(ent)
    empty = hidden.new_zeros((0,), dtype=torch.float32)
    logp = torch.cat(logps) if logps else empty
    return logp, ((torch.cat(entropies) if entropies else empty) if entropy else None)


def _chunk_logprobs(
    hidden: torch.Tensor,
    token_ids: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    temperature: float,
    entropy: bool,
    unwritable: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    logits = head(hidden)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    if unwritable is not None:
        logits = logits.index_fill(-1, unwritable, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1) - lse
    ent = None
    if entropy:
        with torch.no_grad():
            # sum of -p log p (entr is 0 at p = 0), not lse - sum p z: no cancellation at large logits.
            # In place where possible: a chunk's [positions, vocab] temporaries are the update's peak.
            ent = torch.special.entr((logits - lse.unsqueeze(-1)).exp_()).sum(-1)
    return logp, ent


def check_finite(name: str, tensor: torch.Tensor) -> None:
    """Stop an update before a NaN/inf reaches the weights (a bad step would silently ruin the run)."""
    bad = int((~torch.isfinite(tensor.detach())).sum())
    if bad:
        raise RlcliError(
            f"Non-finite values: {name} is NaN/inf in {bad} of {tensor.numel()} entries; "
            "the update was stopped before the optimizer step."
        )


def _top_entropy_mask(entropy: torch.Tensor, live: torch.Tensor, frac: float) -> torch.Tensor:
    """The ceil(frac * n) highest-entropy masked tokens of the batch (at least one); ties at the cut are kept."""
    values = entropy.detach()[live]
    if values.numel() == 0:
        return live
    # The small slack keeps float products such as 0.7 * 10 = 7.000000000000001 from rounding up a token.
    k = max(1, math.ceil(frac * values.numel() - 1e-9))
    cut = values.topk(k).values[-1]
    return live & (entropy.detach() >= cut)


def _aggregate(tok: torch.Tensor, m: torch.Tensor, aggregation: str, max_len_norm: int | None) -> torch.Tensor:
    """Batch loss from masked per-token losses; all-zero-mask rows count in no denominator."""
    per_seq_tokens = m.sum(-1)
    seqs = (per_seq_tokens > 0).sum().clamp(min=1)
    if aggregation == "token_mean":
        return tok.sum() / m.sum().clamp(min=1)
    if aggregation == "seq_mean":
        return (tok.sum(-1) / per_seq_tokens.clamp(min=1)).sum() / seqs
    if aggregation == "seq_mean_token_sum_norm":
        return tok.sum() / (seqs * (max_len_norm or tok.shape[-1]))
    raise ValueError(f"unknown aggregation {aggregation!r}; expected token_mean, seq_mean or seq_mean_token_sum_norm")


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    importance: str = "token",
    aggregation: str = "token_mean",
    ref_logprobs: torch.Tensor | None = None,
    beta: float = 0.0,
    rollout_logprobs: torch.Tensor | None = None,
    tis_cap: float | None = None,
    entropy: torch.Tensor | None = None,
    entropy_top_frac: float | None = None,
    entropy_coef: float = 0.0,
    max_len_norm: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate loss over [B, T] token log-probs; mask is 1 on trainable tokens only.

    Per token: -min(r * A, clip(r, 1 - clip_low, 1 + clip_high) * A), where r is the token ratio
    pi/pi_old (importance="token") or GSPO's sequence ratio s_i = exp(mean_t(logp - old)) in its token form
    sg[s_i] * exp(logp_t - sg[logp_t]) (importance="sequence"): value s_i, gradient s_i * grad logp_t.
    The policy term is then weighted by the truncated importance weight min(exp(old - rollout), tis_cap)
    (detached; corrects sampler/trainer numerics mismatch) and restricted to the top entropy_top_frac
    highest-entropy tokens; the k3 KL to the reference, beta * (exp(ref - logp) - (ref - logp) - 1), is
    added on every masked token. Entropy selection and TIS change which tokens carry policy gradient, not
    the denominator of the aggregation (as in TRL and the 80/20 paper).
    entropy_coef > 0 adds grpo.entropy_target's bonus from the sampled tokens: grad H = -E_a[(log p(a) + H)
    grad log p(a)] (H a baseline), so minimising coef * (sg(logp) + H) * logp ascends coef * H (docs/stages.md).
    advantages are [B] (one per sequence) or [B, T] (per token, e.g. from turn advantages).
    """
    m = mask.to(logprobs.dtype)
    live = m > 0
    zero = torch.zeros_like(logprobs)
    adv = advantages.to(logprobs.dtype)
    adv = (adv.unsqueeze(-1) if adv.dim() == 1 else adv).expand_as(logprobs)

    log_ratio = torch.where(live, logprobs - old_logprobs, zero)
    if importance == "token":
        ratio = log_ratio.exp()
    elif importance == "sequence":
        seq_log_ratio = log_ratio.sum(-1, keepdim=True) / m.sum(-1, keepdim=True).clamp(min=1)
        ratio = seq_log_ratio.detach().exp() * torch.where(live, logprobs - logprobs.detach(), zero).exp()
    else:
        raise ValueError(f"unknown importance {importance!r}; expected token or sequence")
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    tok = -torch.min(ratio * adv, clipped * adv)

    stats: dict[str, float] = {}
    n_tok = m.sum()

    def masked_mean(x: torch.Tensor) -> float:
        return float(torch.where(live, x.detach(), zero).sum() / n_tok.clamp(min=1))

    if tis_cap is not None and rollout_logprobs is not None:
        weight = torch.where(live, old_logprobs - rollout_logprobs, zero).exp().clamp(max=tis_cap).detach()
        tok = tok * weight
        stats["tis_weight_mean"] = masked_mean(weight)
    if entropy is not None:
        stats["entropy"] = masked_mean(entropy)
        if entropy_top_frac is not None:
            tok = tok * _top_entropy_mask(entropy, live, entropy_top_frac)
        if entropy_coef > 0:
            tok = tok + entropy_coef * (logprobs.detach() + entropy) * logprobs
    kl = zero
    if ref_logprobs is not None:
        diff = torch.where(live, ref_logprobs - logprobs, zero)
        kl = diff.exp() - diff - 1
        if beta > 0:
            tok = tok + beta * kl

    loss = _aggregate(torch.where(live, tok, zero), m, aggregation, max_len_norm)
    with torch.no_grad():
        low, high = (ratio < 1 - clip_low) & (adv < 0), (ratio > 1 + clip_high) & (adv > 0)
        stats.update(loss=float(loss), ratio_mean=masked_mean(ratio), kl=masked_mean(kl), tokens=float(n_tok))
        stats.update(clip_frac_low=masked_mean(low.to(m.dtype)), clip_frac_high=masked_mean(high.to(m.dtype)))
    return loss, stats
