"""grpo.replay: stored successful episodes that join a later iteration's group, and the record of it.

A replayed episode stays where it was stored (its stage, turns and labels); the `replays` table says
which GRPO iteration trained on it again. Rows are upserted, so an iteration redone after a kill
records the same replays once.
"""

from __future__ import annotations

from rlcli.store.db import now
from rlcli.store.episodes import TOTAL, labelled_with_turns
from rlcli.store.names import ANY_SUPERSEDED_LIKE
from rlcli.store.records import LabelledEpisode
from rlcli.store.run_store import RunStore


def replay_candidates(
    store: RunStore, task_index: int, before_iteration: int, label_set: str, min_reward: float, limit: int
) -> list[LabelledEpisode]:
    """Up to `limit` finished training episodes of a task from GRPO iterations before `before_iteration`
    whose total under the label set is at least `min_reward`, best first (the newest among equals),
    with their turns; never one a GRPO resume superseded (played with weights it recomputed)."""
    rows = store.rundb.db.query(
        """select e.*, r.value as total from episodes e
           join rewards r on r.episode_id = e.id and r.label_set = ? and r.component = ?
           where e.run = ? and e.task_index = ? and e.split = 'train' and e.status = 'ok'
             and e.iteration is not null and e.iteration < ? and r.value >= ? and e.stage not like ?
           order by r.value desc, e.id desc limit ?""",
        [label_set, TOTAL, store.run, task_index, before_iteration, min_reward, ANY_SUPERSEDED_LIKE, limit],
    )
    return labelled_with_turns(store.rundb, rows, label_set)


def record_replays(store: RunStore, iteration: int, episodes: list[tuple[int, int]]) -> None:
    """Record that GRPO iteration `iteration` trained again on these (episode id, task index)."""
    rows = [
        {"run": store.run, "iteration": iteration, "episode_id": e, "task_index": t, "created_at": now()}
        for e, t in episodes
    ]
    if rows:
        store.rundb.db.table("replays").upsert_all(rows, pk=("run", "iteration", "episode_id"), alter=False)


def replays(store: RunStore) -> list[tuple[int, int, int]]:
    """(iteration, episode id, task index) of every replay of a run, in iteration order."""
    return [
        (r["iteration"], r["episode_id"], r["task_index"])
        for r in store.rundb.db.query(
            "select iteration, episode_id, task_index from replays where run = ? order by iteration, episode_id",
            [store.run],
        )
    ]
