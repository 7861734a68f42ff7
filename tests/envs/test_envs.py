"""Environments: experts solve held-out tasks, random play does worse, splits, loading, robustness."""

from __future__ import annotations

import random
import threading

import pytest
from typer.testing import CliRunner

from rlcli.cli.envs import RANDOM_ACTIONS, app
from rlcli.envs.loading import list_builtin_envs, load_env
from rlcli.envs.parsing import parse_answer_tag, parse_last_number, parse_tool_call, safe_arithmetic
from rlcli.envs.protocol import EnvFailure, as_messages, call_with_timeout, task_seed
from rlcli.errors import UsageError
from rlcli.rewards.builtins import parse_answer

BUILTINS = ["arithmetic", "calculator", "guess_number", "gui_click", "maze", "multihop_search", "repair_tests"]
EVAL_SEEDS = [task_seed("eval", i) for i in range(20)]


def play(env, seed, policy, max_turns=12, rng=None):
    obs, info = env.reset(seed)
    assert as_messages(obs) and "task" in info
    total, transcript = 0.0, [as_messages(obs)]
    for _ in range(max_turns):
        action = env.expert_action() if policy == "expert" else rng.choice(RANDOM_ACTIONS)
        obs, reward, terminated, truncated, step_info = env.step(action)
        messages = as_messages(obs)
        for m in messages:  # a tool call's latency is wall-clock, not part of the episode's outcome
            m.get("call", {}).pop("latency_s", None)
        transcript.append((action, messages, reward))
        total += reward
        if terminated or truncated:
            break
    return total, transcript


def test_every_builtin_is_listed():
    assert [name for name, _ in list_builtin_envs()] == BUILTINS


@pytest.mark.parametrize("name", BUILTINS)
def test_expert_solves_held_out_tasks_and_random_play_does_far_worse(name):
    factory = load_env(name, {})
    expert = sum(play(factory(), s, "expert")[0] > 0 for s in EVAL_SEEDS)
    rng = random.Random(0)
    random_wins = sum(play(factory(), s, "random", rng=rng)[0] > 0 for s in EVAL_SEEDS)
    assert expert == 20
    assert random_wins <= 6, random_wins


@pytest.mark.parametrize("name", BUILTINS)
def test_episodes_are_deterministic_given_the_seed(name):
    factory = load_env(name, {})
    a = play(factory(), 123, "expert")
    b = play(factory(), 123, "expert")
    assert a == b
    assert play(factory(), 124, "expert")[1][0] != a[1][0] or name == "guess_number"


def test_train_and_eval_seeds_never_overlap():
    train = {task_seed("train", i) for i in range(10_000)}
    held_out = {task_seed("eval", i) for i in range(10_000)}
    assert not train & held_out
    with pytest.raises(UsageError, match="eval seeds"):
        task_seed("train", 1_000_000)
    with pytest.raises(UsageError, match="split"):
        task_seed("test", 0)


def test_unparseable_actions_get_feedback_not_a_crash():
    for name in BUILTINS:
        env = load_env(name, {})()
        env.reset(0)
        obs, reward, *_ = env.step("¯\\_(ツ)_/¯")
        assert as_messages(obs) and reward == 0.0


def test_calculator_rewards_only_answers_that_used_the_tool():
    env = load_env("calculator", {})()
    _, info = env.reset(1)
    obs, reward, done, *_ = env.step(f"<answer>{info['task']['answer']}</answer>")
    assert done and reward == 0.0 and "not used" in obs
    env.reset(1)
    obs, *_ = env.step(env.expert_action())
    assert obs[0]["role"] == "tool" and str(info["task"]["answer"]) in obs[0]["content"]
    assert env.tools[0]["function"]["name"] == "calculator"


def test_maze_renders_an_image():
    env = load_env("maze", {"size": 6})()
    env.reset(0)
    image = env.render_image()
    assert image.size == (6 * 24, 6 * 24) and len(set(image.getdata())) >= 3


def test_parsers():
    assert parse_answer_tag("x <answer> 12 </answer> y <answer>13</answer>") == "13"
    assert parse_answer_tag("none") is None
    assert parse_last_number("it is 1,234 or 5.0") == 5 and parse_last_number("no") is None
    assert parse_tool_call('<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>') == {
        "name": "calculator",
        "arguments": {"expression": "2*3"},
    }
    assert parse_tool_call('{"name": "f", "arguments": "{\\"a\\": 1}"}') == {"name": "f", "arguments": {"a": 1}}
    assert parse_tool_call("<tool_call>not json</tool_call>") is None
    assert safe_arithmetic("(2 + 3) * -4") == -20
    with pytest.raises(ValueError):
        safe_arithmetic("__import__('os')")


def test_numbers_read_the_same_in_envs_and_rewards():
    # A minus sign after a digit is a dash: "3-5" (a range, a difference) ends with 5; a lone "-5" is -5.
    assert parse_last_number("between 3-5") == 5 and parse_last_number("it is -5") == -5
    assert parse_last_number("1,234,567 or .5") == 0.5 and parse_last_number("1,234,567") == 1234567
    assert parse_answer("between 3-5", "last_number") == "5"


def test_loading_from_a_file_a_module_and_errors(tmp_path, monkeypatch):
    (tmp_path / "my_env.py").write_text(
        "class Echo:\n"
        "    def __init__(self, word='hi'):\n        self.word = word\n"
        "    def reset(self, seed):\n        return self.word, {'task': {}}\n"
        "    def step(self, action):\n        return 'ok', float(action == self.word), True, False, {}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_env("my_env.py", {"word": "yo"})().reset(0)[0] == "yo"
    assert load_env("my_env.py:Echo", {})().reset(0)[0] == "hi"
    assert load_env("my_env:Echo", {})().step("hi")[1] == 1.0
    with pytest.raises(UsageError, match="no file"):
        load_env("missing.py", {})
    (tmp_path / "broken_env.py").write_text("1 / 0\n")
    with pytest.raises(UsageError, match="loading .*broken_env.py failed: ZeroDivisionError"):
        load_env("broken_env.py", {})
    with pytest.raises(UsageError, match="Unknown env 'nosuch'"):
        load_env("nosuch", {})
    with pytest.raises(UsageError, match="has no 'Nope'"):
        load_env("my_env.py:Nope", {})
    with pytest.raises(UsageError, match="do not fit"):
        load_env("guess_number", {"colour": "red"})


def test_raising_and_slow_envs_become_env_failures():
    def boom(action):
        raise RuntimeError("kaput")

    with pytest.raises(EnvFailure, match="RuntimeError: kaput"):
        call_with_timeout(boom, 1.0, "x")
    # A call that never returns: only the time limit can end it (pytest-timeout guards a regression).
    with pytest.raises(EnvFailure, match="exceeded the 0.2s step time limit"):
        call_with_timeout(threading.Event().wait, 0.2)
    with pytest.raises(EnvFailure, match="observation"):
        as_messages(42)


def test_envs_cli_list_and_try():
    runner = CliRunner()
    out = runner.invoke(app, ["list", "--json"])
    assert out.exit_code == 0 and "guess_number" in out.output
    out = runner.invoke(app, ["try", "guess_number", "--policy", "expert", "--seed", "3"])
    assert out.exit_code == 0 and "solved in" in out.output and "not solved" not in out.output
    out = runner.invoke(
        app, ["try", "guess_number", "--policy", "human", "-k", "high=2"], input="My guess: 1\nMy guess: 2\n"
    )
    assert out.exit_code == 0 and "solved in" in out.output
    out = runner.invoke(app, ["try", "maze", "--policy", "expert", "-k", "render=png"])
    # The sub-app raises it; rlcli's entry point turns a UsageError into its sentence and exit code 2.
    assert isinstance(out.exception, UsageError) and "refused env.kwargs" in str(out.exception)
