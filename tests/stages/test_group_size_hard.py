"""rollout.group_size_hard: tasks the statistics of earlier iterations rate as hard get more samples;
the sizes are recorded with the rollout stage, and the advantages stay per group when groups are unequal."""

from __future__ import annotations

import pytest
import torch

from helpers import make_ctx, write_env_file, write_recipe
from rlcli.engine.grpo import advantages
from rlcli.errors import UsageError
from rlcli.recipe import load_recipe

# Even tasks never succeed (hard); odd ones succeed when the answer's characters sum to an odd number.
# The reward is that parity everywhere, so hard groups have reward variance too and train.
PARITY_ENV = """
class Parity:
    def reset(self, seed):
        self.seed = seed
        return f"Task {seed}: say a word.", {"task": {"seed": seed}}
    def step(self, action):
        reward = float(sum(map(ord, action)) % 2)
        return "Done.", reward, True, False, {"success": self.seed % 2 == 1 and reward > 0}

def make_env():
    return Parity()
"""


def test_advantages_are_per_group_when_groups_are_unequal():
    rewards = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0]
    groups = [7, 7, 2, 2, 2, 2, 5, 5, 5]  # sizes 2, 4 and 3 (the last with equal rewards)
    for method in ("grpo", "dr_grpo", "rloo"):
        got = advantages.compute_advantages(rewards, groups, method)
        for g in set(groups):
            r = torch.tensor([x for x, y in zip(rewards, groups) if y == g], dtype=torch.float64)
            mean = r.mean()
            if method == "grpo":
                want = (r - mean) / (r.std() + 1e-6)
            elif method == "dr_grpo":
                want = r - mean
            else:
                want = r - (r.sum() - r) / (len(r) - 1)
            want = want if r.max() > r.min() else torch.zeros_like(r)
            mine = torch.tensor([float(a) for a, y in zip(got, groups) if y == g], dtype=torch.float64)
            assert torch.allclose(mine, want, atol=1e-6), (method, g)


def test_hard_tasks_get_more_samples_recorded_and_trained(tmp_path):
    from rlcli.engine.curriculum import group_sizes
    from rlcli.engine.grpo.loop import run_grpo

    env_file = write_env_file(tmp_path / "parity.py", PARITY_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "max_turns": 1, "tasks": [0, 4]},
        rollout={
            "tasks": 2,
            "group_size": 3,
            "group_size_hard": 6,
            "hard_below": 0.2,
            "hard_min_attempts": 3,
            "max_new_tokens": 6,
            "batch_size": 12,
        },
        grpo={"iterations": 4, "drop_zero_var_groups": False},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    run_grpo(ctx)

    metrics = {(m.step, m.key): m.value for m in ctx.rundb.metrics(ctx.run)}
    seen_hard = seen_easy = 0
    for it in range(4):
        row = ctx.rundb.stage(ctx.run, f"rollout/{it}")
        tasks, sizes = row.params["tasks"], row.params["group_sizes"]
        # The rule, counted independently from the episodes of the iterations before.
        expected = []
        for task in tasks:
            attempts, successes = ctx.rundb.db.execute(
                "select count(*), coalesce(sum(success), 0) from episodes where split = 'train' and status = 'ok' "
                "and task_index = ? and iteration < ?",
                [task, it],
            ).fetchone()
            expected.append(6 if attempts >= 3 and successes / attempts < 0.2 else 3)
        assert sizes == expected, it
        played = dict(
            ctx.rundb.db.execute(
                "select task_index, count(*) from episodes where stage = ? group by task_index", [f"rollout/{it}"]
            ).fetchall()
        )
        assert played == dict(zip(tasks, sizes)), it
        assert metrics[(it, "train/hard_groups")] == sizes.count(6)
        assert metrics[(it, "train/groups")] == 2
        seen_hard += sizes.count(6)
        seen_easy += sizes.count(3)
    assert seen_hard and seen_easy > 4, "the run must mix hard and ordinary groups after the first pass"
    # Every group with unequal rewards trained: one sequence per episode, the big groups included.
    assert all(
        metrics[(it, "train/sequences")] == sum(ctx.rundb.stage(ctx.run, f"rollout/{it}").params["group_sizes"])
        for it in range(4)
    )

    # A resumed stage reuses the recorded sizes, whatever the statistics or the recipe say now.
    recorded = ctx.rundb.stage(ctx.run, "rollout/3").params
    ctx.recipe.rollout.hard_below = 0.0
    assert list(group_sizes(ctx, 3, "rollout/3", recorded["tasks"]).values()) == recorded["group_sizes"]
    assert list(group_sizes(ctx, 3, "rollout/9", recorded["tasks"]).values()) == [3, 3]


def test_group_size_hard_is_refused_with_asynchronous_rollouts():
    with pytest.raises(UsageError, match="rollout.group_size_hard needs the synchronous loop"):
        load_recipe(None, ["rollout.group_size_hard=8", "grpo.max_staleness=1"])
