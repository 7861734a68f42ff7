"""Adapters: real TextArena games, reasoning-gym datasets and Gymnasium envs through rlcli's env protocol."""

from __future__ import annotations

import json
import random
import string
import sys

import pytest
from typer.testing import CliRunner

from helpers import make_ctx, write_recipe
from rlcli.cli.envs import RANDOM_ACTIONS, app
from rlcli.envs.loading import load_env
from rlcli.envs.protocol import as_messages, task_seed
from rlcli.errors import UsageError

pytest.importorskip("textarena")
pytest.importorskip("reasoning_gym")
gymnasium = pytest.importorskip("gymnasium")

HELD_OUT = [task_seed("eval", i) for i in range(10)]


def play(env, seed, policy, max_turns=250):
    """Play one episode; policy(observation_text) -> action. Returns (return, last info, transcript)."""
    obs, info = env.reset(seed)
    assert "task" in info
    text = as_messages(obs)[-1]["content"]
    total, transcript, step_info = 0.0, [text], {}
    for _ in range(max_turns):
        action = policy(text)
        obs, reward, terminated, truncated, step_info = env.step(action)
        text = as_messages(obs)[-1]["content"]
        transcript.append((action, text, reward))
        total += reward
        if terminated or truncated:
            break
    return total, step_info, transcript


# --- textarena --------------------------------------------------------------------


class BinarySearch:
    """Plays GuessTheNumber from the adapter's observation text alone: proves hints get through."""

    def __init__(self, low=1, high=20):
        self.lo, self.hi, self.guess = low, high, None

    def __call__(self, text):
        if self.guess is not None:
            if "higher" in text:
                self.lo = self.guess + 1
            elif "lower" in text:
                self.hi = self.guess - 1
        self.guess = (self.lo + self.hi) // 2
        return f"My guess: [{self.guess}]"


def test_textarena_game_solved_by_a_scripted_player_and_not_by_random_guessing():
    factory = load_env("textarena:GuessTheNumber-v0", {"max_turns": 5})
    results = [play(factory(), s, BinarySearch()) for s in HELD_OUT]
    assert all(info["success"] and total == 1.0 for total, info, _ in results)
    rng = random.Random(0)
    guessing = [play(factory(), s, lambda _: f"[{rng.randint(1, 20)}]") for s in HELD_OUT]
    assert sum(info["success"] for _, info, _ in guessing) <= 4
    # A lost game still ends with TextArena's score (closeness of the last guess), and says so.
    lost = next(t for total, info, t in guessing if not info["success"])
    assert "Game over" in lost[-1][1] and 0 <= lost[-1][2] < 1


def test_textarena_prompt_feedback_and_unparseable_replies():
    env = load_env("textarena:GuessTheNumber-v0", {})()
    obs, info = env.reset(3)
    assert "Guess The Number" in obs and info["task"] == {"game": "GuessTheNumber-v0", "seed": 3}
    obs, reward, terminated, truncated, _ = env.step("¯\\_(ツ)_/¯")
    assert "invalid move" in obs and reward == 0.0 and not terminated
    assert "¯" not in obs  # the player's own move is not echoed back


def test_textarena_a_game_ended_by_invalid_moves_gets_no_partial_credit():
    def end_by_invalid_moves(options):
        env = load_env("textarena:GuessTheNumber-v0", options)()
        env.reset(4)
        env.step("[10]")  # a valid guess: the game's partial-progress fraction is now above 0
        env.step("no idea")
        return env.step("still no idea")

    text, reward, terminated, _, info = end_by_invalid_moves({})
    assert terminated and info["invalid_move"] and reward == 0.0 and "Score: 0" in text
    _, game_score, terminated, _, info = end_by_invalid_moves({"invalid_move_score": None})
    assert terminated and info["invalid_move"] and 0.0 < game_score < 1.0
    with pytest.raises(UsageError, match="invalid_move_score: expected a number"):
        load_env("textarena:GuessTheNumber-v0", {"invalid_move_score": "none"})()


def test_textarena_is_deterministic_even_when_episodes_interleave():
    # Blackjack draws cards from the global `random` on every hit: the adapter keeps a stream per env.
    factory = load_env("textarena:Blackjack-v0", {})
    moves = ["[Hit]", "[Stand]", "[Hit]", "[Hit]", "[Stand]"] * 3

    def alone(seed):
        env = factory()
        return [env.reset(seed)[0]] + [env.step(m)[0] for m in moves]

    random.seed(1234)
    outside = random.getstate()
    a, b = factory(), factory()
    interleaved_a, interleaved_b = [a.reset(5)[0]], [b.reset(6)[0]]
    for move in moves:
        interleaved_a.append(a.step(move)[0])
        interleaved_b.append(b.step(move)[0])
    assert random.getstate() == outside
    assert interleaved_a == alone(5) and interleaved_b == alone(6)
    assert interleaved_a != interleaved_b


def test_textarena_blackjack_expert_wins_far_more_than_always_hitting():
    def win_rate(policy) -> float:
        wins = 0
        for seed in range(200):
            env = load_env("textarena:Blackjack-v0", {"num_hands": 1})()
            env.reset(10_000 + seed)
            done, turns = False, 0
            while not done:
                _, _, done, _, info = env.step(policy(env))
                turns += 1
            wins += info["success"]
            assert not info["invalid_move"] and turns <= 12
        return wins / 200

    expert = win_rate(lambda env: env.expert_action())
    assert expert >= 0.35, "basic strategy wins about 4 hands in 10"
    assert win_rate(lambda env: "[Hit]") < expert - 0.2
    assert not hasattr(load_env("textarena:GuessTheNumber-v0", {})(), "expert_action"), "only where one exists"


def test_textarena_clear_errors():
    with pytest.raises(UsageError, match="no game 'GuessTheNumbr-v0'.*GuessTheNumber-v0"):
        load_env("textarena:GuessTheNumbr-v0", {})()
    with pytest.raises(UsageError, match="two-player game: set env.opponent"):
        load_env("textarena:TicTacToe-v0", {})()
    with pytest.raises(UsageError, match="do not fit"):
        load_env("textarena:GuessTheNumber-v0", {"colour": "red"})()


def test_a_game_the_adapter_refuses_stops_the_rollout_stage_with_one_sentence(tmp_path):
    from rlcli.engine.rollout import run_rollout_stage

    ctx = make_ctx(write_recipe(tmp_path / "r.yaml", env={"name": "textarena:TicTacToe-v0"}), tmp_path / "runs")
    with pytest.raises(UsageError, match="two-player game: set env.opponent"):
        run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    assert ctx.rundb.db["episodes"].count == 0


# --- reasoning_gym ----------------------------------------------------------------


@pytest.mark.parametrize("dataset", ["basic_arithmetic", "chain_sum", "leg_counting"])
def test_reasoning_gym_expert_solves_held_out_tasks_and_random_does_far_worse(dataset):
    factory = load_env(f"reasoning_gym:{dataset}", {})
    for seed in HELD_OUT:
        env = factory()
        obs, info = env.reset(seed)
        assert obs[0]["role"] == "system" and "<answer>" in obs[0]["content"]
        assert obs[1]["content"] == info["task"]["question"] and info["task"]["answer"]
        feedback, reward, terminated, truncated, step_info = env.step(env.expert_action())
        assert reward == 1.0 and terminated and step_info["success"], (seed, feedback)
    rng = random.Random(0)
    random_wins = sum(play(factory(), s, lambda _: rng.choice(RANDOM_ACTIONS))[1]["success"] for s in HELD_OUT)
    assert random_wins <= 1


def test_reasoning_gym_tasks_are_deterministic_by_seed_and_kwargs_reach_the_dataset():
    factory = load_env("reasoning_gym:chain_sum", {"min_terms": 2, "max_terms": 2, "system_prompt": "direct"})
    first, again, other = factory().reset(7), factory().reset(7), factory().reset(8)
    assert first == again and first[0] != other[0]
    assert first[1]["task"]["metadata"]["num_terms"] == 2
    assert "directly" in first[0][0]["content"]


def test_reasoning_gym_scores_only_a_tagged_answer_and_wrong_replies_without_crashing():
    env = load_env("reasoning_gym:leg_counting", {})()
    _, info = env.reset(1)
    answer = str(info["task"]["answer"])
    feedback, reward, terminated, _, step_info = env.step(answer)  # right, but untagged
    assert reward == 0.0 and terminated and not step_info["success"] and step_info["format_error"]
    assert "<answer>" in feedback and answer in feedback
    env.reset(1)
    assert env.step(f"I think <answer>{answer}</answer>")[1] == 1.0
    env.reset(1)
    feedback, reward, terminated, _, step_info = env.step("<answer>a lot</answer>")
    assert reward < 1.0 and terminated and not step_info["success"] and answer in feedback
    # prime_factorization's verifier raises on some malformed answers: scored 0, not a crash.
    env = load_env("reasoning_gym:prime_factorization", {})()
    env.reset(0)
    assert env.step("<answer><answer>2</answer>")[1] == 0.0


def test_reasoning_gym_strict_format_false_scores_the_whole_reply_as_before():
    env = load_env("reasoning_gym:leg_counting", {"strict_format": False})()
    _, info = env.reset(1)
    feedback, reward, *_, step_info = env.step(str(info["task"]["answer"]))
    assert reward == 1.0 and step_info["success"] and "No <answer>" in feedback
    with pytest.raises(UsageError, match="strict_format: expected true or false"):
        load_env("reasoning_gym:leg_counting", {"strict_format": "no"})()


def test_reasoning_gym_gives_no_credit_for_containing_the_answer_unless_asked():
    # leg_counting uses reasoning-gym's generic verifier: len(answer)/len(reply) for a reply that
    # contains the answer, so echoing numbers from the question earns reward.
    env = load_env("reasoning_gym:leg_counting", {})()
    _, info = env.reset(1)
    junk = f"<answer>{info['task']['answer']}, 25, 5</answer>"
    assert env.step(junk)[1] == 0.0
    lenient = load_env("reasoning_gym:leg_counting", {"substring_credit": True})()
    lenient.reset(1)
    assert 0.0 < lenient.step(junk)[1] < 1.0
    # Datasets with their own verifier keep its scores.
    chain = load_env("reasoning_gym:chain_sum", {})()
    _, info = chain.reset(2)
    assert chain.step(f"<answer>{info['task']['answer']}</answer>")[1] == 1.0


def test_reasoning_gym_clear_errors():
    with pytest.raises(UsageError, match="no dataset 'chain_summ'.*chain_sum"):
        load_env("reasoning_gym:chain_summ", {})()
    with pytest.raises(UsageError, match="do not fit"):
        load_env("reasoning_gym:chain_sum", {"colour": "red"})()
    with pytest.raises(UsageError, match="do not fit"):
        load_env("reasoning_gym:chain_sum", {"min_terms": 5, "max_terms": 2})()
    with pytest.raises(UsageError, match="set by the reasoning_gym adapter"):
        load_env("reasoning_gym:chain_sum", {"seed": 3})()
    env = load_env("reasoning_gym:rubiks_cube", {})()  # many right answers, none stored: no expert
    env.reset(0)
    with pytest.raises(UsageError, match="no single reference answer"):
        env.expert_action()


# --- gymnasium --------------------------------------------------------------------


@pytest.mark.parametrize(
    "env_id, names",
    [
        ("FrozenLake-v1", ["left", "down", "right", "up"]),
        ("Taxi-v4", ["south", "north", "east", "west", "pickup", "dropoff"]),
    ],
)
def test_gymnasium_random_policy_end_to_end(env_id, names):
    factory = load_env(f"gymnasium:{env_id}", {})
    rng = random.Random(0)
    replies = names + [str(i) for i in range(len(names))] + ["no idea"]
    episodes = [play(factory(), seed, lambda _: rng.choice(replies)) for seed in range(3)]
    for total, info, transcript in episodes:
        assert "success" in info  # every episode ran to the env's own end
        assert total == pytest.approx(sum(reward for _, _, reward in transcript[1:]))
        assert "\x1b" not in "".join(text for _, text, _ in transcript[1:])  # colours became tags
    assert any("Invalid action" in text for _, _, transcript in episodes for _, text, _ in transcript[1:])
    rng = random.Random(0)
    assert play(factory(), 0, lambda _: rng.choice(replies)) == episodes[0]


def test_gymnasium_names_and_indices_are_the_same_action_and_success_is_detected():
    env = load_env("gymnasium:FrozenLake-v1", {"is_slippery": False})()
    obs, _ = env.reset(0)
    assert "left (0)" in obs[0]["content"] and obs[1]["content"].startswith("<red>S</red>")
    by_name = env.step("I go right")[0]
    env.reset(0)
    assert env.step("2")[0] == by_name
    path = ["down", "down", "right", "down", "right", "right"]
    total, info, _ = play(env, 0, lambda _, moves=iter(path): next(moves))
    assert total == 1.0 and info["success"]
    _, info, _ = play(env, 0, lambda _, moves=iter(["right", "down"]): next(moves))  # into a hole
    assert info["success"] is False


def test_gymnasium_an_invalid_action_costs_at_least_a_step():
    env = load_env("gymnasium:Taxi-v4", {})()
    env.reset(0)
    _, step_reward, *_ = env.step("south")
    text, reward, terminated, _, info = env.step("I am not sure")
    assert reward == -1.0 <= step_reward and not info["valid"] and not terminated and "Reward: -1" in text
    env = load_env("gymnasium:Taxi-v4", {"invalid_action_reward": -5})()
    env.reset(0)
    assert env.step("?")[1] == -5.0
    with pytest.raises(UsageError, match="invalid_action_reward: expected a number"):
        load_env("gymnasium:Taxi-v4", {"invalid_action_reward": "high"})()


class _Echo(gymnasium.Env):
    observation_space = gymnasium.spaces.Text(64, charset=string.printable)
    action_space = gymnasium.spaces.Text(64, charset=string.printable)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "Say something.", {}

    def step(self, action):
        return f"You said: {action}", 1.0, True, False, {}


class _Pixels(gymnasium.Env):
    observation_space = gymnasium.spaces.Box(0, 255, (8, 8, 3), dtype="uint8")
    action_space = gymnasium.spaces.Discrete(2)


def _register(env_id, cls):
    if env_id not in gymnasium.registry:
        gymnasium.register(env_id, entry_point=cls)


def test_gymnasium_text_spaces_pass_text_through():
    _register("rlcli-test/Echo-v0", _Echo)
    env = load_env("gymnasium:rlcli-test/Echo-v0", {})()
    obs, _ = env.reset(0)
    assert obs[1]["content"] == "Say something."
    text, reward, terminated, _, info = env.step("hello there")
    assert text.startswith("You said: hello there") and reward == 1.0 and terminated and info["success"]


def test_gymnasium_clear_errors():
    _register("rlcli-test/Pixels-v0", _Pixels)
    with pytest.raises(UsageError, match="cannot be written as text"):
        load_env("gymnasium:rlcli-test/Pixels-v0", {})()
    with pytest.raises(UsageError, match="actions are Box"):
        load_env("gymnasium:Pendulum-v1", {})()
    with pytest.raises(UsageError, match="gymnasium:NoSuchEnv-v0"):
        load_env("gymnasium:NoSuchEnv-v0", {})()


# --- through the CLI and the rollout engine ------------------------------------------


def test_envs_try_runs_adapters():
    runner = CliRunner()
    out = runner.invoke(app, ["try", "reasoning_gym:leg_counting", "--policy", "expert", "--seed", "3"])
    assert out.exit_code == 0 and "solved in 1 turns" in out.output and "not solved" not in out.output
    out = runner.invoke(app, ["try", "textarena:GuessTheNumber-v0", "--policy", "human"], input="[10]\n[red]\n[5]\n")
    assert out.exit_code == 0 and "[red]" in out.output  # shown literally, not as terminal markup
    out = runner.invoke(app, ["try", "textarena:TicTacToe-v0", "--policy", "random"])
    assert isinstance(out.exception, UsageError) and "two-player game" in str(out.exception)


def test_a_missing_extra_says_what_to_install(monkeypatch, capsys):
    from rlcli.cli.app import main

    monkeypatch.delitem(sys.modules, "rlcli.envs.adapters.textarena", raising=False)
    monkeypatch.setitem(sys.modules, "textarena", None)  # as if the package were not installed
    with pytest.raises(SystemExit) as exit_info:
        main(["envs", "try", "textarena:GuessTheNumber-v0"])
    assert exit_info.value.code == 2
    assert "needs the 'textarena' package: pip install 'rlcli[envs]'" in capsys.readouterr().err


ADAPTER_ENVS = ["textarena:GuessTheNumber-v0", "reasoning_gym:chain_sum", "gymnasium:FrozenLake-v1"]


@pytest.mark.parametrize("env_name", ADAPTER_ENVS)
def test_tiny_model_rollout_on_adapter_envs(tmp_path, env_name):
    from rlcli.engine.rollout import run_rollout_stage

    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": env_name, "max_turns": 2},
        rollout={"tasks": 1, "group_size": 2, "max_new_tokens": 4, "batch_size": 2},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_rollout_stage(ctx, stage="rollout", policy="base", split="train")
    assert summary.episodes == 2 and summary.failed == 0
    episodes = list(ctx.rundb.db.query("select * from episodes where run = ?", [ctx.run]))
    assert all(e["num_turns"] >= 1 and json.loads(e["task"]) for e in episodes)


def test_expert_rollout_through_the_engine(tmp_path):
    from rlcli.engine.rollout import run_rollout_stage

    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": "reasoning_gym:basic_arithmetic", "max_turns": 1},
        rollout={"tasks": 4, "group_size": 1},
    )
    ctx = make_ctx(recipe, tmp_path / "runs")
    summary = run_rollout_stage(ctx, stage="demos", policy="expert", split="eval")
    assert summary.episodes == 4 and summary.success_rate == 1.0
