"""GRPO's advantages as pure tensor functions: group-relative, per episode or per turn, and SPIRAL's
role-conditioned baselines (tests/unit/test_grpo_math.py checks each against hand-computed numbers).

Conventions:
  * Standard deviations use Bessel's correction (unbiased), as TRL's GRPOTrainer does (`trl.trainer.utils.nanstd`).
  * A group whose rewards are all equal (a one-member group included) carries no group-relative signal:
    the group methods give it advantage exactly 0 instead of rounding noise divided by eps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

ADVANTAGE_METHODS = ("grpo", "dr_grpo", "rloo", "batch")


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


def groups_without_signal(zero_var: torch.Tensor, group_ids: torch.Tensor, credited: set[int]) -> int:
    """How many groups train on nothing: their returns are all equal (zero_var, per member) and no member is
    credited (a live step group or branch point: members' indices, which train whatever their group's returns)."""
    equal = {int(g) for g in group_ids[zero_var].tolist()}
    return len(equal - {int(group_ids[i]) for i in credited})


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


def episode_returns(per_episode_turn_returns: Sequence[Sequence[float]]) -> torch.Tensor:
    """Each episode's whole (discounted) return, its first turn's return-to-go G_i0; 0 for an episode without turns."""
    return torch.tensor([float(g[0]) if len(g) else 0.0 for g in per_episode_turn_returns], dtype=torch.float64)


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
    baseline, scale, live = _baseline_and_scale(episode_returns(per_episode_turn_returns), group_ids, method, eps)
    return [
        [float((g - baseline[i]) / scale[i]) if live[i] else 0.0 for g in returns]
        for i, returns in enumerate(per_episode_turn_returns)
    ]


def step_group_advantages(
    per_episode_turn_returns: Sequence[Sequence[float]],
    states: Sequence[Sequence[str]],
    group_ids: torch.Tensor | Sequence[int],
    method: str = "grpo",
    eps: float = 1e-6,
) -> tuple[list[list[float]], float]:
    """GiGPO's step-level advantages (Feng et al. 2025): the turns of one group's episodes that acted in
    the same state (equal `states[i][t]`) form a step group, and each turn's return-to-go G_it is measured
    against its step group's baseline and scale (`method`, as `compute_advantages`; batch normalises per
    step group as grpo does). A step group of one turn, or of equal returns, gives 0.

    Second: the share of turns that sit in a step group with signal (the measure of how often states
    repeat with different outcomes)."""
    flat: list[float] = []
    keys: dict[tuple[int, str], int] = {}
    ids: list[int] = []
    groups = torch.as_tensor(group_ids).tolist()
    for i, (returns, seen) in enumerate(zip(per_episode_turn_returns, states, strict=True)):
        for value, state in zip(returns, seen, strict=True):
            flat.append(float(value))
            ids.append(keys.setdefault((groups[i], state), len(keys)))
    if not flat:
        return [[] for _ in per_episode_turn_returns], 0.0
    values = torch.tensor(flat, dtype=torch.float64)
    baseline, scale, live = _baseline_and_scale(values, ids, "grpo" if method == "batch" else method, eps)
    adv = torch.where(live, (values - baseline) / scale, torch.zeros_like(values)).tolist()
    out, start = [], 0
    for returns in per_episode_turn_returns:
        out.append(adv[start : start + len(returns)])
        start += len(returns)
    return out, float(live.double().mean())


def branch_point_advantages(returns_to_go: Sequence[float]) -> tuple[float, list[float]]:
    """grpo.branch: a branch point's Monte-Carlo value and the per-turn advantage of each turn taken there.
    `returns_to_go` holds, from the branch turn t on, the return of the parent episode and of each of its
    continuations; V(s_t) is their mean and each turn's advantage its return-to-go minus V(s_t)."""
    value = sum(returns_to_go) / len(returns_to_go)
    return value, [float(g) - value for g in returns_to_go]


def outside_advantages(
    member_returns: Sequence[float],
    member_groups: Sequence[int],
    outsider_turn_returns: Sequence[Sequence[float]],
    outsider_groups: Sequence[int],
    method: str = "grpo",
    eps: float = 1e-6,
) -> list[list[float]]:
    """Turn advantages of episodes measured against a group they do not join (grpo.branch's continuations,
    against their parent's group), so that the group's own advantages stay what they were without them.

    A group's baseline is the mean of its members' returns (`member_returns`, what their episode advantages
    are computed from; for rloo the mean of the others is all of them), its scale the unbiased std + eps
    for grpo and batch (batch: over every member), 1 for dr_grpo and rloo; a group whose members' returns
    are all equal gives 0, as it gives its members."""
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"unknown advantage method {method!r}; expected one of {', '.join(ADVANTAGE_METHODS)}")
    out = []
    for returns, group in zip(outsider_turn_returns, outsider_groups, strict=True):
        values = [
            float(r) for r, g in zip(member_returns, member_groups, strict=True) if method == "batch" or g == group
        ]
        if len(values) < 2 or max(values) == min(values):
            out.append([0.0] * len(returns))
            continue
        members = torch.tensor(values, dtype=torch.float64)
        scale = float(members.std()) + eps if method in ("grpo", "batch") else 1.0
        mean = float(members.mean())
        out.append([(float(g) - mean) / scale for g in returns])
    return out
