"""grpo.dynamic_sampling (DAPO): over-sampling in one rollout (grpo.oversample), informative groups first,
the unused ones carried to the next iteration (grpo.carry_staleness), extra rollout rounds until rollout.tasks
groups have unequal rewards (grpo.max_rollout_rounds); the batch trained on, the metrics, and the same
tasks and batches after kill -9."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

import pytest

from helpers import kill_when, make_ctx, run_in_process, write_env_file, write_recipe
from rlcli.engine.curriculum import extra_tasks
from rlcli.engine.grpo.selection import informative, training_batch
from rlcli.errors import UsageError
from rlcli.recipe import load_recipe
from rlcli.store.records import Episode, LabelledEpisode, Turn

# Tasks 0, 3, 6, ... always score 0 (a zero-variance group); the others score the parity of the answer's characters.
SOME_FLAT_ENV = """
class SomeFlat:
    def reset(self, seed):
        self.seed = seed
        return f"Task {seed}: say a word.", {"task": {"seed": seed}}
    def step(self, action):
        reward = 0.0 if self.seed % 3 == 0 else float(sum(map(ord, action)) % 2)
        return "Done.", reward, True, False, {"success": reward > 0}

def make_env():
    return SomeFlat()
"""


def test_dynamic_sampling_is_refused_with_asynchronous_rollouts():
    with pytest.raises(UsageError, match="grpo.dynamic_sampling needs the synchronous loop"):
        load_recipe(None, ["grpo.dynamic_sampling=true", "grpo.max_staleness=1"])
    cfg = load_recipe(None, ["grpo.dynamic_sampling=true"]).grpo
    assert (cfg.oversample, cfg.carry_staleness, cfg.max_rollout_rounds) == (2.0, 1, 1)


def _labelled(task: int, sample: int, reward: float, turns: int = 0) -> LabelledEpisode:
    """An episode of `turns` turns whose last earns `reward` (no turns: only the labelled total)."""
    blank = Episode(**{f: None for f in Episode.__dataclass_fields__})
    played = [Turn(i, [], [], [], reward=reward if i == turns - 1 else 0.0) for i in range(turns)]
    return LabelledEpisode(replace(blank, task_index=task, sample_index=sample, turns=played), "grpo", reward)


def test_the_batch_takes_informative_groups_first_in_draw_order():
    rewards = {5: [0, 0], 2: [0, 1], 9: [1, 1], 4: [1, 0], 7: [0, 1]}
    episodes = [_labelled(t, s, r) for t, rs in rewards.items() for s, r in enumerate(rs)]
    assert [e.episode.task_index for e in training_batch(episodes, 2, None)] == [2, 2, 4, 4]
    # Short of informative groups after the cap: zero-variance ones fill the rest, in draw order.
    assert {e.episode.task_index for e in training_batch(episodes, 4, None)} == {2, 4, 7, 5}


def test_with_a_discount_wins_of_different_lengths_are_an_informative_group():
    # Task 3: two wins, in 1 and 3 turns; task 8: one win and one loss. With grpo.gamma the advantages come
    # from the discounted returns, where task 3's wins differ: the batch must judge groups the same way.
    episodes = [_labelled(3, 0, 1.0, turns=1), _labelled(3, 1, 1.0, turns=3)]
    episodes += [_labelled(8, 0, 1.0, turns=2), _labelled(8, 1, 0.0, turns=2)]
    assert informative(episodes[:2], 0.9) and not informative(episodes[:2], None)
    assert [e.episode.task_index for e in training_batch(episodes, 1, 0.9)] == [3, 3]  # the first drawn
    assert [e.episode.task_index for e in training_batch(episodes, 1, None)] == [8, 8]


def test_extra_tasks_continue_the_sequence_or_draw_unplayed_ones(tmp_path):
    seq = make_ctx(write_recipe(tmp_path / "a.yaml", rollout={"tasks": 3}), tmp_path / "a")
    assert extra_tasks(seq, 1, 1, [3, 4, 5], 2) == [6, 7]
    assert extra_tasks(seq, 1, 2, [3, 4, 5, 6, 7], 4) == [8, 9, 10, 11]
    pooled = make_ctx(write_recipe(tmp_path / "b.yaml", env={"name": "arithmetic", "tasks": [0, 5]}), tmp_path / "b")
    assert extra_tasks(pooled, 2, 1, [4, 0], 5) == [1, 2, 3]  # wraps around the pool, once
    uniform = make_ctx(
        write_recipe(tmp_path / "c.yaml", env={"name": "arithmetic", "tasks": [0, 20]}, grpo={"sampling": "uniform"}),
        tmp_path / "c",
    )
    drawn = extra_tasks(uniform, 3, 1, [1, 2, 3], 5)
    assert len(set(drawn)) == 5 and not set(drawn) & {1, 2, 3} and all(0 <= t < 20 for t in drawn)
    assert extra_tasks(uniform, 3, 1, [1, 2, 3], 5) == drawn  # seeded by (run seed, iteration, round)
    assert extra_tasks(uniform, 3, 2, [1, 2, 3], 5) != drawn


def _rounds(runs, recipe):
    """Per iteration: its rollout stages' (name, recorded tasks), each group's rewards, its metrics."""
    ctx = make_ctx(recipe, runs)
    stages = sorted(
        (s for s in ctx.rundb.stages(ctx.run) if s.name.startswith("rollout/")),
        key=lambda s: (s.params["iteration"], s.params.get("round", 0)),
    )
    out = defaultdict(lambda: {"stages": [], "groups": defaultdict(list)})
    for s in stages:
        it = s.params["iteration"]
        out[it]["stages"].append((s.name, s.params["tasks"]))
        for row in ctx.rundb.db.query(
            "select e.task_index, r.value from episodes e join rewards r on r.episode_id = e.id "
            "and r.label_set = 'grpo' and r.component = 'total' where e.run = ? and e.stage = ? and e.status = 'ok'",
            [ctx.run, s.name],
        ):
            out[it]["groups"][row["task_index"]].append(row["value"])
    metrics = defaultdict(dict)
    for row in ctx.rundb.db.query("select step, key, value from metrics where run = ? and stage = 'grpo'", [ctx.run]):
        metrics[row["step"]][row["key"]] = row["value"]
    return {it: {**v, "metrics": metrics[it]} for it, v in out.items()}


def test_dynamic_sampling_refills_to_the_target_and_resumes_the_same_after_kill(tmp_path):
    env_file = write_env_file(tmp_path / "some_flat.py", SOME_FLAT_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "max_turns": 1},
        rollout={"tasks": 3, "group_size": 4, "max_new_tokens": 6, "batch_size": 18},
        grpo={
            "iterations": 2,
            "dynamic_sampling": True,
            "oversample": 1,
            "carry_staleness": 0,
            "max_rollout_rounds": 4,
        },
    )
    runs = tmp_path / "runs"
    result = run_in_process(["train", "grpo", "-r", str(recipe)], runs)
    assert result.returncode == 0, result.stderr
    played = _rounds(runs, recipe)
    assert sorted(played) == [0, 1]
    for it, record in played.items():
        informative = [t for t, rs in record["groups"].items() if len(set(rs)) > 1]
        names = [name for name, _ in record["stages"]]
        assert names == [f"rollout/{it}"] + [f"rollout/{it}+{r}" for r in range(1, len(names))]
        # Round 0's task 0 or 3 is flat, so a refill is always needed; each round adds the shortfall, of unplayed tasks.
        assert len(names) >= 2
        before = set(record["stages"][0][1])
        for _, tasks in record["stages"][1:]:
            done_before = {t for t in record["groups"] if t in before}
            short = 3 - len([t for t in informative if t in done_before])
            assert len(tasks) == short > 0 and not set(tasks) & before
            before |= set(tasks)
        # It stopped at the target or at the cap.
        assert len(informative) >= 3 or len(names) == 4
        m = record["metrics"]
        assert m["train/groups_drawn"] == len(record["groups"]) == sum(len(t) for _, t in record["stages"])
        assert m["train/rollout_rounds"] == len(names)
        assert m["train/groups"] == 3
        assert m["train/zero_var_groups"] == max(0, 3 - len(informative))
        trained = [t for t in record["groups"] if t in informative][:3]
        rewards = [r for t in trained for r in record["groups"][t]]
        if len(trained) == 3:
            assert m["rollout/reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert any(len(r["stages"]) < 4 for r in played.values()), "no iteration reached the target: weak test"

    # kill -9 during the first extra round; the resumed run draws the same extra tasks, ends the same.
    killed = tmp_path / "killed"
    count = kill_when(
        ["train", "grpo", "-r", str(recipe)],
        killed,
        "select count(*) from episodes where stage = 'rollout/0+1'",
        at_least=1,
    )
    assert count >= 1
    result = run_in_process(["train", "grpo", "-r", str(recipe)], killed)
    assert result.returncode == 0, result.stderr
    resumed = _rounds(killed, recipe)
    for it in (0, 1):
        assert resumed[it]["stages"] == played[it]["stages"]
        assert resumed[it]["groups"] == played[it]["groups"]
        for key in ("train/groups_drawn", "train/rollout_rounds", "train/zero_var_groups", "rollout/reward_mean"):
            assert resumed[it]["metrics"][key] == played[it]["metrics"][key]
        assert resumed[it]["metrics"]["train/loss"] == pytest.approx(played[it]["metrics"]["train/loss"], abs=1e-5)


def test_groups_carried_from_another_iteration_are_groups_of_their_own():
    from rlcli.engine.grpo.batch import role_groups

    episodes = [_labelled(7, s, r) for s, r in enumerate([0, 1, 0, 1])]
    assert role_groups(episodes).tolist() == [0, 0, 0, 0]
    # The first two played task 7 at iteration 3 (carried), the others at iteration 4.
    assert role_groups(episodes, [3, 3, 4, 4]).tolist() == [0, 0, 1, 1]


def _trained(runs, recipe):
    """Per iteration: (its recorded tasks, the groups its train stage trained on, its metrics)."""
    ctx = make_ctx(recipe, runs)
    out = {}
    for it in range(ctx.recipe.grpo.iterations):
        rollout = ctx.rundb.stage(ctx.run, f"rollout/{it}")
        train = ctx.rundb.stage(ctx.run, f"train/{it}")
        assert rollout is not None and train is not None and train.status == "done"
        out[it] = (rollout.params["tasks"], [tuple(g) for g in train.result["trained_groups"]], train.result)
    return ctx, out


def test_over_sampling_trains_informative_groups_and_carries_the_rest_once(tmp_path):
    from rlcli.engine.grpo.batch import build_batch
    from rlcli.engine.grpo.selection import choose_groups

    env_file = write_env_file(tmp_path / "some_flat.py", SOME_FLAT_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "max_turns": 1, "tasks": [0, 40]},
        rollout={"tasks": 2, "group_size": 4, "max_new_tokens": 6, "batch_size": 20},
        grpo={"iterations": 6, "dynamic_sampling": True, "oversample": 2.5, "sampling": "uniform"},
    )
    runs = tmp_path / "runs"
    result = run_in_process(["train", "grpo", "-r", str(recipe)], runs)
    assert result.returncode == 0, result.stderr
    ctx, trained = _trained(runs, recipe)
    played = _rounds(runs, recipe)
    # One rollout stage per iteration, of 5 tasks: the over-sampling is in the one generation pass.
    assert all(len(played[it]["stages"]) == 1 and len(played[it]["stages"][0][1]) == 5 for it in played)

    def informative(it):
        return [t for t in played[it]["stages"][0][1] if len(set(played[it]["groups"][t])) > 1]

    seen, carried_total = set(), 0
    for it, (_, groups, stats) in trained.items():
        assert not set(groups) & seen, "a group was trained on twice"
        seen |= set(groups)
        carried = [(j, t) for j, t in groups if j != it]
        # Only from the iteration before (grpo.carry_staleness 1), informative, left over by it.
        assert all(j == it - 1 and t in informative(j) and (j, t) not in trained[j][1] for j, t in carried)
        left_over = [(it - 1, t) for t in informative(it - 1) if (it - 1, t) not in trained[it - 1][1]] if it else []
        own = [(it, t) for t in informative(it)]
        # The iteration's own informative groups first, in draw order; carried ones fill what they leave short.
        assert sorted(groups) == sorted((own + left_over)[:2]) or len(own + left_over) < 2
        assert stats["train/carried"] == len(carried)
        assert stats["train/groups_drawn"] == 5 + len(left_over)
        assert stats["train/groups"] == 2
        carried_total += len(carried)
    assert carried_total >= 1, "no group was carried: weak test"
    assert any(len(informative(it)) > 2 for it in trained), "no iteration had groups to carry: weak test"

    # A carried group's sequences are weighed against their recorded logprobs (stale), the others are on-policy.
    it = next(it for it, (_, groups, _) in trained.items() if any(j != it for j, _ in groups))
    batch = build_batch(ctx, choose_groups(ctx, it, 0), {})
    assert sorted(batch.trained_groups) == sorted(trained[it][1])
    played_in = {
        row["id"]: row["iteration"]
        for row in ctx.rundb.db.query("select id, iteration from episodes where run = ?", [ctx.run])
    }
    assert {played_in[s.episode_id] for s in batch.sequences} == {it - 1, it}
    assert all(s.stale == (played_in[s.episode_id] != it) for s in batch.sequences)

    # kill -9 after iteration 1's rollout; the resumed run trains on the same groups, to the same losses.
    killed = tmp_path / "killed"
    kill_when(
        ["train", "grpo", "-r", str(recipe)],
        killed,
        "select count(*) from episodes where stage = 'rollout/1'",
        at_least=1,
    )
    result = run_in_process(["train", "grpo", "-r", str(recipe)], killed)
    assert result.returncode == 0, result.stderr
    _, again = _trained(killed, recipe)
    for it in trained:
        assert again[it][:2] == trained[it][:2]
        assert again[it][2]["train/loss"] == pytest.approx(trained[it][2]["train/loss"], abs=1e-5)


def test_refill_rounds_count_the_carried_groups(tmp_path):
    env_file = write_env_file(tmp_path / "some_flat.py", SOME_FLAT_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "max_turns": 1},
        # Pairs: a non-flat task's group is informative half the time, so iterations fall short and overflow.
        rollout={"tasks": 3, "group_size": 2, "max_new_tokens": 6, "batch_size": 18},
        grpo={"iterations": 6, "dynamic_sampling": True, "oversample": 3, "max_rollout_rounds": 2},
    )
    runs = tmp_path / "runs"
    result = run_in_process(["train", "grpo", "-r", str(recipe)], runs)
    assert result.returncode == 0, result.stderr
    ctx, trained = _trained(runs, recipe)
    played = _rounds(runs, recipe)

    def informative(it, stage):
        return [t for t in dict(played[it]["stages"])[stage] if len(set(played[it]["groups"][t])) > 1]

    carried_counted = 0
    for it in played:
        left_over = []
        if it:
            before = [t for name, _ in played[it - 1]["stages"] for t in informative(it - 1, name)]
            left_over = [t for t in before if (it - 1, t) not in trained[it - 1][1]]
        short = 3 - len(left_over) - len(informative(it, f"rollout/{it}"))
        extra = dict(played[it]["stages"]).get(f"rollout/{it}+1", [])
        assert len(extra) == max(short, 0), it  # a refill round plays only what own and carried groups leave short
        carried_counted += bool(left_over) and short + len(left_over) > 0  # without them it would have refilled
    assert carried_counted, "no iteration whose carried groups spared a refill: weak test"
