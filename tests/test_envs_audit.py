"""`rlcli envs audit`: knowing-nothing policies, replays and held-out leaks, on the shipped envs and on
envs planted with each defect."""

from __future__ import annotations

import json

import pytest

from helpers import cli, write_env_file
from rlcli.envs.loading import list_builtin_envs

# Single-turn arithmetic whose grader has the defect under test.
TEMPLATE = """
import random

class Planted:
    def reset(self, seed):
        rng = random.Random({task_seed})
        self.a, self.b = rng.randint(10, 99), rng.randint(10, 99)
        return f"What is {{self.a}} + {{self.b}}?", {{"task": {{"answer": self.a + self.b}}}}

    def step(self, action):
        {check}
        right = {right}
        return "done", float(right), True, False, {{"success": right}}

    def expert_action(self):
        return str(self.a + self.b)

def make_env():
    return Planted()
"""
SOUND = {"task_seed": "seed", "check": "pass", "right": "action.strip() == str(self.a + self.b)"}


def planted(tmp_path, **defect: str) -> str:
    return str(write_env_file(tmp_path / "planted.py", TEMPLATE.format(**{**SOUND, **defect})))


def audit(capsys, *args: str) -> tuple[int, str, str]:
    return cli(capsys, "envs", "audit", *args, "--episodes", "16", "--train-tasks", "64")


@pytest.mark.parametrize("env", [name for name, _ in list_builtin_envs()])
def test_every_shipped_env_passes(capsys, env):
    code, out, err = audit(capsys, env)
    assert code == 0, out + err
    assert "finding" not in out
    assert "same observations, rewards and endings on 4 seeds" in out


def test_the_sound_planted_env_passes_and_its_expert_solves_it(capsys, tmp_path):
    code, out, _ = audit(capsys, planted(tmp_path), "--json")
    assert code == 0
    report = json.loads(out)
    scores = {p["policy"]: p for p in report["policies"]}
    assert scores["expert"]["success_rate"] == 1.0
    assert scores["empty reply"]["success_rate"] == 0.0
    assert report["findings"] == [] and report["held_out"]["leaked"] == []


def test_an_empty_reply_that_earns_reward_is_a_loophole(capsys, tmp_path):
    code, out, err = audit(capsys, planted(tmp_path, right='action == "" or action.strip() == str(self.a + self.b)'))
    assert code == 1
    assert "The empty reply policy succeeds in 16 of 16 episodes" in out
    assert "1 finding(s)" in err


def test_a_grader_that_takes_any_long_reply_is_a_loophole(capsys, tmp_path):
    code, out, _ = audit(capsys, planted(tmp_path, right="len(action) > 100 or action.strip() == str(self.a + self.b)"))
    assert code == 1
    assert "The longest reply policy succeeds in 16 of 16 episodes" in out


def test_held_out_tasks_that_are_training_tasks_leak(capsys, tmp_path):
    code, out, _ = audit(capsys, planted(tmp_path, task_seed="seed % 7"))
    assert code == 1
    assert "16 of 16 held-out tasks are also training tasks" in out


def test_an_env_that_does_not_replay_is_found(capsys, tmp_path):
    code, out, _ = audit(capsys, planted(tmp_path, task_seed="None"))
    assert code == 1
    assert "The env does not replay: seed 1000000: the reset's observation differs" in out


def test_an_env_that_raises_on_a_reply_is_found(capsys, tmp_path):
    code, out, _ = audit(capsys, planted(tmp_path, check="int(action)"))
    assert code == 1
    assert "The env raised on the empty reply policy's replies in 16 of 16 episodes (ValueError" in out


def test_the_recipe_gives_the_env_and_its_horizon(capsys):
    code, out, _ = cli(capsys, "envs", "audit", "-r", "recipes/quickstart.yaml", "--episodes", "8", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["env"] == "guess_number" and report["findings"] == []


def test_neither_env_nor_recipe_is_refused(capsys):
    code, _, err = cli(capsys, "envs", "audit")
    assert code == 2
    assert "name an env" in err
