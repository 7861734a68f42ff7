"""Where a run's time went, as its turns recorded it: generation and env-step seconds per stage.

Stage durations are the stages' own rows (Stage.duration_s) and the perf/ metrics are RunDB.metrics;
this module adds the one sum that needs a join, the turns' times by their episodes' stage.
"""

from __future__ import annotations

from dataclasses import dataclass

from rlcli.store.run_store import RunStore


@dataclass(frozen=True)
class TurnTimes:
    """The summed seconds of one stage's turns (every attempt stored under the stage)."""

    turns: int
    gen_s: float  # turns.gen_time_s: each batched sampling call's time, shared among the episodes in it
    env_s: float  # turns.env_time_s: the env step after each turn (resets are not timed per turn)


def turn_times(store: RunStore) -> dict[str, TurnTimes]:
    """Per stage of `run` that has episodes with turns: its turns' count, generation and env-step seconds."""
    rows = store.rundb.db.execute(
        "select e.stage, count(*), coalesce(sum(t.gen_time_s), 0), coalesce(sum(t.env_time_s), 0) "
        "from episodes e join turns t on t.episode_id = e.id where e.run = ? group by e.stage",
        [store.run],
    ).fetchall()
    return {stage: TurnTimes(int(n), float(gen), float(env)) for stage, n, gen, env in rows}
