"""Preference pairs of a DPO stage (`dpo_pairs`), and the episodes they point at, with their turns."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlcli.store.db import RunDB, now
from rlcli.store.episodes import _episode, _turn
from rlcli.store.records import Episode
from rlcli.store.run_store import RunStore


@dataclass(frozen=True)
class PairRecord:
    """Two episodes of one group, the better one chosen; the pair's prompt is what they share
    before turn `turn_index`, where they first differ. Token counts describe the training example."""

    source_stage: str
    task_index: int
    chosen_episode_id: int
    rejected_episode_id: int
    turn_index: int
    chosen_reward: float
    rejected_reward: float
    prompt_tokens: int
    chosen_tokens: int
    rejected_tokens: int


def record_pairs(store: RunStore, stage: str, pairs: list[PairRecord]) -> None:
    """A stage's pairs, all in one transaction (a kill records all of them or none)."""
    with store.rundb.transaction() as db:
        db.table("dpo_pairs").insert_all(
            {"run": store.run, "stage": stage, **asdict(p), "created_at": now()} for p in pairs
        )


def stage_pairs(store: RunStore, stage: str) -> list[PairRecord]:
    """The pairs a stage recorded, in the order it recorded them."""
    rows = store.rundb.db.query("select * from dpo_pairs where run = ? and stage = ? order by id", [store.run, stage])
    fields = PairRecord.__dataclass_fields__
    return [PairRecord(**{k: v for k, v in row.items() if k in fields}) for row in rows]


def episodes_with_turns(rundb: RunDB, ids: list[int]) -> dict[int, Episode]:
    """Episodes by id, each with its turns."""
    out = {}
    for episode_id in dict.fromkeys(ids):
        row = next(rundb.db.query("select * from episodes where id = ?", [episode_id]))
        turns = [
            _turn(t)
            for t in rundb.db.query("select * from turns where episode_id = ? order by turn_index", [episode_id])
        ]
        out[episode_id] = _episode(row, turns)
    return out
