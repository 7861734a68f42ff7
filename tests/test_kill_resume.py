"""kill -9 during `rlcli label` and `rlcli eval`, then the same command again: it resumes, nothing is
duplicated or lost. (Rollout, SFT and GRPO have theirs in their own test files.)"""

from __future__ import annotations

import sqlite3

from helpers import kill_when, run_cli, write_recipe


def query(runs, sql: str) -> list[tuple]:
    with sqlite3.connect(runs / "rlcli.db") as conn:
        return conn.execute(sql).fetchall()


def test_kill_during_label_resumes_without_duplicates(tmp_path):
    # A reward function slow enough for the kill to land between two stages' labels.
    (tmp_path / "slow.py").write_text(
        "import time\n\ndef slow(completions, **kwargs):\n    time.sleep(1.5)\n    return [float(len(c)) for c in completions]\n"
    )
    recipe = write_recipe(
        tmp_path / "r.yaml", rewards=[{"fn": "env_return"}, {"fn": f"{tmp_path}/slow.py:slow", "name": "slow"}]
    )
    runs = tmp_path / "runs"
    for stage in ("a", "b", "c"):
        assert run_cli(["rollout", "-r", str(recipe), "--policy", "base", "--stage", stage], runs).returncode == 0

    labelled = kill_when(
        ["label", "-r", str(recipe), "--label-set", "v1"],
        runs,
        "select count(*) from stages where name like 'label/%' and status = 'done'",
        1,
    )
    assert 1 <= labelled < 3, "the kill must land between the stages' labels"
    done = run_cli(["label", "-r", str(recipe), "--label-set", "v1"], runs)
    assert done.returncode == 0, done.stderr

    # Every episode of every stage has each component and the total exactly once.
    counts = query(
        runs, "select component, count(*), count(distinct episode_id) from rewards group by component order by 1"
    )
    assert counts == [("env_return", 12, 12), ("slow", 12, 12), ("total", 12, 12)]
    assert query(runs, "select count(*) from stages where name like 'label/%' and status = 'done'") == [(3,)]


def test_kill_during_eval_resumes_to_the_same_result(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "guess_number", "max_turns": 3},
        rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 12, "batch_size": 4},
        eval={"tasks": 16, "k": 2, "temperature": 1.0},
    )
    runs, clean = tmp_path / "runs", tmp_path / "clean"
    args = ["eval", "-r", str(recipe), "-c", "base"]

    stored = kill_when(args, runs, "select count(*) from episodes where stage = 'eval/base@t1-k2'", 4)
    assert 0 < stored < 32, "the kill must land mid-evaluation"
    assert query(runs, "select count(*) from evals") == [(0,)]
    resumed = run_cli(args, runs)
    assert resumed.returncode == 0, resumed.stderr
    assert run_cli(args, clean).returncode == 0

    keys = query(runs, "select task_index, sample_index from episodes where stage = 'eval/base@t1-k2'")
    assert len(keys) == len(set(keys)) == 32
    same = (
        "select e.task_index, e.sample_index, t.turn_index, t.completion_ids from episodes e "
        "join turns t on t.episode_id = e.id order by 1, 2, 3"
    )
    assert query(runs, same) == query(clean, same)
    result = "select stage, tasks, k, success_rate, pass_at_k, mean_return, mean_tokens from evals"
    assert query(runs, result) == query(clean, result)
    assert len(query(runs, result)) == 1
