"""kill -9 during a vision-language model's rollout (tiny-random-vlm on gui_click), then the same
command again: the result equals an uninterrupted rollout, token ids, logprobs and screenshots alike."""

from __future__ import annotations

import json
import sqlite3

from helpers import kill_when, run_in_process, write_recipe

EPISODES = (
    "select e.id, e.task_index, e.sample_index, e.seed, e.status, e.end_reason, e.env_return, e.num_turns, "
    "e.messages from episodes e where e.stage = 'rollout' order by e.task_index, e.sample_index"
)
TURNS = (
    "select e.task_index, e.sample_index, t.turn_index, t.prompt_ids, t.completion_ids, t.logprobs, t.images, "
    "t.text, t.reward from episodes e join turns t on t.episode_id = e.id order by 1, 2, 3"
)
IMAGES = "select sha256, png, width, height from images order by sha256"


def query(runs, sql: str) -> list[tuple]:
    with sqlite3.connect(runs / "rlcli.db") as conn:
        return conn.execute(sql).fetchall()


def test_kill_during_vlm_rollout_resumes_to_the_uninterrupted_result(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        model={"name": "tiny-random-vlm", "max_length": 1024},
        env={"name": "gui_click", "kwargs": {"width": 112, "height": 112, "buttons": 2, "attempts": 2}}
        | {"max_turns": 2, "keep_images": "all"},
        # batch_size 1: 12 chunks, each its own commit, so the kill lands mid-rollout even on a fast machine.
        rollout={"tasks": 6, "group_size": 2, "max_new_tokens": 6, "batch_size": 1, "temperature": 1.0},
    )
    runs, clean = tmp_path / "runs", tmp_path / "clean"
    args = ["rollout", "-r", str(recipe), "--policy", "base"]

    stored = kill_when(args, runs, "select count(*) from episodes", 3)
    assert 0 < stored < 12, "the kill must land mid-rollout"
    resumed = run_in_process(args, runs)
    assert resumed.returncode == 0, resumed.stderr
    assert run_in_process(args, clean).returncode == 0

    episodes = query(runs, EPISODES)
    keys = [(task, sample) for _, task, sample, *_ in episodes]
    assert len(keys) == len(set(keys)) == 12
    assert episodes == query(clean, EPISODES)
    turns = query(runs, TURNS)
    # The random policy misses, so each episode shows a second screenshot: every turn has its images.
    assert len(turns) == 24 and all(json.loads(images) for *_, images, _, _ in turns)
    assert turns == query(clean, TURNS)
    # The same screenshots, each stored once, and none left behind by the killed chunk.
    images = query(runs, IMAGES)
    assert images == query(clean, IMAGES)
    referenced = {sha for (row,) in query(runs, "select images from turns") for sha in json.loads(row)}
    assert {sha for sha, *_ in images} == referenced
