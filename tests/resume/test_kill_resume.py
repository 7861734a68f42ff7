"""kill -9 during `rlcli label` and `rlcli eval`, then the same command again: it resumes, nothing is
duplicated or lost. (Rollout, SFT and GRPO have theirs in their own test files.)"""

from __future__ import annotations

import sqlite3

from helpers import kill_when, run_in_process, write_recipe


def query(runs, sql: str) -> list[tuple]:
    with sqlite3.connect(runs / "rlcli.db") as conn:
        return conn.execute(sql).fetchall()


def test_kill_during_label_resumes_without_duplicates(tmp_path):
    # A second reward component. (It used to sleep, so that a poll would see one stage labelled before
    # the next: kill_when now stops the command there.)
    (tmp_path / "chars.py").write_text(
        "def chars(completions, **kwargs):\n    return [float(len(c)) for c in completions]\n"
    )
    recipe = write_recipe(
        tmp_path / "r.yaml", rewards=[{"fn": "env_return"}, {"fn": f"{tmp_path}/chars.py:chars", "name": "chars"}]
    )
    runs = tmp_path / "runs"
    for stage in ("a", "b", "c"):  # the episodes to label (in this process: not what is tested)
        done = run_in_process(["rollout", "-r", str(recipe), "--policy", "base", "--stage", stage], runs)
        assert done.returncode == 0, done.stderr

    labelled = kill_when(
        ["label", "-r", str(recipe), "--label-set", "v1"],
        runs,
        "select count(*) from stages where name like 'label/%' and status = 'done'",
        1,
    )
    assert labelled == 1, "the kill must land between the stages' labels"
    done = run_in_process(["label", "-r", str(recipe), "--label-set", "v1"], runs)  # the resume
    assert done.returncode == 0, done.stderr

    # Every episode of every stage has each component and the total exactly once.
    counts = query(
        runs, "select component, count(*), count(distinct episode_id) from rewards group by component order by 1"
    )
    assert counts == [("chars", 12, 12), ("env_return", 12, 12), ("total", 12, 12)]
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
    done = run_in_process(args, runs)  # the resume, and the run without a kill: in this process
    assert done.returncode == 0, done.stderr
    done = run_in_process(args, clean)
    assert done.returncode == 0, done.stderr

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
