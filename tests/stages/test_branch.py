"""grpo.branch (rewind and branch): branches stored with their parent and turn and replaying it, the
per-turn advantages against hand numbers, an env that does not replay refused before any stage, and
the same episodes and weights after a kill -9 inside a branch stage; the same for branches from the
expert's episodes (choose expert), and an env without an expert refused."""

from __future__ import annotations

import json
import sqlite3
from dataclasses import replace

import pytest
import torch

from helpers import kill_at_event, make_ctx, run_in_process, write_env_file, write_recipe
from rlcli.engine.grpo import advantages
from rlcli.engine.grpo.batch import branch_credit, expert_branch_credit
from rlcli.engine.grpo.branches import expert_points, expert_tasks
from rlcli.recipe import load_recipe
from rlcli.store.records import Episode, LabelledEpisode, Turn

BRANCH = {"points": 2, "continuations": 2, "choose": "failed"}
EXPERT_BRANCH = {**BRANCH, "choose": "expert"}
MAZE = dict(
    env={"name": "maze", "max_turns": 4},
    rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 2, "temperature": 1.0},
)

# A reward that differs between replies, so that groups and branch points carry signal and the update moves.
SHORT = """
def short(completions, **kwargs):
    return [1.0 / (1 + len(c)) for c in completions]
"""

# Its first observation carries noise that the seed does not fix: two plays of one seed differ.
NOISY_ENV = """
import os

class Noisy:
    def reset(self, seed):
        return f"Task {seed}, noise {os.urandom(4).hex()}: say a word.", {"task": {"seed": seed}}
    def step(self, action):
        return "Done.", 0.0, True, False, {}

def make_env():
    return Noisy()
"""


def test_a_branch_point_is_valued_by_the_mean_of_its_returns():
    value, step = advantages.branch_point_advantages([0.0, 1.0, 0.0, 1.0])
    assert value == 0.5 and step == [-0.5, 0.5, -0.5, 0.5]
    # A continuation against a group it does not join: the group's mean and unbiased std (0.5, sqrt(1/3)).
    (grpo,) = advantages.outside_advantages([1, 0, 1, 0], [7, 7, 7, 7], [[1.0, 1.0]], [7], "grpo", eps=0.0)
    assert grpo == pytest.approx([0.5 / (1 / 3) ** 0.5] * 2)
    assert advantages.outside_advantages([1, 0], [0, 0], [[1.0]], [0], "dr_grpo") == [[0.5]]
    assert advantages.outside_advantages([1, 1, 0, 1], [0, 0, 1, 1], [[0.0]], [0], "grpo") == [[0.0]]  # equal group


def _episode(
    id_: int, rewards: list[float], parent: int | None = None, turn: int | None = None, task: int = 0, success=False
) -> LabelledEpisode:
    blank = Episode(**{f: None for f in Episode.__dataclass_fields__})
    turns = [Turn(t, [1, 2], [3], [-0.5], reward=r) for t, r in enumerate(rewards)]
    episode = replace(
        blank, id=id_, task_index=task, turns=turns, parent_episode_id=parent, branch_turn=turn, success=success
    )
    episode = replace(episode, status="ok")
    return LabelledEpisode(episode, "grpo", sum(rewards))


def test_branch_credit_follows_the_formula():
    """A group of two failed two-turn episodes (no episode-level signal), episode 1 branched at turn 1
    into a continuation that wins and one that fails: V(s_1) = (0 + 1 + 0) / 3, and each turn taken
    there gets weight x (its return-to-go - V); every other turn keeps its episode advantage (0)."""
    cfg = load_recipe(None, ["grpo.branch.weight=0.5"]).grpo
    episodes = [_episode(1, [0, 0]), _episode(2, [0, 0])]
    turn_adv = [[0.0, 0.0], [0.0, 0.0]]
    branches = [_episode(10, [0, 1], parent=1, turn=1), _episode(11, [0, 0], parent=1, turn=1)]
    metrics: dict[str, float] = {}
    trained, credited = branch_credit(cfg, episodes, torch.tensor([0, 0]), turn_adv, branches, metrics)
    assert turn_adv == [[0.0, pytest.approx(0.5 * (0 - 1 / 3))], [0.0, 0.0]]
    assert [b.episode.id for b, _ in trained] == [10, 11]
    assert trained[0][1][1] == pytest.approx(0.5 * (1 - 1 / 3)) and trained[1][1][1] == pytest.approx(-0.5 / 3)
    assert credited == {0} and metrics == {"train/branch_points": 1, "train/branch_points_live": 1.0}
    # Its group's rewards are equal, but it trains: no longer counted as a group without signal.
    zero_var = advantages.zero_variance_groups([0.0, 0.0], [0, 0])
    assert advantages.groups_without_signal(zero_var, torch.tensor([0, 0]), credited) == 0
    assert advantages.groups_without_signal(zero_var, torch.tensor([0, 0]), set()) == 1


def test_expert_branch_credit_follows_the_formula():
    """Continuations from expert states: each state's continuations are a group of their own. State (1, 1):
    returns-to-go from turn 1 of 1 and 0, so dr_grpo gives +-0.5 on turns 1 on, nothing before; state (2, 0):
    equal returns, no signal."""
    cfg = load_recipe(None, ["grpo.advantage=dr_grpo", "grpo.branch.choose=expert", "grpo.branch.weight=2"]).grpo
    branches = [
        _episode(10, [0, 1, 0], parent=1, turn=1),
        _episode(11, [5, 0, 0], parent=1, turn=1),  # turn 0 is the expert's: its reward is not the policy's
        _episode(12, [0, 1], parent=2, turn=0),
        _episode(13, [1, 0], parent=2, turn=0),
    ]
    metrics: dict[str, float] = {}
    trained = expert_branch_credit(cfg, branches, metrics)
    assert [(b.episode.id, adv) for b, adv in trained] == [
        (10, [0.0, 1.0, 1.0]),
        (11, [0.0, -1.0, -1.0]),
        (12, [0.0, 0.0]),
        (13, [0.0, 0.0]),
    ]
    assert metrics == {"train/branch_points": 2, "train/branch_points_live": 0.5}


def test_the_expert_plays_unsolved_tasks_first_and_branches_after_its_first_turn():
    rollouts = [_episode(1, [0], task=0), _episode(2, [1], task=1, success=True), _episode(3, [0], task=2)]
    assert sorted(expert_tasks(rollouts, 2, seed=0)) == [0, 2]
    assert len(expert_tasks(rollouts, 5, seed=0)) == 3 and expert_tasks(rollouts, 3, seed=0)[2] == 1
    experts = [_episode(7, [0, 0, 1], task=0).episode, _episode(8, [1], task=2).episode]
    points = expert_points(experts, seed=3)
    assert [p.parent_id for p in points] == [7, 8]
    assert 1 <= points[0].turn <= 2 and points[1].turn == 0  # a one-turn expert episode: its start
    assert expert_points(experts, seed=3) == points  # drawn from the seed alone


def _one_branched_iteration(tmp_path, branch) -> sqlite3.Connection:
    """One GRPO iteration on the maze with grpo.branch `branch`; its database."""
    from rlcli.engine.grpo.loop import run_grpo

    recipe = write_recipe(tmp_path / "r.yaml", **MAZE, grpo={"iterations": 1, "branch": branch})
    run_grpo(make_ctx(recipe, tmp_path / "runs"))
    return sqlite3.connect(tmp_path / "runs" / "rlcli.db")


def test_expert_branches_continue_the_experts_episode(tmp_path):
    db = _one_branched_iteration(tmp_path, EXPERT_BRANCH)
    experts = db.execute(
        "select id, task_index, sample_index, seed from episodes where stage = 'branch/0' and policy = 'expert'"
    ).fetchall()
    rollout_seeds = dict(db.execute("select task_index, seed from episodes where stage = 'rollout/0'").fetchall())
    assert len(experts) == 2 and all(sample == 0 and seed == rollout_seeds[task] for _, task, sample, seed in experts)
    branches = db.execute(
        "select id, parent_episode_id, branch_turn, status, sample_index from episodes "
        "where stage = 'branch/0' and policy != 'expert' order by id"
    ).fetchall()
    assert len(branches) == 4 and all(status == "ok" for *_, status, _ in branches)
    assert {parent for _, parent, *_ in branches} == {e[0] for e in experts}
    assert sorted(sample for *_, sample in branches) == [1, 2, 3, 4]
    (params,) = db.execute("select params from stages where name = 'branch/0'").fetchone()
    assert sorted(json.loads(params)["tasks"]) == sorted(task for _, task, *_ in experts)

    def turns(episode_id):
        return db.execute(
            "select text, observation, reward, completion_ids from turns where episode_id = ? order by turn_index",
            [episode_id],
        ).fetchall()

    assert any(turn >= 1 for _, _, turn, *_ in branches)  # a maze expert takes several moves
    for branch, parent, turn, *_ in branches:
        mine, theirs = turns(branch), turns(parent)
        assert [t[:3] for t in mine[:turn]] == [t[:3] for t in theirs[:turn]]  # the expert's moves replayed
        assert all(t[3] for t in mine)  # as tokens of the policy's: every turn has its completion
    keys = [k for (k,) in db.execute("select key from metrics where key like 'train/branch%'")]
    assert sorted(keys) == ["train/branch_points", "train/branch_points_live"]


def test_expert_branches_need_an_env_with_an_expert(tmp_path):
    env = write_env_file(tmp_path / "plain.py", NOISY_ENV.replace("os.urandom(4).hex()", "0"))
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": str(env)}, grpo={"iterations": 1, "branch": EXPERT_BRANCH})
    done = run_in_process(["train", "grpo", "-r", str(recipe)], tmp_path / "runs")
    message = done.stderr.strip()
    assert done.returncode == 2 and "\n" not in message, message
    assert "has no expert_action()" in message and "choose failed, divergence or entropy" in message


def test_branches_are_stored_with_their_parent_and_replay_it(tmp_path):
    db = _one_branched_iteration(tmp_path, BRANCH)
    branches = db.execute(
        "select id, parent_episode_id, branch_turn, status from episodes where stage = 'branch/0' order by id"
    ).fetchall()
    assert len(branches) == 4 and all(status == "ok" for *_, status in branches)
    (points,) = db.execute("select params from stages where name = 'branch/0'").fetchone()
    assert sorted(map(tuple, json.loads(points)["points"])) == sorted({(p, t) for _, p, t, _ in branches})

    def turns(episode_id):
        return db.execute(
            "select prompt_ids, completion_ids, text, observation, reward from turns where episode_id = ? "
            "order by turn_index",
            [episode_id],
        ).fetchall()

    for branch, parent, turn, _ in branches:
        mine, theirs = turns(branch), turns(parent)
        assert mine[:turn] == theirs[:turn]  # the parent's actions replayed: the same observations and rewards
        assert mine[turn][0] == theirs[turn][0]  # turn t's prompt, token for token
    # Not attempts at their task from its start: the task statistics count rollout/0's episodes only.
    assert db.execute("select sum(attempts) from task_stats").fetchone()[0] == 4
    keys = [k for (k,) in db.execute("select key from metrics where key like 'train/branch%'")]
    assert sorted(keys) == ["train/branch_points", "train/branch_points_live"]


def test_an_env_that_does_not_replay_is_refused_before_any_stage(tmp_path):
    env = write_env_file(tmp_path / "noisy.py", NOISY_ENV)
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": str(env)}, grpo={"iterations": 1, "branch": BRANCH})
    runs = tmp_path / "runs"
    done = run_in_process(["train", "grpo", "-r", str(recipe)], runs)
    assert done.returncode == 2
    message = done.stderr.strip()
    assert message.count(".") >= 1 and "\n" not in message, message
    assert "does not replay" in message and "the reset's observation differs" in message
    assert "grpo.branch: null" in message
    assert (
        not (runs / "rlcli.db").exists()
        or not sqlite3.connect(runs / "rlcli.db").execute("select count(*) from stages").fetchone()[0]
    )


def _played(runs):
    with sqlite3.connect(runs / "rlcli.db") as db:
        episodes = db.execute(
            "select e.stage, e.task_index, e.sample_index, p.task_index, p.sample_index, e.branch_turn, e.status, "
            "group_concat(hex(t.completion_ids), ',') from episodes e left join episodes p on p.id = e.parent_episode_id "
            "join turns t on t.episode_id = e.id group by e.id order by e.stage, e.task_index, e.sample_index"
        ).fetchall()
        path = db.execute("select path from checkpoints order by id desc limit 1").fetchone()[0]
    from safetensors.torch import load_file

    return episodes, load_file(f"{runs / path}/adapter_model.safetensors")


@pytest.mark.parametrize("branch", [BRANCH, EXPERT_BRANCH], ids=["failed", "expert"])
def test_a_kill_inside_a_branch_stage_resumes_to_the_same_episodes_and_weights(tmp_path, branch):
    (tmp_path / "short.py").write_text(SHORT)
    rewards = [{"fn": f"{tmp_path / 'short.py'}:short", "name": "short"}]
    grpo = {"iterations": 2, "lr": 1e-2, "branch": branch}
    recipe = write_recipe(tmp_path / "r.yaml", **MAZE, rewards=rewards, grpo=grpo)
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    assert run_in_process(["train", "grpo", "-r", str(recipe)], clean).returncode == 0
    with sqlite3.connect(clean / "rlcli.db") as db:
        live = db.execute("select value from metrics where key = 'train/branch_points_live' order by step").fetchall()
    assert live and all(value > 0 for (value,) in live)  # the branches taught something: the weights moved
    # Stopped at the write after branch/1's first chunk (2 of its 4 branches): its second chunk is lost.
    first_chunk = "select count(*) from episodes where stage = 'branch/1'"
    kill_at_event(["train", "grpo", "-r", str(recipe)], killed, {"sql": first_chunk, "at_least": 2}, timeout=300)
    with sqlite3.connect(killed / "rlcli.db") as db:
        assert db.execute(first_chunk).fetchone()[0] == 2
    done = run_in_process(["train", "grpo", "-r", str(recipe)], killed)
    assert done.returncode == 0, done.stderr
    (episodes_a, weights_a), (episodes_b, weights_b) = _played(clean), _played(killed)
    assert [e for e in episodes_a if e[0].startswith("branch/")] and episodes_a == episodes_b
    assert weights_a.keys() == weights_b.keys()
    for key in weights_a:
        assert torch.equal(weights_a[key], weights_b[key]), key


def test_the_episode_page_shows_branches_under_their_parent_turn():
    from rlcli.report.html import episodes_page

    def view(id_, parent=None, turn=None):
        return {
            "id": id_,
            "stage": "rollout/0",
            "task_index": 0,
            "sample_index": 0,
            "reward": 0.5,
            "status": "ok",
            "end_reason": "terminated",
            "success": False,
            "env_return": 0.0,
            "num_turns": 2,
            "num_tokens": 4,
            "policy": "base",
            "error": None,
            "rewards": {},
            "label_set": "grpo",
            "messages": [],
            "parent_episode_id": parent,
            "branch_turn": turn,
        }

    page = episodes_page("t", [view(1), view(5, parent=1, turn=1)], {})
    assert '<li>turn 1: <a href="#episode-5">episode 5</a> · reward 0.5</li>' in page
    assert 'branch of <a href="#episode-1">episode 1</a> from its turn 1' in page
