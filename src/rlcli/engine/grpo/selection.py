"""Which episodes an iteration trains on: its rollout stages' groups (grpo.dynamic_sampling: informative
groups first, then those carried from the iterations before), and grpo.replay's stored successes.

Everything is read from the run database, never from what this process played, so a resumed
iteration chooses exactly what an uninterrupted run chose. One definition of an informative group
(`informative`: unequal returns, discounted with grpo.gamma as the advantages are) serves the choice,
the carry and the refill rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from rlcli.engine.context import RunContext
from rlcli.engine.grpo.advantages import discounted_turn_returns
from rlcli.engine.labelling import GRPO_LABEL_SET
from rlcli.errors import RlcliError
from rlcli.store.episodes import episodes_for_training
from rlcli.store.iterations import IterationStats, rollout_plan
from rlcli.store.names import rollout_stage, train_stage
from rlcli.store.records import LabelledEpisode
from rlcli.store.replays import replay_candidates
from rlcli.store.stages import stage_done


def rollout_stages(ctx: RunContext, it: int) -> list[str]:
    """The rollout stages iteration it trains on: rollout/it, and with grpo.dynamic_sampling the extra
    rounds that SyncRollouts finished (rollout/it+1, ...), within grpo.max_rollout_rounds."""
    stages = [rollout_stage(it)]
    if ctx.recipe.grpo.dynamic_sampling:
        for r in range(1, ctx.recipe.grpo.max_rollout_rounds):
            if not stage_done(ctx.store, rollout_stage(it, r)):
                break
            stages.append(rollout_stage(it, r))
    return stages


@dataclass
class Selection:
    """The episodes iteration `iteration` trains on, before their advantages (choose_groups)."""

    iteration: int
    stages: list[str]  # its rollout stages: rollout/i and the refill rounds that finished
    episodes: list[LabelledEpisode]  # its groups' episodes, then grpo.replay's
    played_in: list[int | None]  # the iteration whose group each episode joins (a carried group's own)
    replayed: list[LabelledEpisode]  # grpo.replay's, at the end of `episodes`
    trained_groups: list[tuple[int, int]] | None  # grpo.dynamic_sampling: (iteration played, task) chosen
    metrics: dict[str, float] = field(default_factory=dict)  # train/: groups drawn, carried, rounds, replayed


def choose_groups(ctx: RunContext, it: int, first: int) -> Selection:
    """Iteration it's episodes: those of its rollout stages (with grpo.dynamic_sampling, rollout.tasks
    groups picked by training_batch among them and the groups carried from the phase's iterations
    before, which begins at `first`), then grpo.replay's for its groups that reached no success."""
    cfg = ctx.recipe.grpo
    stages = rollout_stages(ctx, it)
    episodes = [e for stage in stages for e in drawn_episodes(ctx, stage)]
    trained_groups: list[tuple[int, int]] | None = None
    metrics: dict[str, float] = {}
    if cfg.dynamic_sampling:
        carried = carried_groups(ctx, it, first)
        drawn = len(group_keys(episodes + carried))
        # The iteration's own groups first: a carried one only fills what they leave short.
        episodes = training_batch(episodes + carried, ctx.recipe.rollout.tasks, cfg.gamma)
        trained_groups = sorted(group_keys(episodes))
        metrics["train/groups_drawn"] = drawn
        metrics["train/carried"] = len({g for g in trained_groups if g[0] != it})
        metrics["train/rollout_rounds"] = len(stages)
    if not episodes:
        raise RlcliError(
            f"Iteration {it} has no successfully finished, labelled episodes to train on "
            f"(see `rlcli runs show {ctx.run}` for failed episodes)."
        )
    # A replay joins its task's group of this iteration, never a carried one.
    replayed = (
        replays_for(ctx, it, [e for e in episodes if e.episode.iteration == it]) if cfg.replay is not None else []
    )
    if cfg.replay is not None:
        metrics["train/replayed"] = len(replayed)
    played_in = [e.episode.iteration for e in episodes] + [it] * len(replayed)
    return Selection(it, stages, episodes + replayed, played_in, replayed, trained_groups, metrics)


def informative_groups(ctx: RunContext, stages: list[str]) -> int:
    """How many groups of these rollout stages (of one iteration) are informative under the GRPO labels."""
    episodes = [e for stage in stages for e in episodes_for_training(ctx.store, stage, GRPO_LABEL_SET)]
    groups: dict[tuple[int, int], list[LabelledEpisode]] = {}
    for e in episodes:
        groups.setdefault(_group_key(e), []).append(e)
    return sum(informative(members, ctx.recipe.grpo.gamma) for members in groups.values())


def training_batch(episodes: list[LabelledEpisode], target: int, gamma: float | None) -> list[LabelledEpisode]:
    """grpo.dynamic_sampling: the episodes of `target` groups (a group: a task as one iteration played
    it), informative ones first, in the order given (the iteration's draw, a round's after the round
    before's, then carried groups); zero-variance groups only fill what is left short."""
    groups: dict[tuple[int, int], list[LabelledEpisode]] = {}
    for e in episodes:
        groups.setdefault(_group_key(e), []).append(e)
    signal = [g for g, members in groups.items() if informative(members, gamma)]
    flat = [g for g in groups if g not in set(signal)]
    chosen = set((signal + flat)[:target])
    return [e for e in episodes if _group_key(e) in chosen]


def carried_groups(ctx: RunContext, it: int, first: int) -> list[LabelledEpisode]:
    """grpo.dynamic_sampling: the episodes of the informative groups that iterations it-k .. it-1 of
    the phase (k = grpo.carry_staleness) played and none trained on, oldest first. What each iteration
    trained on is read from its train stage's result; an iteration that did not record it (trained
    before rlcli carried groups) carries nothing from itself or before."""
    start = max(first, it - ctx.recipe.grpo.carry_staleness)
    trained: set[tuple[int, int]] = set()
    for k in range(start, it):
        row = ctx.store.stage(train_stage(k))
        stats = (
            IterationStats.from_dict(row.result) if row is not None and row.status == "done" and row.result else None
        )
        if stats is None or stats.trained_groups is None:
            start, trained = k + 1, set()
            continue
        trained |= set(stats.trained_groups)
    out, gamma = [], ctx.recipe.grpo.gamma
    for j in range(start, it):
        episodes = [e for stage in rollout_stages(ctx, j) for e in drawn_episodes(ctx, stage)]
        groups: dict[tuple[int, int], list[LabelledEpisode]] = {}
        for e in episodes:
            groups.setdefault(_group_key(e), []).append(e)
        out += [
            e for key, members in groups.items() if key not in trained and informative(members, gamma) for e in members
        ]
    return out


def drawn_episodes(ctx: RunContext, stage: str) -> list[LabelledEpisode]:
    """A rollout stage's labelled episodes for training, their groups in the order the stage drew its
    tasks (its recorded list), so that grpo.dynamic_sampling prefers the first drawn, as a draw means."""
    episodes = episodes_for_training(ctx.store, stage, GRPO_LABEL_SET)
    plan = rollout_plan(ctx.store, stage)
    if plan is None:
        return episodes
    position = {task: i for i, task in reversed(list(enumerate(plan.tasks)))}
    return sorted(episodes, key=lambda e: position.get(e.episode.task_index, len(position)))


def _group_key(labelled: LabelledEpisode) -> tuple[int, int]:
    """(the iteration that played it, its task): a GRPO group of grpo.dynamic_sampling."""
    iteration = labelled.episode.iteration
    return (-1 if iteration is None else iteration, labelled.episode.task_index)


def group_keys(episodes: list[LabelledEpisode]) -> set[tuple[int, int]]:
    """The grpo.dynamic_sampling groups these episodes belong to."""
    return {_group_key(e) for e in episodes}


def informative(members: list[LabelledEpisode], gamma: float | None) -> bool:
    """A group GRPO learns from: unequal returns, judged as build_batch's advantages are computed (with
    grpo.gamma the discounted ones, so wins of different lengths differ; else the totals)."""
    return len({episode_return(m, gamma) for m in members}) > 1


def episode_return(labelled: LabelledEpisode, gamma: float | None) -> float:
    """A training episode's return: its total, or with grpo.gamma its discounted return from the first turn."""
    if gamma is None or not labelled.episode.turns:
        return total(labelled)
    return discounted_turn_returns(turn_rewards(labelled), gamma)[0]


def turn_rewards(labelled: LabelledEpisode) -> list[float]:
    """The env's per-step rewards, with whatever the labelled total adds beyond them (judges,
    penalties, weights) credited to the last turn, so the turn rewards sum to the total."""
    rewards = [t.reward or 0.0 for t in labelled.episode.turns]
    rewards[-1] += total(labelled) - sum(rewards)
    return rewards


def hard_tasks(ctx: RunContext, stages: list[str]) -> set[int]:
    """The tasks these rollout stages played with rollout.group_size_hard samples (their recorded sizes)."""
    hard = set()
    for stage in stages:
        plan = rollout_plan(ctx.store, stage)
        assert plan is not None  # rollout_stages names only stages that were played, which record their plan
        sizes = plan.group_sizes or []
        hard |= {t for t, n in zip(plan.tasks, sizes) if n == ctx.recipe.rollout.group_size_hard}
    return hard


def replays_for(ctx: RunContext, it: int, episodes: list[LabelledEpisode]) -> list[LabelledEpisode]:
    """grpo.replay: for each group with no episode of total reward >= min_reward, up to max_per_group of
    that task's stored episodes from earlier iterations that reached it (store/replays.py)."""
    cfg = ctx.recipe.grpo.replay
    assert cfg is not None  # GrpoTrainer.batch calls this only with grpo.replay set
    best: dict[int, float] = {}
    for e in episodes:
        best[e.episode.task_index] = max(best.get(e.episode.task_index, -math.inf), total(e))
    out = []
    for task, reward in best.items():
        if reward < cfg.min_reward:
            out += replay_candidates(ctx.store, task, it, GRPO_LABEL_SET, cfg.min_reward, cfg.max_per_group)
    return out


def total(labelled: LabelledEpisode) -> float:
    """A training episode's total: episodes_for_training and replay_candidates read only episodes
    with a total under the label set."""
    assert labelled.reward is not None
    return labelled.reward
