"""verifiers:<taskset-id>: environments written for verifiers (v1 API) played by rlcli's loop, real verifiers code."""

from __future__ import annotations

import json
import sqlite3
from contextlib import closing

import pytest
from typer.testing import CliRunner

from helpers import REPO, run_in_process, write_env_file, write_recipe
from rlcli.cli.envs import app
from rlcli.envs.adapters.verifiers import rubric_scorer  # the verifiers extra is part of the test extra
from rlcli.envs.loading import load_env
from rlcli.errors import UsageError

# A multi-turn verifiers environment as a user writes one: a taskset, a task with a rubric (two
# rewards) and a trace @stop, and an Env whose run() answers each reply. It records one reward of
# its own in run(), which only the live episode has.
PARROT = """
import verifiers.v1 as vf


class ParrotConfig(vf.TasksetConfig):
    size: int = 10


class ParrotData(vf.TaskData):
    word: str


class ParrotTask(vf.Task[ParrotData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def said_it(self, task: ParrotData, trace: vf.Trace) -> float:
        return float(any(task.word in (m.content or "") for m in trace.assistant_messages))

    @vf.reward(weight=0.5)
    async def brief(self, trace: vf.Trace) -> float:
        return float(all(len(m.content or "") <= 12 for m in trace.assistant_messages))

    @vf.stop
    async def said_stop(self, trace: vf.Trace) -> bool:
        return any("stop" in (m.content or "") for m in trace.assistant_messages)


class ParrotEnvConfig(vf.EnvConfig):
    bird: vf.AgentConfig = vf.AgentConfig()


class ParrotEnv(vf.Env[ParrotEnvConfig]):
    async def run(self, task, agents):
        async with agents.bird.interaction(task) as talk:
            segment = await talk.turn()
            for _ in range(3):
                if segment.terminated or task.data.word in segment.last_reply:
                    break
                segment = await talk.turn(f"No. Say {task.data.word}.")
        talk.trace.record_reward("env_bonus", 0.25, 1.0)


class ParrotTaskset(vf.Taskset[ParrotTask, ParrotConfig]):
    def load(self):
        for i in range(self.config.size):
            yield ParrotTask(ParrotData(prompt="Say a word.", word=f"w{i}"), self.config.task)


__all__ = ["ParrotEnv", "ParrotTaskset"]
"""


@pytest.fixture
def parrot(tmp_path):
    return write_env_file(tmp_path / "parrot_env.py", PARROT)


def play(env, seed, replies):
    messages, info = env.reset(seed)
    for reply in replies:
        messages.append({"role": "assistant", "content": reply})
        observation, reward, done, _, step_info = env.step(reply)
        if done:
            return info, messages, reward, step_info
        messages += observation
    raise AssertionError("the episode did not end")


def test_a_multi_turn_env_plays_its_run_and_its_rubric_scores_each_component(parrot):
    make = load_env(f"verifiers:{parrot}", {"size": 10})
    info, messages, reward, step = play(make(), 2, ["hello", "w2"])
    assert info["task"]["word"] == "w2" and info["task"]["verifiers_env"] == str(parrot)
    assert messages[1:3] == [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "No. Say w2."}]
    assert step["rewards"] == {"said_it": 1.0, "brief": 1.0, "env_bonus": 0.25}
    assert reward == pytest.approx(1.0 + 0.5 + 0.25) and step["success"] and step["stop"] == "user_closed"
    # The recipe's `verifiers` reward re-scores the rubric from the stored conversation; the env's own
    # env_bonus, recorded in run(), is not part of it.
    episode = {"task": info["task"], "messages": messages}
    assert rubric_scorer()([episode]) == [1.5]
    assert rubric_scorer("said_it")([episode]) == [1.0] and rubric_scorer("brief")([episode]) == [1.0]
    with pytest.raises(UsageError, match="no reward 'said' .*Did you mean 'said_it'"):
        rubric_scorer("said")([episode])


def test_a_trace_stop_ends_the_exchange_and_a_failed_task_scores_low(parrot):
    make = load_env(f"verifiers:{parrot}", {"size": 10})
    _, messages, reward, step = play(make(), 1, ["please stop", "w1"])
    assert len([m for m in messages if m["role"] == "assistant"]) == 1  # the @stop fired before a second reply
    assert step["stop"] == "said_stop" and step["rewards"]["said_it"] == 0.0 and not step["success"]
    _, _, reward, step = play(make(), 1, ["a", "b", "c", "a very long reply"])
    assert step["rewards"] == {"said_it": 0.0, "brief": 0.0, "env_bonus": 0.25} and reward == 0.25


def test_train_and_held_out_tasks_come_from_disjoint_parts_of_the_taskset(parrot):
    make = load_env(f"verifiers:{parrot}", {"size": 10, "eval_tasks": 3})
    train = {make().reset(seed)[1]["task"]["word"] for seed in range(20)}
    held_out = {make().reset(1_000_000 + i)[1]["task"]["word"] for i in range(6)}
    assert train == {f"w{i}" for i in range(7)} and held_out == {"w7", "w8", "w9"}


def test_the_shipped_example_is_played_and_solved_by_bisection():
    make = load_env("verifiers:rlcli.envs.verifiers_guess", {})
    env = make()
    _, info = env.reset(5)
    low, high = 1, info["task"]["high"]
    for _ in range(info["task"]["max_guesses"]):
        guess = (low + high) // 2
        observation, reward, done, _, step = env.step(str(guess))
        if done:
            break
        low, high = (guess + 1, high) if observation[0]["content"] == "Higher." else (low, guess - 1)
    assert done and step["success"] and step["rewards"]["solved"] == 1.0 and reward == pytest.approx(1.2)


@pytest.mark.parametrize(
    "name, kwargs, expected",
    [
        ("verifiers:no_such_vf_env", {}, "pip install no_such_vf_env"),
        ("verifiers:PARROT", {"sise": 3}, "env.kwargs do not fit"),
        ("verifiers:PARROT", {"eval_tasks": 10}, "leaves no train task"),
        ("verifiers:TWO_ROLES", {}, "2 agent roles (a, b)"),
        ("verifiers:PARROT", {"task": {"judges": [{"id": "reference"}]}}, "scores with judges"),
    ],
)
def test_what_cannot_be_carried_is_refused_in_one_sentence(parrot, tmp_path, name, kwargs, expected):
    two_roles = PARROT.replace(
        "bird: vf.AgentConfig = vf.AgentConfig()",
        "a: vf.AgentConfig = vf.AgentConfig()\n    b: vf.AgentConfig = vf.AgentConfig()",
    )
    files = {
        "PARROT": str(parrot),
        "TWO_ROLES": str(write_env_file(tmp_path / "two_roles.py", two_roles)),
    }
    scheme, _, rest = name.partition(":")
    with pytest.raises(UsageError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_env(f"{scheme}:{files.get(rest, rest)}", kwargs)


def test_envs_try_plays_a_verifiers_env():
    result = CliRunner().invoke(app, ["try", "verifiers:rlcli.envs.verifiers_guess", "--policy", "random"])
    assert result.exit_code == 0, result.output
    assert "I am thinking of a number from 1 to 16" in result.output and "turns" in result.output


def test_rollout_label_and_grpo_on_a_verifiers_env_in_env_workers(parrot, tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": f"verifiers:{parrot}", "max_turns": 3, "workers": 1},
        rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 6, "batch_size": 4},
        rewards=[
            {"fn": "verifiers"},
            {"fn": "verifiers", "name": "said_it", "kwargs": {"reward": "said_it"}, "weight": 0.0},
        ],
        grpo={"iterations": 1},
        eval={"tasks": 2},
    )
    runs = tmp_path / "runs"
    for args in (["rollout", "--policy", "base"], ["label", "--label-set", "v1"], ["train", "grpo"]):
        result = run_in_process([*args, "-r", str(recipe)], runs, cwd=REPO)
        assert result.returncode == 0, result.stderr
    with closing(sqlite3.connect(runs / "rlcli.db")) as db:
        played = db.execute("select stage, status, env_return, task, messages from episodes").fetchall()
        labels = db.execute(
            "select e.stage, r.component, r.value, e.messages, e.task from rewards r join episodes e on e.id = r.episode_id "
            "where r.label_set = 'v1'"
        ).fetchall()
    stages = {stage for stage, *_ in played}
    assert {"rollout", "rollout/0"} <= stages and all(status == "ok" for _, status, *_ in played)
    assert all(json.loads(task)["verifiers_env"] == str(parrot) for *_, task, _ in played)
    components = {component for _, component, *_ in labels}
    assert components == {"verifiers", "said_it", "total"}
    for _, component, value, messages, task in labels:
        episode = {"task": json.loads(task), "messages": json.loads(messages)}
        if component == "said_it":
            assert value == rubric_scorer("said_it")([episode])[0]


def test_an_uninstalled_env_exits_2_before_any_stage_and_names_the_pip_command(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": "verifiers:no_such_vf_env"})
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "base"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 2 and "pip install no_such_vf_env" in result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "runs" / "rlcli.db").exists()


def test_a_recipe_may_not_move_the_held_out_seeds_of_a_verifiers_env(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": "verifiers:x", "eval_seed_start": 500})
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "base"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 2 and "env.eval_seed_start is fixed" in result.stderr
