"""env.max_turns as a horizon schedule (ScalingInter-RL): each GRPO iteration plays the horizon its
schedule gives and records it with its rollout stage; eval uses the final horizon."""

from __future__ import annotations

import pytest

from helpers import make_ctx, run_in_process, write_env_file, write_recipe
from rlcli.errors import UsageError
from rlcli.recipe import load_recipe

# Never ends by itself: every episode lasts exactly as many turns as the horizon allows.
ENDLESS_ENV = """
class Endless:
    def reset(self, seed):
        self.turn = 0
        return f"Task {seed}: keep talking.", {"task": {"seed": seed}}
    def step(self, action):
        self.turn += 1
        return f"Turn {self.turn}. Go on.", float(len(action) % 2), False, False, {}

def make_env():
    return Endless()
"""


def test_the_schedule_gives_each_iteration_its_horizon_and_is_validated():
    env = load_recipe(None, ["env.max_turns=[[0, 2], [20, 4], [40, 8]]"]).env
    assert [env.horizon(i) for i in (0, 19, 20, 39, 40, 1000)] == [2, 2, 4, 4, 8, 8]
    assert env.horizon(None) == 8
    assert load_recipe(None, ["env.max_turns=5"]).env.horizon(3) == 5
    for bad in ("[[1, 2]]", "[[0, 2], [0, 4]]", "[[0, 2], [5, 0]]", "[[0, 2, 3]]", "[]", "0"):
        with pytest.raises(UsageError, match="env.max_turns"):
            load_recipe(None, [f"env.max_turns={bad}"])


def test_grpo_plays_each_iteration_at_its_horizon_and_eval_at_the_last(tmp_path):
    env_file = write_env_file(tmp_path / "endless.py", ENDLESS_ENV)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "max_turns": [[0, 1], [1, 2], [2, 3]]},
        rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 4, "batch_size": 4},
        grpo={"iterations": 3},
        eval={"tasks": 2},
    )
    runs = tmp_path / "runs"
    for command in (["train", "grpo"], ["eval", "-c", "latest"]):
        result = run_in_process([*command, "-r", str(recipe)], runs)
        assert result.returncode == 0, result.stderr
    ctx = make_ctx(recipe, runs)
    for it, horizon in enumerate((1, 2, 3)):
        assert ctx.rundb.stage(ctx.run, f"rollout/{it}").params["max_turns"] == horizon
        turns = {
            row["num_turns"]
            for row in ctx.rundb.db.query(
                "select num_turns from episodes where run = ? and stage = ? and status = 'ok'",
                [ctx.run, f"rollout/{it}"],
            )
        }
        assert turns == {horizon}
    evaluated = {
        row["num_turns"]
        for row in ctx.rundb.db.query("select num_turns from episodes where run = ? and split = 'eval'", [ctx.run])
    }
    assert evaluated == {3}
