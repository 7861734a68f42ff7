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
    code, out, err = audit(capsys, env, "--json")
    assert code == 0, out + err
    report = json.loads(out)
    assert report["findings"] == []
    assert report["replay"] == {"seeds": 4, "mismatch": None}


def test_the_sound_planted_env_passes_and_its_expert_solves_it(capsys, tmp_path):
    code, out, _ = audit(capsys, planted(tmp_path), "--json")
    assert code == 0
    report = json.loads(out)
    scores = {p["policy"]: p for p in report["policies"]}
    assert scores["expert"]["success_rate"] == 1.0
    assert scores["empty reply"]["success_rate"] == 0.0
    assert report["findings"] == [] and report["held_out"]["leaked"] == []


# Each planted defect, and the finding that names it.
DEFECTS = {
    "empty reply rewarded": (
        {"right": 'action == "" or action.strip() == str(self.a + self.b)'},
        "The empty reply policy succeeds in 16 of 16 episodes",
    ),
    "any long reply rewarded": (
        {"right": "len(action) > 100 or action.strip() == str(self.a + self.b)"},
        "The longest reply policy succeeds in 16 of 16 episodes",
    ),
    "held-out tasks leak": ({"task_seed": "seed % 7"}, "16 of 16 held-out tasks are also training tasks"),
    "no replay": ({"task_seed": "None"}, "The env does not replay: seed 1000000: the reset's observation differs"),
    "raises on a reply": (
        {"check": "int(action)"},
        "The env raised on the empty reply policy's replies in 16 of 16 episodes (ValueError",
    ),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_each_planted_defect_is_found_in_one_sentence(capsys, tmp_path, defect):
    planting, finding = DEFECTS[defect]
    code, out, err = audit(capsys, planted(tmp_path, **planting), "--json")
    assert code == 1
    assert any(line.startswith(finding) for line in json.loads(out)["findings"])
    assert "finding(s) for" in err


def test_the_recipe_gives_the_env_and_its_horizon(capsys):
    code, out, _ = cli(capsys, "envs", "audit", "-r", "recipes/quickstart.yaml", "--episodes", "8", "--json")
    assert code == 0
    report = json.loads(out)
    assert report["env"] == "guess_number" and report["findings"] == []


def test_the_table_names_each_policy_and_the_checks(capsys, tmp_path):
    code, out, _ = audit(capsys, planted(tmp_path, task_seed="seed % 7"))
    assert code == 1
    for policy in ("expert", "empty reply", "random words", "prompt repeated", "longest reply", "same answer"):
        assert policy in out
    assert "replay:" in out and "held-out: 16 of 16" in out and "finding:" in out


def test_neither_env_nor_recipe_is_refused(capsys):
    code, _, err = cli(capsys, "envs", "audit")
    assert code == 2
    assert "name an env" in err
