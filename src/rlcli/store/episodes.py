"""Episodes, their turns and their reward labels: writing them, and the reads each caller needs."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from rlcli.errors import UsageError
from rlcli.store.blobs import pack_floats, pack_ids, unpack_floats, unpack_ids
from rlcli.store.db import RunDB
from rlcli.store.images import insert_images
from rlcli.store.names import (
    ANY_SUPERSEDED_LIKE,
    EXPERT,
    EvalStage,
    stale_stage,
    stale_stages_like,
    superseded_stage,
    superseded_stages_like,
    try_parse_stage,
)
from rlcli.store.records import EndReason, Episode, EpisodeSummary, LabelledEpisode, PlayedGame, RewardRow, Turn
from rlcli.store.run_store import RunStore

TOTAL = "total"  # the reward component that holds a label set's weighted sum


# --- writing ----------------------------------------------------------------------------------


def store_episodes(rundb: RunDB, episodes: list[Episode]) -> None:
    """Episodes with their turns, all in one transaction: a kill stores all of them or none."""
    with rundb.transaction() as db:
        for episode in episodes:
            row = asdict(episode)
            turns = row.pop("turns")
            insert_images(db, row.pop("images"))
            row.update(
                end_reason=episode.end_reason.value if episode.end_reason else None,
                success=int(episode.success),
                template_consistent=int(episode.template_consistent),
                transient=int(episode.transient),
                task=json.dumps(episode.task, default=str),
                messages=json.dumps(episode.messages, default=str),
            )
            episode_id = db.table("episodes").insert(row).last_pk
            db.table("turns").insert_all(
                {
                    **turn,
                    "episode_id": episode_id,
                    "prompt_ids": pack_ids(turn["prompt_ids"]),
                    "completion_ids": pack_ids(turn["completion_ids"]),
                    "logprobs": pack_floats(turn["logprobs"]),
                    "terminated": int(turn["terminated"]),
                    "truncated": int(turn["truncated"]),
                    "images": json.dumps(turn["images"]) if turn["images"] else None,
                }
                for turn in turns
            )


def set_aside_episodes(store: RunStore, stage: str, episode_ids: list[int]) -> str:
    """Move episodes out of `stage` into a stage of their own, stale/<stage>/<n>, kept with their turns
    and labels: asynchronous GRPO sets aside a rollout's episodes that are too stale to train on, so
    that the stage plays them again; return the new stage's name."""
    with store.rundb.transaction() as db:
        (earlier,) = db.execute(
            "select count(distinct stage) from episodes where run = ? and stage like ?",
            [store.run, stale_stages_like(stage)],
        ).fetchone()
        aside = stale_stage(stage, earlier + 1)
        # One JSON parameter, not one per episode: a large rollout would pass SQLite's parameter cap.
        db.execute(
            "update episodes set stage = ? where id in (select value from json_each(?))",
            [aside, json.dumps(episode_ids)],
        )
    return aside


def supersede_stage(store: RunStore, stage: str, stage_rows: list[str]) -> tuple[str, int]:
    """A GRPO resume redoes rollout `stage` from scratch (engine/grpo/resume.py, supersede_lost_rollouts), in one
    transaction: its episodes move, with their turns and labels, into superseded/<stage>/<n>, where nothing
    that trains or draws tasks reads them (ANY_SUPERSEDED_LIKE), and the rows of `stage_rows` (the stage and
    its label stages) are removed, so that each runs again as the first time, its tasks drawn again. Return
    the stage the episodes went to and how many they were."""
    with store.rundb.transaction() as db:
        (earlier,) = db.execute(
            "select count(distinct stage) from episodes where run = ? and stage like ?",
            [store.run, superseded_stages_like(stage)],
        ).fetchone()
        aside = superseded_stage(stage, earlier + 1)
        moved = db.execute(
            "update episodes set stage = ? where run = ? and stage = ?", [aside, store.run, stage]
        ).rowcount
        db.execute(
            "delete from stages where run = ? and name in (select value from json_each(?))",
            [store.run, json.dumps(stage_rows)],
        )
    return aside, moved


def set_aside_count(store: RunStore, stage: str) -> int:
    """How many of `stage`'s episodes were set aside as stale (set_aside_episodes)."""
    (count,) = store.rundb.db.execute(
        "select count(*) from episodes where run = ? and stage like ?", [store.run, stale_stages_like(stage)]
    ).fetchone()
    return count


def store_rewards(rundb: RunDB, rewards: list[RewardRow]) -> None:
    """Reward components; labelling a label set again replaces its values."""
    with rundb.transaction() as db:
        db.table("rewards").upsert_all(
            [asdict(r) for r in rewards], pk=("episode_id", "label_set", "component"), alter=False
        )


# --- reading ----------------------------------------------------------------------------------


def sampled_token_entropy(store: RunStore, stage: str) -> float | None:
    """The mean of -logprob over every token a stage's finished episodes sampled: an estimate of the
    entropy (nats a token) of the distribution they were sampled from, since turns record logprobs under
    the sampling temperature. None without tokens."""
    rows = store.rundb.db.execute(
        "select t.logprobs from turns t join episodes e on e.id = t.episode_id "
        "where e.run = ? and e.stage = ? and e.status = 'ok'",
        [store.run, stage],
    )
    total, count = 0.0, 0
    for (blob,) in rows.fetchall():
        values = unpack_floats(blob)
        total -= sum(values)
        count += len(values)
    return total / count if count else None


def stored_episode_keys(store: RunStore, stage: str) -> set[tuple[int, int]]:
    """(task_index, sample_index) of every episode a stage has stored."""
    rows = store.rundb.db.execute(
        "select task_index, sample_index from episodes where run = ? and stage = ?", [store.run, stage]
    )
    return {(t, s) for t, s in rows.fetchall()}


def stage_episodes(
    store: RunStore, stage: str, *, finished_only: bool = False, with_turns: bool = False
) -> list[Episode]:
    """A stage's episodes in the order they were stored; finished_only leaves out failed ones; with_turns
    reads their turns too."""
    status = " and status = 'ok'" if finished_only else ""
    rows = store.rundb.db.query(
        f"select * from episodes where run = ? and stage = ?{status} order by id", [store.run, stage]
    )
    if not with_turns:
        return [_episode(row) for row in rows]
    turns = "select * from turns where episode_id = ? order by turn_index"
    return [_episode(row, [_turn(t) for t in store.rundb.db.query(turns, [row["id"]])]) for row in rows]


def eval_games(store: RunStore) -> list[PlayedGame]:
    """Every finished game of the run's eval stages against an opponent (eval/<policy>/vs-<opponent>, and
    eval stages of games against opponents inside the env), scored from the player's zero-sum return.
    A game cut off before it ended (env.max_turns, the token cap) says nothing about who is stronger."""
    games = []
    rows = store.rundb.db.query(
        "select stage, task, env_return, end_reason from episodes where run = ? and stage like 'eval/%' "
        "and status = 'ok' order by id",
        [store.run],
    )
    for row in rows:
        stage, task = try_parse_stage(row["stage"]), json.loads(row["task"] or "{}")
        opponent = task.get("opponent") if isinstance(task, dict) else None
        if not isinstance(stage, EvalStage) or not isinstance(opponent, str) or opponent == stage.key:
            continue  # not a game, or a checkpoint against itself: no evidence of either's strength
        ret = row["env_return"]
        if ret == 0 and row["end_reason"] != EndReason.TERMINATED.value:
            continue
        games.append(PlayedGame(stage.key, opponent, 1.0 if ret > 0 else 0.0 if ret < 0 else 0.5))
    return games


def unlabelled_count(store: RunStore, stage: str, label_set: str) -> int:
    """How many of a stage's finished episodes have no total under `label_set`."""
    (count,) = store.rundb.db.execute(
        f"""select count(*) from episodes e where e.run = ? and e.stage = ? and e.status = 'ok' and not exists (
               select 1 from rewards r where r.episode_id = e.id and r.label_set = ? and r.component = '{TOTAL}')""",
        [store.run, stage, label_set],
    ).fetchone()
    return count


def stages_with_episodes(store: RunStore) -> list[str]:
    """The run's stages that stored episodes, in the order they first did."""
    return [
        stage
        for (stage,) in store.rundb.db.execute(
            "select stage from episodes where run = ? group by stage order by min(id)", [store.run]
        ).fetchall()
    ]


def episode_summary(store: RunStore, stage: str) -> EpisodeSummary:
    row = store.rundb.db.execute(
        """select count(*), sum(status = 'failed'), avg(env_return), avg(success), avg(num_turns), sum(num_tokens),
           sum(lost) from episodes where run = ? and stage = ?""",
        [store.run, stage],
    ).fetchone()
    return EpisodeSummary(
        episodes=row[0] or 0,
        failed=row[1] or 0,
        return_mean=row[2],
        success_rate=row[3],
        turns_mean=row[4],
        tokens=row[5] or 0,
        replayed_lost=row[6] or 0,
    )


def episode_counts(store: RunStore) -> tuple[int, int, int]:
    """(all, failed, replayed_lost) episodes of a run: the last counts the plays lost with a killed env
    worker and played again (episodes.lost), as rollout/replayed_lost does an iteration's."""
    total, failed, lost = store.rundb.db.execute(
        "select count(*), sum(status = 'failed'), sum(lost) from episodes where run = ?", [store.run]
    ).fetchone()
    return total or 0, failed or 0, lost or 0


def episodes_for_training(store: RunStore, stage: str, label_set: str) -> list[LabelledEpisode]:
    """A rollout stage's finished episodes that the label set labelled, with their turns, grouped
    by task (task_index, then sample_index) as GRPO's advantages need."""
    rows = store.rundb.db.query(
        """select e.*, r.value as total from episodes e
           join rewards r on r.episode_id = e.id and r.label_set = ? and r.component = ?
           where e.run = ? and e.stage = ? and e.status = 'ok' order by e.task_index, e.sample_index""",
        [label_set, TOTAL, store.run, stage],
    )
    return labelled_with_turns(store.rundb, rows, label_set)


def labelled_with_turns(rundb: RunDB, rows: Iterable[dict[str, Any]], label_set: str) -> list[LabelledEpisode]:
    """Episode rows that carry their `total` reward, as labelled episodes with their turns."""
    out = []
    for row in rows:
        total = row.pop("total")
        turns = [
            _turn(t)
            for t in rundb.db.query("select * from turns where episode_id = ? order by turn_index", [row["id"]])
        ]
        out.append(LabelledEpisode(_episode(row, turns), label_set, total))
    return out


def episodes_for_sft(store: RunStore) -> list[LabelledEpisode]:
    """A run's finished training episodes (eval episodes are held out, and superseded ones left out), each
    with the total of the newest label set that covers it, else its env return."""
    rows = store.rundb.db.query(
        """select e.*, coalesce(
               (select r.value from rewards r where r.episode_id = e.id and r.component = ?
                order by r.id desc limit 1),
               e.env_return, 0) as total
           from episodes e where e.run = ? and e.status = 'ok' and e.split = 'train' and e.stage not like ?
           order by e.id""",
        [TOTAL, store.run, ANY_SUPERSEDED_LIKE],
    )
    out = []
    for row in rows:
        total = row.pop("total")
        out.append(LabelledEpisode(_episode(row), None, total))
    return out


EpisodeOrder = Literal["newest", "best", "worst"]

# best and worst rank by the label set's total, then the env's return and success (which rank the
# unlabelled episodes of an eval stage), and among equals the newest first: a tie is the later policy's.
# Episodes without a total (failed or unlabelled) come after those with one, and failed ones last.
_ORDER_BY: dict[EpisodeOrder, str] = {
    "newest": "e.id desc",
    "best": "e.status = 'failed', total is null, total desc, e.env_return desc, e.success desc, e.id desc",
    "worst": "e.status = 'failed', total is null, total asc, e.env_return asc, e.success asc, e.id desc",
}


def labelled_episodes(
    store: RunStore,
    *,
    order: EpisodeOrder = "newest",
    iteration: int | None = None,
    stage: str | None = None,
    limit: int = 5,
    label_set: str | None = None,
) -> list[LabelledEpisode]:
    """Episodes with their reward components, ordered as _ORDER_BY says.

    Without a stage, the policy's episodes: the expert's demonstrations (sft/demos, eval/expert) are read by
    naming their stage, or where the run has no others. Without a label set, the one that labelled most of
    the chosen episodes is used.
    """
    store.require_run()
    where: list[str] = ["e.run = ?"]
    params: list[str | int] = [store.run]
    if stage is not None:
        where.append("e.stage = ?")
        params.append(stage)
    if iteration is not None:
        where.append("e.iteration = ?")
        params.append(iteration)
    if not _any_episode(store, where, params):
        raise UsageError(_no_episodes(store, stage, iteration))
    if stage is None and _any_episode(store, [*where, "e.policy != ?"], [*params, str(EXPERT)]):
        where.append("e.policy != ?")
        params.append(str(EXPERT))
    condition = " and ".join(where)

    label_sets = [
        name
        for name, _ in store.rundb.db.execute(
            f"select r.label_set, count(*) from rewards r join episodes e on e.id = r.episode_id "
            f"where {condition} and r.component = '{TOTAL}' group by r.label_set order by count(*) desc, r.label_set",
            params,
        ).fetchall()
    ]
    if label_set is not None and label_set not in label_sets:
        known = ", ".join(label_sets) or "none"
        raise UsageError(
            f"No rewards under label set {label_set!r} for these episodes of run {store.run!r}; label sets: {known}."
        )
    label_set = label_set or (label_sets[0] if label_sets else None)

    rows = list(
        store.rundb.db.query(
            f"select e.*, r.value as total from episodes e left join rewards r "
            f"on r.episode_id = e.id and r.label_set = ? and r.component = '{TOTAL}' "
            f"where {condition} order by {_ORDER_BY[order]} limit ?",
            [label_set, *params, limit],
        )
    )
    components: dict[int, dict[str, RewardRow]] = {row["id"]: {} for row in rows}
    if rows and label_set is not None:
        # The ids travel as one JSON parameter: one parameter each would pass SQLite's cap on a
        # query's parameters (32766, or 999 before 3.32) for `runs episodes -n 40000`.
        for r in store.rundb.db.query(
            "select * from rewards where label_set = ? and episode_id in (select value from json_each(?)) order by id",
            [label_set, json.dumps(list(components))],
        ):
            r.pop("id")
            components[r["episode_id"]][r["component"]] = RewardRow(**r)
    out = []
    for row in rows:
        total = row.pop("total")
        out.append(LabelledEpisode(_episode(row), label_set, total, components[row["id"]]))
    return out


def endpoint_calls(rundb: RunDB, episode_ids: list[int]) -> dict[int, list[dict[str, Any]]]:
    """An agent program's episodes' calls to the endpoint, in order: each turn's info (call, extends,
    follows, retokenised, finish_reason; engine/agent_runner.py) with its token counts. Episodes of envs
    have none and are left out."""
    calls: dict[int, list[dict[str, Any]]] = {}
    for start in range(0, len(episode_ids), 500):  # SQLite caps the number of parameters of one query
        part = episode_ids[start : start + 500]
        for row in rundb.db.query(
            # Token counts from the blobs' sizes: 4 bytes an id (store/blobs.py).
            f"select episode_id, info, length(prompt_ids) / 4 as prompt, length(completion_ids) / 4 as sampled "
            f"from turns where episode_id in ({', '.join('?' * len(part))}) order by episode_id, turn_index",
            part,
        ):
            info = json.loads(row["info"] or "{}")
            if isinstance(info, dict) and "call" in info:
                call = {**info, "prompt": row["prompt"], "sampled": row["sampled"]}
                calls.setdefault(row["episode_id"], []).append(call)
    return calls


def _any_episode(store: RunStore, where: list[str], params: list[str | int]) -> bool:
    condition = " and ".join(where)
    return store.rundb.db.execute(f"select 1 from episodes e where {condition} limit 1", params).fetchone() is not None


@dataclass(frozen=True)
class StageChoice:
    """The stage a `--stage` name chose: the name itself, the one stage it begins, or the newest of them."""

    stage: str
    matches: tuple[str, ...]  # the run's stages with episodes that the name begins, newest first


def choose_episode_stage(store: RunStore, name: str) -> StageChoice:
    """The stage with episodes that `name` means: that stage, else those whose name it begins at a part's
    end (eval -> eval/..., eval/base -> eval/base@t0.8-k1; eval/ckpt-2 is not eval/ckpt-25), the newest of
    them (the one whose episodes were stored last). A name that begins none is refused, with the stages."""
    store.require_run()
    stages = episode_stages_newest_first(store)
    if name in stages:
        return StageChoice(name, (name,))
    matches = tuple(s for s in stages if begins(name, s))
    if not matches:
        raise UsageError(_no_episodes(store, name, None))
    return StageChoice(matches[0], matches)


def begins(prefix: str, stage: str) -> bool:
    """Whether `prefix` is `stage` or begins it at the end of one of its parts (before / @ - +)."""
    rest = stage.removeprefix(prefix)
    return stage.startswith(prefix) and (not rest or not prefix or not rest[0].isalnum() or not prefix[-1].isalnum())


def episode_stages_newest_first(store: RunStore) -> list[str]:
    """The run's stages that stored episodes, the one that stored the last episode first."""
    return [
        stage
        for (stage,) in store.rundb.db.execute(
            "select stage from episodes where run = ? group by stage order by max(id) desc", [store.run]
        ).fetchall()
    ]


def _no_episodes(store: RunStore, stage: str | None, iteration: int | None) -> str:
    stages = stages_with_episodes(store)
    if not stages:
        return f"Run {store.run!r} has no episodes yet; run `rlcli rollout` or `rlcli train grpo` first."
    asked = [f"stage {stage!r}"] if stage else []
    if iteration is not None:
        asked.append(f"iteration {iteration}")
    return f"Run {store.run!r} has no episodes for {' and '.join(asked)}; stages with episodes: {', '.join(stages)}."


# --- rows -> records ------------------------------------------------------------------------


def _episode(row: dict[str, Any], turns: list[Turn] | None = None) -> Episode:
    return Episode(
        **{
            **row,
            "end_reason": EndReason(row["end_reason"]) if row["end_reason"] else None,
            "success": bool(row["success"]),
            "template_consistent": bool(row["template_consistent"]),
            "transient": bool(row["transient"]),
            "task": json.loads(row["task"] or "{}"),
            "messages": json.loads(row["messages"] or "[]"),
            "turns": turns or [],
        }
    )


def _turn(row: dict[str, Any]) -> Turn:
    return Turn(
        turn_index=row["turn_index"],
        prompt_ids=unpack_ids(row["prompt_ids"]),
        completion_ids=unpack_ids(row["completion_ids"]),
        logprobs=unpack_floats(row["logprobs"]),
        reward=row["reward"],
        text=row["text"],
        observation=row["observation"],
        terminated=bool(row["terminated"]),
        truncated=bool(row["truncated"]),
        info=row["info"],
        gen_time_s=row["gen_time_s"],
        env_time_s=row["env_time_s"],
        images=json.loads(row["images"]) if row.get("images") else [],
    )
