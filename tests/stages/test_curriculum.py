"""The task pool: per-task statistics from the episodes, `runs tasks`, and grpo.sampling
(sequential, uniform, curriculum), deterministic and reused on resume after kill -9."""

from __future__ import annotations

import json
import sqlite3
from collections import defaultdict

import numpy as np
import pytest

from helpers import cli, kill_when, make_ctx, run_in_process, write_recipe
from rlcli.engine.curriculum import choose_tasks, curriculum_weights, iteration_tasks, weighted_draw
from rlcli.errors import UsageError
from rlcli.recipe import load_recipe
from rlcli.store.db import now
from rlcli.store.episodes import store_episodes, store_rewards
from rlcli.store.records import EndReason, Episode, RewardRow
from rlcli.store.tasks import TaskStats, compute_task_stats, refresh_task_stats, stored_task_stats


def _store(ctx, stage, iteration, task, sample, success, reward, split="train", status="ok", label_set="grpo"):
    """One stored episode of `task` with its total reward under `label_set`; returns its id."""
    store_episodes(
        ctx.rundb,
        [
            Episode(
                id=None,
                run=ctx.run,
                stage=stage,
                iteration=iteration,
                split=split,
                task_index=task,
                sample_index=sample,
                seed=task,
                policy="base",
                status=status,
                end_reason=EndReason.TERMINATED,
                env_return=float(success),
                success=success,
                num_turns=1,
                num_tokens=1,
                task={},
                messages=[],
                template_consistent=True,
                error=None,
                created_at=now(),
            )
        ],
    )
    (episode_id,) = ctx.rundb.db.execute(
        "select id from episodes where run = ? and stage = ? and task_index = ? and sample_index = ?",
        [ctx.run, stage, task, sample],
    ).fetchone()
    if status == "ok":
        store_rewards(ctx.rundb, [RewardRow(episode_id, label_set, "total", reward, None)])
    return episode_id


# --- the recipe -----------------------------------------------------------------------------------


def test_the_pool_is_a_seed_range_below_the_held_out_seeds():
    recipe = load_recipe(None, ["env.tasks=[10, 50]", "grpo.sampling=curriculum"])
    assert recipe.env.tasks == [10, 50] and recipe.grpo.curriculum_floor == 0.05
    for overrides, message in [
        (["grpo.sampling=uniform"], "grpo.sampling uniform draws from a finite task pool; set env.tasks"),
        (["env.tasks=[5, 2]"], r"expected a seed range \[start, stop\]"),
        (["env.tasks=[1, 2, 3]"], r"expected a seed range \[start, stop\]"),
        (["env.tasks=[0, 100]", "env.eval_seed_start=50"], "reaches the held-out seeds"),
        (["env.tasks=[0, 4]", "rollout.tasks=8"], r"holds fewer tasks than rollout.tasks \(8\)"),
    ]:
        with pytest.raises(UsageError, match=message):
            load_recipe(None, overrides)


# --- statistics ------------------------------------------------------------------------------------


def test_stats_count_finished_labelled_train_episodes_only(tmp_path):
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml"), tmp_path / "runs")
    _store(ctx, "rollout/0", 0, 3, 0, True, 1.0)
    _store(ctx, "rollout/0", 0, 3, 1, False, 0.25)
    _store(ctx, "rollout/0", 0, 3, 2, True, 0.0, status="failed")  # failed: no attempt
    _store(ctx, "rollout/0", 0, 5, 0, False, 0.0)
    _store(ctx, "rollout/1", 1, 3, 0, True, 0.5)
    _store(ctx, "rollout/1", 1, 5, 0, True, 1.0, label_set="other")  # not GRPO's labels
    _store(ctx, "eval/base", None, 3, 0, True, 1.0, split="eval")  # held-out
    assert refresh_task_stats(ctx.store, "rollout/0", "grpo") == 2
    refresh_task_stats(ctx.store, "rollout/1", "grpo")
    assert stored_task_stats(ctx.store, "grpo") == [
        TaskStats(3, 3, 2, pytest.approx(1.75 / 3), 1),
        TaskStats(5, 1, 0, 0.0, 0),
    ]
    # What an iteration's draw may know: only the iterations before it.
    assert compute_task_stats(ctx.store, "grpo", before_iteration=1) == [
        TaskStats(3, 2, 1, pytest.approx(0.625), 0),
        TaskStats(5, 1, 0, 0.0, 0),
    ]
    # Recomputed, not incremented: refreshing again changes nothing.
    refresh_task_stats(ctx.store, "rollout/0", "grpo")
    assert stored_task_stats(ctx.store, "grpo")[0].attempts == 3


def test_grpo_keeps_stats_that_match_its_episodes_and_runs_tasks_shows_them(tmp_path, capsys, monkeypatch):
    recipe = write_recipe(
        tmp_path / "r.yaml", env={"name": "arithmetic", "tasks": [0, 5]}, grpo={"iterations": 3, "sampling": "uniform"}
    )
    runs = tmp_path / "runs"
    monkeypatch.setenv("RLCLI_HOME", str(runs))
    assert cli(capsys, "train", "grpo", "-r", recipe)[0] == 0

    ctx = make_ctx(recipe, runs)
    by_task: dict[int, list] = defaultdict(list)
    for stage in ("rollout/0", "rollout/1", "rollout/2"):
        for row in ctx.rundb.db.query(
            "select e.task_index, e.success, e.iteration, r.value from episodes e join rewards r "
            "on r.episode_id = e.id and r.label_set = 'grpo' and r.component = 'total' "
            "where e.stage = ? and e.status = 'ok'",
            [stage],
        ):
            by_task[row["task_index"]].append(row)
    expected = [
        TaskStats(
            task,
            len(rows),
            sum(r["success"] for r in rows),
            pytest.approx(sum(r["value"] for r in rows) / len(rows)),
            max(r["iteration"] for r in rows),
        )
        for task, rows in sorted(by_task.items())
    ]
    assert stored_task_stats(ctx.store, "grpo") == expected
    assert sum(s.attempts for s in expected) == 3 * 2 * 2  # 3 iterations of 2 tasks x 2 samples

    code, out, err = cli(capsys, "runs", "tasks", "t", "--json")
    assert code == 0, err
    view = json.loads(out)
    assert [r["task"] for r in view["tasks"]] == sorted(by_task)
    assert view["summary"]["attempts"] == 12 and sum(view["summary"]["bins"].values()) == len(by_task)
    code, out, _ = cli(capsys, "runs", "tasks", "t")
    assert code == 0 and "success rate" in out and "never solved" in out
    code, _, err = cli(capsys, "runs", "tasks", "nobody")
    assert code == 2 and "No run named 'nobody'" in err


# --- sampling ------------------------------------------------------------------------------------


def test_sequential_is_the_fixed_order_and_cycles_through_a_pool(tmp_path):
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml", rollout={"tasks": 3}), tmp_path / "runs")
    assert [choose_tasks(ctx, it) for it in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]
    ctx.recipe.env.tasks = [10, 14]
    assert [choose_tasks(ctx, it) for it in range(3)] == [[10, 11, 12], [13, 10, 11], [12, 13, 10]]


def test_sequential_grpo_records_the_tasks_it_played(tmp_path):
    from rlcli.engine.grpo.loop import run_grpo

    ctx = make_ctx(write_recipe(tmp_path / "r.yaml", grpo={"iterations": 2}), tmp_path / "runs")
    run_grpo(ctx)
    for it, tasks in enumerate([[0, 1], [2, 3]]):
        assert ctx.rundb.stage(ctx.run, f"rollout/{it}").params["tasks"] == tasks
        played = {
            t for (t,) in ctx.rundb.db.execute("select task_index from episodes where stage = ?", [f"rollout/{it}"])
        }
        assert played == set(tasks)


def test_uniform_draws_are_seeded_distinct_and_inside_the_pool(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "arithmetic", "tasks": [100, 140]},
        rollout={"tasks": 8},
        grpo={"sampling": "uniform"},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    draws = [choose_tasks(ctx, it) for it in range(20)]
    assert draws == [choose_tasks(ctx, it) for it in range(20)]
    assert all(len(set(d)) == 8 and all(100 <= t < 140 for t in d) for d in draws)
    assert len({tuple(d) for d in draws}) == 20
    # Every task of the pool comes up, roughly as often as any other (160 draws of 40 tasks).
    counts = np.bincount([t - 100 for d in draws for t in d], minlength=40)
    assert counts.min() >= 1 and counts.max() <= 12
    ctx.recipe.run.seed = 1
    assert choose_tasks(ctx, 0) != draws[0]


def test_curriculum_weights_favour_tasks_solved_about_half_the_time():
    stats = [
        TaskStats(0, 4, 2, 0.5, 0),
        TaskStats(1, 8, 8, 1.0, 1),
        TaskStats(2, 8, 0, 0.0, 1),
        TaskStats(3, 4, 4, 1, 0),
    ]
    w = curriculum_weights(stats, 0, 5, floor=0.05)
    assert w[0] == pytest.approx(1.0) and w[4] == pytest.approx(1.0)  # half solved, and unseen
    rare = pytest.approx(4 * (8.5 / 9) * (0.5 / 9))
    assert w[1] == rare and w[2] == rare  # solved, or failed, 8 times out of 8: rarely
    assert w[1] < w[3] < w[0]  # 4 of 4 is less sure than 8 of 8
    assert curriculum_weights(stats, 0, 5, floor=0.5)[1] == 0.5


def test_weighted_draw_follows_the_weights():
    weights = np.array([1.0, 0.05, 0.05, 1.0, 0.5])
    picks = np.bincount([weighted_draw(weights, 1, seed, 0)[0] for seed in range(2000)], minlength=5) / 2000
    expected = weights / weights.sum()
    assert np.abs(picks - expected).max() < 0.04, picks
    assert sorted(weighted_draw(weights, 5, 7, 10)) == [10, 11, 12, 13, 14]


def test_curriculum_uses_the_iterations_before_and_a_recorded_draw_wins(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "arithmetic", "tasks": [0, 6]},
        rollout={"tasks": 2},
        grpo={"sampling": "curriculum", "curriculum_floor": 0.01},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    # Tasks 0-3 always solved, task 4 half the time, task 5 never played: 4 and 5 get the weight.
    for task in range(5):
        for sample in range(8):
            _store(ctx, "rollout/0", 0, task, sample, task < 4 or sample % 2 == 0, 1.0)
    shares = np.bincount([t for it in range(1, 201) for t in choose_tasks(ctx, it)], minlength=6) / 200
    # Expected: about 0.68 of the draws hold task 4 (or 5), 0.16 one of tasks 0-3.
    assert shares[4:].min() > 0.55 and shares[:4].max() < 0.25, shares
    before = choose_tasks(ctx, 1)
    # Episodes of iteration 1 itself (as after a kill during its rollout) do not change its draw.
    for sample in range(8):
        _store(ctx, "rollout/1", 1, 5, sample, True, 1.0)
    assert choose_tasks(ctx, 1) == before
    assert iteration_tasks(ctx, 1) == before
    ctx.rundb.mark_stage(ctx.run, "rollout/1", "running", params={"iteration": 1, "tasks": [3, 0]})
    assert iteration_tasks(ctx, 1) == [3, 0]


def test_a_killed_curriculum_run_resumes_with_the_same_tasks(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "arithmetic", "tasks": [0, 12]},
        rollout={"tasks": 3, "group_size": 2, "batch_size": 2},
        grpo={"iterations": 3, "sampling": "curriculum"},
    )
    args = ["train", "grpo", "-r", str(recipe)]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    done = run_in_process(args, straight)
    assert done.returncode == 0, done.stderr
    # Killed in the middle of iteration 1's rollout: its draw is recorded, its episodes partly stored.
    count = kill_when(args, killed, "select count(*) from episodes where stage = 'rollout/1'", 2)
    assert 2 <= count < 6
    done = run_in_process(args, killed)  # the resume: a new run of the command, in this process
    assert done.returncode == 0, done.stderr

    def played(runs):
        with sqlite3.connect(runs / "rlcli.db") as conn:
            rows = conn.execute("select name, params from stages where name like 'rollout/%' order by name")
            return [(name, json.loads(params)["tasks"]) for name, params in rows]

    assert played(killed) == played(straight)
    assert len(played(straight)) == 3
