"""A distill phase's teacher logprobs, one float32 array per turn (the turn's sampled tokens, in order)."""

from __future__ import annotations

import json

from rlcli.store.blobs import pack_floats, unpack_floats
from rlcli.store.run_store import RunStore

TurnKey = tuple[int, int]  # (episode id, turn index)


def store_teacher_logprobs(store: RunStore, stage: str, scored: dict[TurnKey, list[float]]) -> None:
    """The teacher's logprobs of the turns `stage` (teach/<i>) scored; a turn scored again is replaced."""
    with store.rundb.transaction() as db:
        db.table("teacher_logprobs").upsert_all(
            (
                {"episode_id": episode, "turn_index": turn, "stage": stage, "logprobs": pack_floats(logprobs)}
                for (episode, turn), logprobs in scored.items()
            ),
            pk=("episode_id", "turn_index"),
        )


def teacher_logprobs(store: RunStore, episode_ids: list[int]) -> dict[TurnKey, list[float]]:
    """The stored teacher logprobs of these episodes' turns (turns never scored are absent)."""
    rows = store.rundb.db.execute(
        "select t.episode_id, t.turn_index, t.logprobs from teacher_logprobs t join episodes e on e.id = t.episode_id "
        "where e.run = ? and t.episode_id in (select value from json_each(?))",
        [store.run, json.dumps(episode_ids)],
    ).fetchall()
    return {(episode, turn): unpack_floats(blob) for episode, turn, blob in rows}
