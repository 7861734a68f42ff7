"""GRPO maths as pure tensor functions: advantages, the clipped policy loss and its options, log-prob helpers.

The training loop (rlcli.engine.train) owns models, batching and optimizers; everything here is a function of
tensors, so each option can be checked against hand-computed numbers (tests/test_grpo_math.py).

Conventions:
  * Standard deviations use Bessel's correction (unbiased), as TRL's GRPOTrainer does (`trl.trainer.utils.nanstd`).
  * A group whose rewards are all equal (a one-member group included) carries no group-relative signal:
    the group methods give it advantage exactly 0 instead of rounding noise divided by eps.
  * Positions where the mask is 0 may hold any value (padding, stale logprobs, even inf): they are replaced
    before any exp() so they can never turn the loss or its gradient into NaN.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from rlcli.errors import RlcliError

ADVANTAGE_METHODS = ("grpo", "dr_grpo", "rloo", "batch")


# --- advantages ----------------------------------------------------------------------------


def _group_index(group_ids: torch.Tensor | Sequence[int], n: int) -> tuple[torch.Tensor, int]:
    """Dense 0..K-1 group index per member, so groups may use any ids in any order."""
    ids = torch.as_tensor(group_ids)
    if ids.shape != (n,):
        raise ValueError(f"group_ids has shape {tuple(ids.shape)}; expected ({n},) to match the rewards")
    uniq, inverse = torch.unique(ids, return_inverse=True)
    return inverse, len(uniq)


def _float(rewards: torch.Tensor | Sequence[float]) -> torch.Tensor:
    """Rewards as a float tensor (integer rewards would truncate means)."""
    rewards = torch.as_tensor(rewards)
    return rewards if rewards.is_floating_point() else rewards.double()


def zero_variance_groups(
    rewards: torch.Tensor | Sequence[float], group_ids: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """Members of groups whose rewards are all exactly equal (one-member groups included): no learning signal.

    Exact max == min, not std ~ 0, so equal rewards are flagged even where their mean rounds.
    """
    rewards = _float(rewards)
    inverse, k = _group_index(group_ids, rewards.numel())
    lo = torch.full((k,), math.inf, dtype=rewards.dtype, device=rewards.device)
    hi = torch.full((k,), -math.inf, dtype=rewards.dtype, device=rewards.device)
    inverse = inverse.to(rewards.device)
    lo = lo.scatter_reduce(0, inverse, rewards, reduce="amin")
    hi = hi.scatter_reduce(0, inverse, rewards, reduce="amax")
    return (lo == hi)[inverse]


def _baseline_and_scale(
    rewards: torch.Tensor, group_ids: torch.Tensor | Sequence[int], method: str, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per member: the baseline b, the scale s and whether the advantage is live, so that A = (x - b) / s.

    Shared by episode and turn advantages, so the two agree exactly when every turn's return is the episode's.
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"unknown advantage method {method!r}; expected one of {', '.join(ADVANTAGE_METHODS)}")
    n = rewards.numel()
    ones = torch.ones_like(rewards)
    if method == "batch":
        mean = rewards.mean()
        std = rewards.std() if n > 1 else rewards.new_zeros(())
        live = (rewards.max() != rewards.min()).expand(n)
        return mean.expand(n), (std + eps).expand(n), live
    inverse, k = _group_index(group_ids, n)
    inverse = inverse.to(rewards.device)
    count = torch.zeros(k, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, ones)[inverse]
    total = torch.zeros(k, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, rewards)[inverse]
    mean = total / count
    live = ~zero_variance_groups(rewards, group_ids)
    if method == "dr_grpo":
        return mean, ones, live
    if method == "rloo":
        # Mean of the other members; one-member groups are never live, the clamp only avoids 0/0.
        return (total - rewards) / (count - 1).clamp(min=1), ones, live
    sq = torch.zeros(k, dtype=rewards.dtype, device=rewards.device).index_add_(0, inverse, (rewards - mean) ** 2)
    std = (sq[inverse] / (count - 1).clamp(min=1)).sqrt()
    return mean, std + eps, live


def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    group_ids: torch.Tensor | Sequence[int],
    method: str = "grpo",
    eps: float = 1e-6,
) -> torch.Tensor:
    """One advantage per episode ([N]) from its reward and its group (the task it was sampled for).

    grpo: (r - group mean) / (group std + eps), std unbiased as in TRL.
    dr_grpo: r - group mean (Dr. GRPO drops the std, which over-weights near-solved or near-failed tasks).
    rloo: r - mean of the group's other members, = (r - mean) * G / (G - 1).
    batch: (r - batch mean) / (batch std + eps) over all N, ignoring groups.
    Groups with all-equal rewards get exactly 0 under the group methods.
    """
    rewards = _float(rewards)
    baseline, scale, live = _baseline_and_scale(rewards, group_ids, method, eps)
    return torch.where(live, (rewards - baseline) / scale, torch.zeros_like(rewards))


def rae_baselines(
    returns: Sequence[float], roles: Sequence[str], baselines: dict[str, float], decay: float
) -> dict[str, float]:
    """SPIRAL's role-conditioned baselines after a batch: for each role (game and seat) in the batch,
    b <- decay * b + (1 - decay) * mean(returns of that role), b = 0 for a role not seen before; the
    roles not in the batch keep theirs. The advantage of an episode is then its return - b[role]."""
    sums: dict[str, list[float]] = {}
    for value, role in zip(returns, roles, strict=True):
        sums.setdefault(role, []).append(float(value))
    out = dict(baselines)
    for role, values in sums.items():
        out[role] = decay * baselines.get(role, 0.0) + (1 - decay) * sum(values) / len(values)
    return out


def discounted_turn_returns(step_rewards: Sequence[float], gamma: float) -> list[float]:
    """Return-to-go of each turn: G_t = r_t + gamma * G_{t+1}, so a turn is credited only with what follows it."""
    out: list[float] = []
    acc = 0.0
    for r in reversed(step_rewards):
        acc = float(r) + gamma * acc
        out.append(acc)
    return out[::-1]


def turn_advantages(
    per_episode_turn_returns: Sequence[Sequence[float]],
    group_ids: torch.Tensor | Sequence[int],
    method: str = "grpo",
    eps: float = 1e-6,
) -> list[list[float]]:
    """Advantage of every turn of every episode: A_it = (G_it - b_i) / s_i.

    b_i and s_i are `compute_advantages`' baseline and scale computed from the episodes' first-turn returns
    G_i0 (the whole discounted episode return), so every turn is measured against the group's episode-level
    statistics; with gamma = 1 and a single final reward this equals the per-episode advantage. A group whose
    episode returns are all equal gets 0 on every turn (as it would per episode), not (G_it - G_i0) / eps.
    An episode without turns has return 0 and no turn advantages.
    """
    first = torch.tensor([float(g[0]) if len(g) else 0.0 for g in per_episode_turn_returns], dtype=torch.float64)
    baseline, scale, live = _baseline_and_scale(first, group_ids, method, eps)
    return [
        [float((g - baseline[i]) / scale[i]) if live[i] else 0.0 for g in returns]
        for i, returns in enumerate(per_episode_turn_returns)
    ]


# --- log-probs and entropy ------------------------------------------------------------------


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


# --- policy loss ----------------------------------------------------------------------------


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
    kl = zero
    if ref_logprobs is not None:
        diff = torch.where(live, ref_logprobs - logprobs, zero)
        kl = diff.exp() - diff - 1
        if beta > 0:
            tok = tok + beta * kl

    loss = _aggregate(torch.where(live, tok, zero), m, aggregation, max_len_norm)
    with torch.no_grad():
        stats.update(
            loss=float(loss),
            clip_frac_low=masked_mean(((ratio < 1 - clip_low) & (adv < 0)).to(m.dtype)),
            clip_frac_high=masked_mean(((ratio > 1 + clip_high) & (adv > 0)).to(m.dtype)),
            ratio_mean=masked_mean(ratio),
            kl=masked_mean(kl),
            tokens=float(n_tok),
        )
    return loss, stats
