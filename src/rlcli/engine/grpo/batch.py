"""An iteration's batch: the chosen episodes' advantages (per group, per turn, or against SPIRAL's
role baselines) and one training sequence per episode (or per turn), exactly the tokens sampled."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlcli.engine.context import RunContext
from rlcli.engine.grpo import advantages, loss
from rlcli.engine.grpo.branches import stored_branches
from rlcli.engine.grpo.selection import Selection, episode_return, hard_tasks, total, turn_rewards
from rlcli.engine.grpo.staleness import staleness
from rlcli.engine.grpo.update import TrainSequence
from rlcli.envs.tool_use import without_call_records
from rlcli.errors import RlcliError
from rlcli.store.episodes import sampled_token_entropy, set_aside_count
from rlcli.store.names import rollout_stage
from rlcli.store.records import LabelledEpisode, Turn
from rlcli.store.teacher import TurnKey, teacher_logprobs

if TYPE_CHECKING:
    from rlcli.recipe import DistillSection, GrpoSection


@dataclass
class IterationBatch:
    """What train/i updates on (GrpoTrainer.batch)."""

    iteration: int
    sequences: list[TrainSequence]  # each with its per-token advantages
    reward_mean: float  # over the episodes trained on, replays included
    reward_std: float
    metrics: dict[str, float]  # train/: groups, zero-variance groups, sequences, staleness, ...
    replayed: list[tuple[int, int]] | None  # grpo.replay's (episode id, task) added; None: replay is off
    rae_baselines: dict[str, float] | None = None  # grpo.advantage rae: the baselines after this batch
    trained_groups: list[tuple[int, int]] | None = None  # grpo.dynamic_sampling: (iteration played, task) chosen
    entropy_coef: float = 0.0  # grpo.entropy_target: the entropy bonus's coefficient for this update


def entropy_coefficient(cfg: GrpoSection, entropies: list[float | None]) -> float:
    """grpo.entropy_target's coefficient after the rollouts whose sampled-token entropies are `entropies`
    (oldest first; None: a rollout without tokens, which moves nothing): from 0, each one below the
    target raises it by grpo.entropy_coef_step and each one at or above lowers it, kept in
    [0, grpo.entropy_coef_max]. A function of stored rollouts, so a resumed run gets the same."""
    coef = 0.0
    if cfg.entropy_target is None:
        return coef
    for entropy in entropies:
        if entropy is not None:
            step = cfg.entropy_coef_step if entropy < cfg.entropy_target else -cfg.entropy_coef_step
            coef = min(max(coef + step, 0.0), cfg.entropy_coef_max)
    return coef


def build_batch(
    ctx: RunContext, chosen: Selection, rae_baselines: dict[str, float], *, distills: bool = False
) -> IterationBatch:
    """The iteration's batch from the episodes chosen for it: their advantages per group (or against
    grpo.advantage rae's baselines, which it returns updated) and one training sequence per episode
    (or turn), with the metrics that describe it. distills: a distill phase's, whose tokens' advantages
    come from the teacher's stored logprobs (teacher_advantages)."""
    recipe, cfg, it, episodes = ctx.recipe, ctx.recipe.grpo, chosen.iteration, chosen.episodes
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    groups = role_groups(episodes, chosen.played_in)
    loss.check_finite("the rewards", rewards)
    metrics: dict[str, float] = {"train/groups": int(len(set(groups.tolist()))), **chosen.metrics}
    if recipe.rollout.group_size_hard is not None:
        hard = hard_tasks(ctx, chosen.stages) & {e.episode.task_index for e in episodes}
        metrics["train/hard_groups"] = len(hard)
    lags = [staleness(it, e.episode.policy) for e in episodes]
    if cfg.max_staleness:  # of the iteration's own rollouts: replays are as old as they are by design
        played = lags[: len(episodes) - len(chosen.replayed)]
        metrics["train/staleness_mean"] = sum(played) / len(played)
        metrics["train/staleness_max"] = max(played)
    if discarded := set_aside_count(ctx.store, rollout_stage(it)):
        metrics["train/discarded_episodes"] = discarded
    credit = turn_credit(cfg, episodes, rewards, groups, rae_baselines, metrics)
    turn_adv, zero_var, credited = credit.per_turn, credit.zero_var, credit.credited
    branched: list[tuple[LabelledEpisode, list[float]]] = []
    if cfg.branch is not None and cfg.branch.choose == "expert":
        branched = expert_branch_credit(cfg, stored_branches(ctx, it), metrics)
    elif cfg.branch is not None:
        branched, parents = branch_credit(cfg, episodes, groups, turn_adv, stored_branches(ctx, it), metrics)
        credited |= parents
    metrics["train/zero_var_groups"] = advantages.groups_without_signal(zero_var, groups, credited)

    replay_ids = {e.episode.id for e in chosen.replayed}
    taught = teacher_logprobs(ctx.store, [stored_id(e) for e in episodes]) if distills else None
    gaps: list[float] = []  # a distill phase's student - teacher logprob of every token trained on
    sequences: list[TrainSequence] = []
    for i, labelled in enumerate(episodes):
        ep = labelled.episode
        # (A distilled token has the teacher's signal whatever its group's rewards.)
        equal = cfg.drop_zero_var_groups and cfg.advantage != "rae" and bool(zero_var[i]) and i not in credited
        if equal and taught is None:
            continue
        if cfg.mask_truncated and ep.hit_a_cap:
            continue
        if not ep.turns:  # a seat whose game ended before it moved (the other's invalid move): no tokens
            continue
        for seq in episode_sequences(stored_id(labelled), ep.task_index, ep.turns):
            seq.advantage = [turn_adv[i][t] for t in seq.turn_of_token]
            if taught is not None:
                seq.advantage = teacher_advantages(ctx.recipe.distill, seq, taught, gaps)
            seq.truncated = ep.hit_a_cap
            seq.stale = lags[i] > 0 or ep.id in replay_ids  # a replay's behaviour policy is its recorded one
            sequences.append(seq)
    for labelled, per_turn in branched:
        sequences += branch_sequences(cfg, labelled, per_turn)
    metrics["train/sequences"] = len(sequences)
    entropy_coef = 0.0
    if cfg.entropy_target is not None:
        entropies = [sampled_token_entropy(ctx.store, rollout_stage(i)) for i in range(it + 1)]
        entropy_coef = entropy_coefficient(cfg, entropies)
        metrics["train/entropy_coef"] = entropy_coef
        if entropies[-1] is not None:
            metrics["train/rollout_entropy"] = entropies[-1]
    if gaps:  # the sampled estimate of the per-token reverse KL to the teacher
        metrics["train/teacher_kl"] = sum(gaps) / len(gaps)
    return IterationBatch(
        it,
        sequences,
        float(rewards.mean()),
        float(rewards.std(unbiased=False)),
        metrics,
        [(stored_id(e), e.episode.task_index) for e in chosen.replayed] if cfg.replay is not None else None,
        credit.rae,
        chosen.trained_groups,
        entropy_coef,
    )


@dataclass
class TurnCredit:
    """What each episode of a batch trains on (turn_credit)."""

    per_turn: list[list[float]]  # each episode's advantage per turn
    zero_var: torch.Tensor  # per episode: its group's episode returns are all equal (no group-relative signal)
    credited: set[int]  # episodes trained even so: a turn with a step-level advantage (grpo.step_groups)
    rae: dict[str, float] | None  # grpo.advantage rae: the role baselines after this batch


def turn_credit(
    cfg: GrpoSection,
    episodes: list[LabelledEpisode],
    rewards: torch.Tensor,
    groups: torch.Tensor,
    rae_baselines: dict[str, float],
    metrics: dict[str, float],
) -> TurnCredit:
    """Each episode's advantage per turn: group-relative per episode (the same on every turn), from
    discounted turn returns (grpo.gamma), or against SPIRAL's role baselines (grpo.advantage rae,
    whose baselines' values are added to `metrics`). A group is equal by the returns its advantages come
    from: with grpo.gamma, the discounted ones, so that wins of different lengths differ."""
    if cfg.advantage == "rae":
        turn_returns = [
            advantages.discounted_turn_returns(turn_rewards(e), cfg.gamma) if cfg.gamma is not None else []
            for e in episodes
        ]
        returns = [g[0] if g else float(rewards[i]) for i, g in enumerate(turn_returns)]
        roles = [role_of(e) for e in episodes]
        rae = advantages.rae_baselines(returns, roles, rae_baselines, cfg.rae_decay)
        metrics.update({f"train/rae_baseline/{role}": rae[role] for role in sorted(set(roles))})
        per_turn = [
            [g - rae[roles[i]] for g in turn_returns[i]]
            if cfg.gamma is not None
            else [returns[i] - rae[roles[i]]] * len(e.episode.turns)
            for i, e in enumerate(episodes)
        ]
        return TurnCredit(per_turn, advantages.zero_variance_groups(rewards, groups), set(), rae)
    if cfg.gamma is not None:
        turn_returns = [advantages.discounted_turn_returns(turn_rewards(e), cfg.gamma) for e in episodes]
        per_turn = advantages.turn_advantages(turn_returns, groups, cfg.advantage)
        compared = advantages.episode_returns(turn_returns)
    else:
        adv = advantages.compute_advantages(rewards, groups, cfg.advantage)
        per_turn = [[float(adv[i])] * len(e.episode.turns) for i, e in enumerate(episodes)]
        compared = rewards  # what equal groups are judged by: what the advantages came from
    credited: set[int] = set()
    if cfg.step_groups:
        gamma = cfg.gamma if cfg.gamma is not None else 1.0
        to_go = [advantages.discounted_turn_returns(turn_rewards(e), gamma) for e in episodes]
        states = [acted_on(e.episode.turns) for e in episodes]
        step, live = advantages.step_group_advantages(to_go, states, groups, cfg.advantage)
        metrics["train/step_groups_live"] = live
        per_turn = [[a + cfg.step_groups * s for a, s in zip(ep, st)] for ep, st in zip(per_turn, step)]
        credited = {i for i, st in enumerate(step) if any(st)}
    return TurnCredit(per_turn, advantages.zero_variance_groups(compared, groups), credited, None)


def branch_credit(
    cfg: GrpoSection,
    episodes: list[LabelledEpisode],
    groups: torch.Tensor,
    turn_adv: list[list[float]],
    branches: list[LabelledEpisode],
    metrics: dict[str, float],
) -> tuple[list[tuple[LabelledEpisode, list[float]]], set[int]]:
    """grpo.branch's per-turn credit (grpo/branches.py). For each branch point (a parent in the batch,
    turn t) V(s_t) is the mean return-to-go from t of the parent and its continuations, and the turn
    each took at t adds weight * (its return-to-go - V(s_t)) to its episode advantage; the parent's
    entry of `turn_adv` is updated in place. A continuation's episode advantage is measured against its
    parent's group without joining it (advantages.outside_advantages); its turns before t are the
    parent's and train with the parent (branch_sequences masks them). Returns the continuations with
    their per-turn advantages and the positions of the parents credited."""
    assert cfg.branch is not None
    gamma = cfg.gamma if cfg.gamma is not None else 1.0
    position = {stored_id(e): i for i, e in enumerate(episodes)}
    points: dict[tuple[int, int], list[LabelledEpisode]] = {}
    for b in branches:
        parent, turn = b.episode.parent_episode_id, b.episode.branch_turn
        if parent in position and turn is not None:  # a parent that grpo.dynamic_sampling left out trains nothing
            points.setdefault((position[parent], turn), []).append(b)
    trained = [b for members in points.values() for b in members]
    parent_groups = [int(groups[i]) for (i, _), members in points.items() for _ in members]
    # The episode term, on every turn as the group's own members get it (discounted with grpo.gamma).
    member_returns = [episode_return(e, cfg.gamma) for e in episodes]
    outsider_returns = [
        advantages.discounted_turn_returns(turn_rewards(b), cfg.gamma)
        if cfg.gamma is not None
        else [total(b)] * len(b.episode.turns)
        for b in trained
    ]
    episode_term = advantages.outside_advantages(
        member_returns, groups.tolist(), outsider_returns, parent_groups, cfg.advantage
    )
    own = {id(b): adv for b, adv in zip(trained, episode_term)}
    live = 0
    credited: set[int] = set()  # parents with a point whose returns differ: trained even in a group of equal rewards
    for (i, turn), members in points.items():
        to_go = [advantages.discounted_turn_returns(turn_rewards(e), gamma)[turn] for e in (episodes[i], *members)]
        _, step = advantages.branch_point_advantages(to_go)
        if len(set(to_go)) > 1:
            live += 1
            credited.add(i)
        turn_adv[i][turn] += cfg.branch.weight * step[0]
        for b, a in zip(members, step[1:]):
            own[id(b)][turn] += cfg.branch.weight * a
    metrics["train/branch_points"] = len(points)
    metrics["train/branch_points_live"] = live / len(points) if points else 0.0
    return [(b, own[id(b)]) for b in trained], credited


def expert_branch_credit(
    cfg: GrpoSection, branches: list[LabelledEpisode], metrics: dict[str, float]
) -> list[tuple[LabelledEpisode, list[float]]]:
    """grpo.branch.choose expert's credit: the continuations from one expert state s_t are a group of their
    own (the expert is off-policy and not in it), and each trains from turn t on with weight x its
    advantage among them (grpo.advantage, of their returns-to-go from t, discounted with grpo.gamma)."""
    assert cfg.branch is not None
    gamma = cfg.gamma if cfg.gamma is not None else 1.0
    points: dict[tuple[int | None, int], list[LabelledEpisode]] = {}
    for b in branches:
        points.setdefault((b.episode.parent_episode_id, b.episode.branch_turn or 0), []).append(b)
    out, live = [], 0
    for (_, turn), members in points.items():
        to_go = [advantages.discounted_turn_returns(turn_rewards(b), gamma)[turn] for b in members]
        adv = advantages.compute_advantages(to_go, [0] * len(members), cfg.advantage)
        live += len(set(to_go)) > 1
        for b, a in zip(members, adv.tolist(), strict=True):
            out.append((b, [0.0] * turn + [cfg.branch.weight * a] * (len(b.episode.turns) - turn)))
    metrics["train/branch_points"] = len(points)
    metrics["train/branch_points_live"] = live / len(points) if points else 0.0
    return out


def branch_sequences(cfg: GrpoSection, labelled: LabelledEpisode, per_turn: list[float]) -> list[TrainSequence]:
    """A continuation's training sequences: its turns from its branch turn on, each on its advantage; the
    replayed turns before it are context (the parent trains them)."""
    ep, start = labelled.episode, labelled.episode.branch_turn or 0
    if cfg.mask_truncated and ep.hit_a_cap:
        return []
    if cfg.drop_zero_var_groups and not any(per_turn[start:]):  # nothing to learn, as a group of equal rewards
        return []
    out = []
    for seq in episode_sequences(stored_id(labelled), ep.task_index, ep.turns):
        seq.mask = [m if turn >= start else 0.0 for m, turn in zip(seq.mask, seq.turn_of_token)]
        seq.advantage = [per_turn[t] for t in seq.turn_of_token]
        seq.truncated = ep.hit_a_cap
        if any(seq.mask):
            out.append(seq)
    return out


def teacher_advantages(
    cfg: DistillSection, seq: TrainSequence, taught: dict[TurnKey, list[float]], gaps: list[float]
) -> list[float]:
    """A distilled sequence's per-token advantages: distill.reward_weight x its episode advantage (the
    group-relative one `seq.advantage` holds) minus distill.kl_coef x (student - teacher logprob) of each
    sampled token, whose expectation over the student's samples is the per-token reverse KL. Each
    token's log ratio is appended to `gaps`."""
    out, seen = [], dict.fromkeys(set(seq.turn_of_token), 0)  # tokens of each turn so far
    for trained, student, turn, episode_adv in zip(seq.mask, seq.rollout_logprobs, seq.turn_of_token, seq.advantage):
        if not trained:
            out.append(0.0)
            continue
        teacher = taught.get((seq.episode_id, turn))
        if teacher is None or seen[turn] >= len(teacher):
            raise RlcliError(
                f"Episode {seq.episode_id}, turn {turn}: no teacher logprob stored for its token {seen[turn]}; "
                "its iteration's teach stage did not score it."
            )
        gap = student - teacher[seen[turn]]
        seen[turn] += 1
        gaps.append(gap)
        out.append(cfg.reward_weight * episode_adv - cfg.kl_coef * gap)
    return out


def acted_on(turns: list[Turn]) -> list[str]:
    """The observation each turn acted on, as a step group's key: the reset's (the same for every episode
    of a group, which shares its seed) for the first, the previous turn's answer after it. A tool
    message's `call` (it holds the call's latency) is left out, so that equal answers compare equal."""
    keys = [""]
    for turn in turns[:-1]:
        keys.append(json.dumps(without_call_records(json.loads(turn.observation)), sort_keys=True))
    return keys


def episode_sequences(episode_id: int, group: int, turns: list[Turn]) -> list[TrainSequence]:
    """One sequence per episode when every turn's prompt extends the previous turn's tokens,
    else one per turn; either way exactly the tokens that were seen and sampled."""
    last = turns[-1]
    full = last.prompt_ids + last.completion_ids
    consistent = all(
        full[: len(t.prompt_ids)] == t.prompt_ids
        and full[len(t.prompt_ids) : len(t.prompt_ids) + len(t.completion_ids)] == t.completion_ids
        for t in turns
    )
    groups = [turns] if consistent else [[t] for t in turns]
    out = []
    for part in groups:
        ids = part[-1].prompt_ids + part[-1].completion_ids
        mask, logps, turn_of = [0.0] * len(ids), [0.0] * len(ids), [0] * len(ids)
        for t in part:
            start = len(t.prompt_ids)
            for j, lp in enumerate(t.logprobs):
                mask[start + j], logps[start + j], turn_of[start + j] = 1.0, lp, t.turn_index
        out.append(TrainSequence(episode_id, group, ids, mask, logps, turn_of, images=part[-1].images))
    return out


def role_of(labelled: LabelledEpisode) -> str:
    """An episode's role for grpo.advantage rae: its game and seat ("TicTacToe-v0/seat1"), from the task
    its env reported; an env without seats has one role per game (or one in all)."""
    task = labelled.episode.task or {}
    game = str(task.get("game", ""))
    return f"{game}/seat{task['seat']}" if "seat" in task else game


def role_groups(episodes: list[LabelledEpisode], played_in: list[int | None] | None = None) -> torch.Tensor:
    """The group of each episode: its task, and within a task its seat (two-player games), so that
    group-relative advantages compare an episode only with others that played the same role.
    played_in: the iteration whose group each episode belongs to (grpo.dynamic_sampling carries groups
    from earlier iterations, which may have played the same task); None: all the same."""
    origins = played_in if played_in is not None else [None] * len(episodes)
    keys = [
        (origin if origin is not None else -1, e.episode.task_index, (e.episode.task or {}).get("seat", -1))
        for e, origin in zip(episodes, origins, strict=True)
    ]
    dense = {key: i for i, key in enumerate(sorted(set(keys)))}
    return torch.tensor([dense[key] for key in keys])


def stored_id(labelled: LabelledEpisode) -> int:
    """A training episode's id: it was read from the database, where every episode has one."""
    assert labelled.episode.id is not None
    return labelled.episode.id
