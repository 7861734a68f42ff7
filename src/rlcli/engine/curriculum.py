"""Which training tasks a GRPO iteration plays (grpo.sampling over env.tasks).

sequential: the tasks in order, it * rollout.tasks onwards, cycling through env.tasks when set
  (with grpo.dynamic_sampling, grpo.oversample times as many: tasks_played).
uniform: rollout.tasks distinct tasks drawn from env.tasks with a seed derived from (run seed, iteration).
curriculum: the same seeded draw, weighted by how informative each task is. A group whose samples all
  succeed or all fail has zero reward variance and teaches GRPO nothing, so the weight is the
  Bernoulli variance of the task's success, scaled to at most 1: 4 p (1 - p), where p is the success
  rate with half a success and half a failure added (a Jeffreys prior), so that an unseen task
  counts as p = 0.5 (the highest weight) and a few lucky samples do not pin a task at 0 or 1. No
  weight falls below grpo.curriculum_floor: solved and hopeless tasks are still revisited now and then.

A draw depends on the run seed, the iteration and the task statistics of the iterations before it
only (engine/labelling.py keeps them in the store), and the iteration's rollout stage records the
tasks it drew: a resumed run reuses that record rather than drawing again.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import numpy as np

from rlcli.engine.context import RunContext
from rlcli.engine.labelling import GRPO_LABEL_SET
from rlcli.generation.seeds import derive_seed
from rlcli.store.iterations import rollout_plan
from rlcli.store.names import rollout_stage
from rlcli.store.tasks import TaskStats, compute_task_stats

if TYPE_CHECKING:
    from rlcli.recipe import Recipe

PRIOR = 0.5  # pseudo-successes and pseudo-failures added to every task's record


def tasks_played(recipe: Recipe) -> int:
    """How many tasks an iteration's rollout plays: rollout.tasks, over-sampled by grpo.oversample
    with grpo.dynamic_sampling (the iteration then trains on rollout.tasks groups of them)."""
    n = recipe.rollout.tasks
    return math.ceil(n * recipe.grpo.oversample - 1e-9) if recipe.grpo.dynamic_sampling else n


def iteration_tasks(ctx: RunContext, it: int) -> list[int]:
    """The tasks of iteration `it`: those its rollout stage recorded, else a fresh choice."""
    plan = rollout_plan(ctx.store, rollout_stage(it))
    # Before rlcli recorded the list, a rollout stage kept [first, last] of a sequential range. A list of
    # another length is the stage's own (played under another grpo.oversample): kept, as the episodes are.
    legacy = plan is not None and len(plan.tasks) == 2 != tasks_played(ctx.recipe)
    if plan is not None and not legacy:
        return plan.tasks
    return choose_tasks(ctx, it)


def choose_tasks(ctx: RunContext, it: int) -> list[int]:
    recipe = ctx.recipe
    n, pool, sampling = tasks_played(recipe), recipe.env.tasks, recipe.grpo.sampling
    if sampling == "sequential":
        if pool is None:
            return list(range(it * n, (it + 1) * n))
        start, stop = pool
        return [start + (it * n + i) % (stop - start) for i in range(n)]
    assert pool is not None  # the recipe refuses a draw (uniform, curriculum) without env.tasks
    return weighted_draw(_pool_weights(ctx, it), n, derive_seed(recipe.run.seed, "tasks", it), pool[0])


def _pool_weights(ctx: RunContext, it: int) -> np.ndarray:
    """The draw weight of each task of env.tasks for iteration it: 1 (uniform), else the curriculum's."""
    recipe = ctx.recipe
    assert recipe.env.tasks is not None  # the recipe refuses a draw (uniform, curriculum) without env.tasks
    start, stop = recipe.env.tasks
    if recipe.grpo.sampling != "curriculum":
        return np.ones(stop - start)
    stats = compute_task_stats(ctx.store, GRPO_LABEL_SET, before_iteration=it)
    return curriculum_weights(stats, start, stop, recipe.grpo.curriculum_floor)


def extra_tasks(ctx: RunContext, it: int, round_: int, played: list[int], count: int) -> list[int]:
    """grpo.dynamic_sampling: the tasks of iteration it's extra rollout round `round_` (1, 2, ...), `count`
    of them (fewer when the pool runs out) that the iteration has not played yet, so that every group
    stays one task: those the round's stage recorded, else the sequence's next ones (sequential) or a
    draw seeded by (run seed, iteration, round) among the pool's unplayed tasks."""
    plan = rollout_plan(ctx.store, rollout_stage(it, round_))
    if plan is not None:
        return plan.tasks
    recipe = ctx.recipe
    n, pool, seen = tasks_played(recipe), recipe.env.tasks, set(played)
    if recipe.grpo.sampling == "sequential":
        # The sequence continues past the iteration's own tasks (it may overlap the next iterations':
        # their episodes are seeded by their own stage, so they are other samples of those tasks).
        size = None if pool is None else pool[1] - pool[0]
        out: list[int] = []
        position = (it + 1) * n
        while len(out) < count and (size is None or position < (it + 1) * n + size):
            task = position if pool is None or size is None else pool[0] + position % size
            if task not in seen and task not in out:
                out.append(task)
            position += 1
        return out
    assert pool is not None  # the recipe refuses a draw (uniform, curriculum) without env.tasks
    start, stop = pool
    left = np.array([t for t in range(start, stop) if t not in seen], dtype=np.int64)
    weights = _pool_weights(ctx, it)[left - start]
    chosen = weighted_draw(weights, min(count, len(left)), derive_seed(recipe.run.seed, "tasks", it, round_), 0)
    return [int(left[i]) for i in chosen]


def group_sizes(ctx: RunContext, it: int, stage: str, tasks: list[int]) -> dict[int, int]:
    """The samples each task of GRPO rollout `stage` (of iteration it) gets: rollout.group_size, or
    rollout.group_size_hard for a task rated hard by the statistics of the iterations before it (at
    least rollout.hard_min_attempts attempts, success rate below rollout.hard_below). The stage
    records the sizes (params group_sizes, in task order); a resumed stage reuses them."""
    rollout = ctx.recipe.rollout
    plan = rollout_plan(ctx.store, stage)
    if plan is not None and plan.group_sizes is not None and len(plan.group_sizes) == len(tasks):
        return dict(zip(tasks, plan.group_sizes, strict=True))
    sizes = dict.fromkeys(tasks, rollout.group_size)
    if rollout.group_size_hard is None:
        return sizes
    stats = {s.task_index: s for s in compute_task_stats(ctx.store, GRPO_LABEL_SET, before_iteration=it)}
    for task in tasks:
        known = stats.get(task)
        if known and known.attempts >= rollout.hard_min_attempts and known.success_rate < rollout.hard_below:
            sizes[task] = rollout.group_size_hard
    return sizes


def curriculum_weights(stats: list[TaskStats], start: int, stop: int, floor: float) -> np.ndarray:
    """Weights of the pool's tasks start..stop-1 from their statistics (module docstring)."""
    attempts, successes = np.zeros(stop - start), np.zeros(stop - start)
    for s in stats:
        if start <= s.task_index < stop:
            attempts[s.task_index - start] = s.attempts
            successes[s.task_index - start] = s.successes
    p = (successes + PRIOR) / (attempts + 2 * PRIOR)
    return np.maximum(4 * p * (1 - p), floor)


def weighted_draw(weights: np.ndarray, n: int, seed: int, offset: int) -> list[int]:
    """n distinct indices (+ offset) drawn without replacement, each with probability in proportion
    to its weight among those left (Efraimidis-Spirakis keys u^(1/w)); in drawing order."""
    rng = np.random.default_rng(seed)
    keys = np.log(rng.random(len(weights))) / weights  # log of u^(1/w): same order, no underflow
    chosen = np.argsort(-keys, kind="stable")[:n]
    return [int(i) + offset for i in chosen]
