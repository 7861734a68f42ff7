"""Per-task statistics of a run's training tasks: how often each was played, solved and rewarded.

The `task_stats` table is a cache of what the episodes and their GRPO labels say: every row is
recomputed from them (`refresh_task_stats`), never incremented, so it can be rebuilt or checked at
any time and a stage that is redone after a kill writes the same numbers again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from rlcli.store.db import now
from rlcli.store.episodes import TOTAL
from rlcli.store.names import ANY_SUPERSEDED_LIKE
from rlcli.store.run_store import RunStore


@dataclass(frozen=True)
class TaskStats:
    """One training task (its index, which is its seed) as a run has played it so far."""

    task_index: int
    attempts: int  # finished episodes labelled under the label set
    successes: int
    reward_mean: float
    last_iteration: int | None  # the last GRPO iteration that played it (None: outside GRPO's loop)

    @property
    def success_rate(self) -> float:
        return self.successes / self.attempts if self.attempts else 0.0


# What the stats count: a run's finished train episodes that the label set labelled, but for those a
# GRPO resume superseded (played with weights it recomputed; store/episodes.py, supersede_stage) and
# grpo.branch's branches (played from a stored turn, not an attempt at the task from its start).
_AGGREGATE = """
    select e.task_index, count(*), sum(e.success), avg(r.value), max(e.iteration)
    from episodes e join rewards r on r.episode_id = e.id and r.label_set = ? and r.component = ?
    where e.run = ? and e.split = 'train' and e.status = 'ok' and e.stage not like ?
      and e.parent_episode_id is null {extra}
    group by e.task_index order by e.task_index
"""


def compute_task_stats(
    store: RunStore, label_set: str, *, before_iteration: int | None = None, tasks: list[int] | None = None
) -> list[TaskStats]:
    """The stats straight from the episodes and labels; `before_iteration` counts only GRPO
    iterations before it (what a draw for that iteration may know), `tasks` only those tasks."""
    extra = ""
    params: list[str | int] = [label_set, TOTAL, store.run, ANY_SUPERSEDED_LIKE]
    if before_iteration is not None:
        extra += " and e.iteration is not null and e.iteration < ?"
        params.append(before_iteration)
    if tasks is not None:
        # One JSON parameter, not one per task: a large task set would pass SQLite's parameter cap.
        extra += " and e.task_index in (select value from json_each(?))"
        params.append(json.dumps(tasks))
    rows = store.rundb.db.execute(_AGGREGATE.format(extra=extra), params).fetchall()
    return [TaskStats(t, n, int(s or 0), float(r), it) for t, n, s, r, it in rows]


def refresh_task_stats(store: RunStore, stage: str, label_set: str) -> int:
    """Recompute the stored stats of the tasks a stage played, from every episode of those tasks (a task
    with none left that counts, its episodes all superseded, loses its row); return how many tasks were
    updated. Idempotent: running it again changes nothing."""
    tasks = [
        t
        for (t,) in store.rundb.db.execute(
            "select distinct task_index from episodes where run = ? and stage = ? and split = 'train'",
            [store.run, stage],
        ).fetchall()
    ]
    if not tasks:
        return 0
    stats = compute_task_stats(store, label_set, tasks=tasks)
    with store.rundb.transaction() as db:
        gone = sorted(set(tasks) - {s.task_index for s in stats})
        db.execute(
            "delete from task_stats where run = ? and label_set = ? and task_index in (select value from json_each(?))",
            [store.run, label_set, json.dumps(gone)],
        )
        db.table("task_stats").upsert_all(
            [
                {
                    "run": store.run,
                    "label_set": label_set,
                    "task_index": s.task_index,
                    "attempts": s.attempts,
                    "successes": s.successes,
                    "reward_mean": s.reward_mean,
                    "last_iteration": s.last_iteration,
                    "updated_at": now(),
                }
                for s in stats
            ],
            pk=("run", "label_set", "task_index"),
            alter=False,
        )
    return len(stats)


def stored_task_stats(store: RunStore, label_set: str) -> list[TaskStats]:
    """The `task_stats` rows of a run, by task."""
    rows = store.rundb.db.execute(
        "select task_index, attempts, successes, reward_mean, last_iteration from task_stats "
        "where run = ? and label_set = ? order by task_index",
        [store.run, label_set],
    ).fetchall()
    return [TaskStats(*row) for row in rows]
