"""Two-player TextArena games against opponents inside the env, SPIRAL's role-conditioned advantages
(grpo.advantage rae) and eval's win/draw/loss table (issue 37); model opponents: test_selfplay.py."""

from __future__ import annotations

import json
import random

import pytest
import torch

from helpers import cli, make_ctx, write_recipe
from rlcli.errors import UsageError

pytest.importorskip("textarena")

from rlcli.engine.grpo import advantages  # noqa: E402
from rlcli.envs.adapters.textarena_opponents import GAMES, opponent_move  # noqa: E402
from rlcli.envs.loading import load_env  # noqa: E402

TWO_PLAYER = ["TicTacToe-v0", "ConnectFour-v0", "KuhnPoker-v0", "SimpleNegotiation-v0"]


def _play(env, seed: int, rng: random.Random) -> tuple[dict, list[dict], list[str]]:
    """A game with uniformly random legal moves for the policy: (task, each turn's info, observations)."""
    obs, info = env.reset(seed)
    observations, infos, done = [obs], [], False
    while not done:
        legal, _ = GAMES[type(env.inner).__name__]
        obs, reward, done, _, turn = env.step(rng.choice(legal(env.inner)))
        observations.append(obs)
        infos.append({**turn, "reward": reward})
    return info["task"], infos, observations


@pytest.mark.parametrize("game", TWO_PLAYER)
def test_two_player_games_against_random_and_bot_with_seats_alternating(game):
    factory = load_env(f"textarena:{game}", {"opponent": ["random", "bot"]})
    seen = set()
    for seed in range(8):
        env = factory()
        task, infos, observations = _play(env, seed, random.Random(seed))
        # The seat alternates with the seed, the opponent every two seeds.
        assert task["seat"] == seed % 2 and task["opponent"] == ["random", "bot"][(seed // 2) % 2]
        seen.add((task["seat"], task["opponent"]))
        assert all(i["player"] == task["seat"] for i in infos), "every recorded turn is the policy's seat"
        last = infos[-1]
        rewards = env.inner.state.rewards
        assert sum(rewards.values()) == 0, "zero-sum"
        assert last["reward"] == rewards[task["seat"]] == last["score"]
        assert sum(i["reward"] for i in infos[:-1]) == 0, "scored once, at the end"
        assert last["outcome"] == {1: "win", 0: "draw", -1: "loss"}[int(last["score"])]
        assert last["success"] == (last["outcome"] == "win") and last["seat"] == task["seat"]
        # The opponent's moves reach the policy as observation text, its own are not echoed.
        moves = [m for i in infos for m in i["opponent_moves"]]
        if not task["first"]:
            assert "(your opponent) moved" in observations[0]
        for move in moves[:-1]:
            assert f"(your opponent) moved: {move}" in "\n".join(observations)
        assert f"Player {task['seat']} (your opponent)" not in "\n".join(observations)
    assert seen == {(0, "random"), (1, "random"), (0, "bot"), (1, "bot")}


def test_games_are_deterministic_given_the_seed():
    factory = load_env("textarena:KuhnPoker-v0", {"opponent": "random"})
    first = _play(factory(), 5, random.Random(0))
    assert _play(factory(), 5, random.Random(0)) == first


def test_tictactoe_bot_wins_else_blocks_else_centre():
    env = load_env("textarena:TicTacToe-v0", {"opponent": "bot"})()
    env.reset(0)  # the policy is player 0 ('O') and moves first
    board = env.inner.state.game_state["board"]
    board[0][:] = ["X", "X", ""]  # player 1 ('X') to move could win at 2
    board[1][:] = ["O", "O", ""]  # ... and must otherwise block 5
    env.inner.state.current_player_id = 1
    assert opponent_move("bot", env.inner) == "[2]"
    board[0][:] = ["X", "", ""]
    assert opponent_move("bot", env.inner) == "[5]"
    board[1][:] = ["O", "", ""]
    assert opponent_move("bot", env.inner) == "[4]"
    # Against the bot, random play loses far more than it wins; the bot is also the game's expert.
    factory = load_env("textarena:TicTacToe-v0", {"opponent": "bot"})
    outcomes = [_play(factory(), seed, random.Random(seed))[1][-1]["outcome"] for seed in range(20)]
    assert outcomes.count("loss") >= 15 and outcomes.count("win") <= 1
    assert callable(factory().expert_action)


def test_a_two_player_game_without_an_opponent_is_refused_before_any_stage(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", env={"name": "textarena:TicTacToe-v0"})
    code, _, err = cli(capsys, "--runs-dir", tmp_path / "runs", "rollout", "-r", recipe)
    assert code == 2
    assert "is a two-player game: set env.opponent to random, bot" in " ".join(err.split())
    assert not (tmp_path / "runs" / "t").exists(), "refused before the run was written"
    with pytest.raises(UsageError, match="expected random or bot"):
        load_env("textarena:TicTacToe-v0", {"opponent": "self"})
    with pytest.raises(UsageError, match="single-player game; drop the opponent"):
        load_env("textarena:GuessTheNumber-v0", {"opponent": "random"})


# --- on the tiny model ------------------------------------------------------------------------


def _recipe(tmp_path, **grpo_options):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return write_recipe(
        tmp_path / "r.yaml",
        env={"name": "textarena:TicTacToe-v0", "opponent": ["random", "bot"], "max_turns": 5},
        model={"max_length": 1024},
        rollout={"tasks": 4, "group_size": 2, "max_new_tokens": 6, "batch_size": 8},
        grpo={"iterations": 2, "advantage": "rae", "rae_decay": 0.5, **grpo_options},
        eval={"tasks": 8},
    )


def test_rollout_against_random_and_bot_on_the_tiny_model(tmp_path):
    from rlcli.engine.rollout import run_rollout_stage
    from rlcli.store.episodes import stage_episodes

    ctx = make_ctx(_recipe(tmp_path), tmp_path / "runs")
    run_rollout_stage(ctx, stage="play", policy="base", split="train")
    episodes = stage_episodes(ctx.store, "play")
    assert len(episodes) == 8 and all(ep.status == "ok" for ep in episodes)
    by_task = {ep.task_index: ep.task for ep in episodes}
    assert [(t["seat"], t["opponent"]) for _, t in sorted(by_task.items())] == [
        (0, "random"),
        (1, "random"),
        (0, "bot"),
        (1, "bot"),
    ]
    for ep in episodes:
        assert ep.env_return in (-1.0, 0.0, 1.0)
        # Every assistant message is a sampled turn of the policy; the opponent's moves are user text.
        assistant = [m for m in ep.messages if m["role"] == "assistant"]
        turns = list(ctx.rundb.db["turns"].rows_where("episode_id = ?", [ep.id], order_by="turn_index"))
        assert len(assistant) == len(turns) == ep.num_turns and all(t["completion_ids"] for t in turns)
        # Each turn records the player that acted (the policy's seat) and the opponent's replies.
        assert all(json.loads(t["info"])["player"] == ep.task["seat"] for t in turns)
        if ep.task["seat"] == 1:
            assert "(your opponent) moved" in ep.messages[0]["content"]


def test_rae_baselines_by_hand():
    # Batch 1, decay 0.9, from b = 0: role A returns 1, -1, 1 (mean 1/3); role B -1.
    b1 = advantages.rae_baselines([1.0, -1.0, 1.0, -1.0], ["A", "A", "A", "B"], {}, 0.9)
    assert b1 == pytest.approx({"A": 0.1 / 3, "B": -0.1})
    # Batch 2: only A played (mean 0); B keeps its baseline; a new role C starts from 0.
    b2 = advantages.rae_baselines([1.0, -1.0, 0.5], ["A", "A", "C"], b1, 0.9)
    assert b2 == pytest.approx({"A": 0.9 * 0.1 / 3, "B": -0.1, "C": 0.05})


def test_rae_in_grpo_by_hand_and_its_baselines_survive_a_resume(tmp_path):
    from rlcli.engine.grpo.batch import build_batch, role_of
    from rlcli.engine.grpo.checkpoints import TRAINER_STATE, checkpoint_folder
    from rlcli.engine.grpo.loop import run_grpo
    from rlcli.engine.grpo.selection import choose_groups
    from rlcli.store.episodes import stage_episodes
    from rlcli.store.names import rollout_stage
    from rlcli.store.records import LabelledEpisode

    # Uninterrupted: two iterations.
    whole = make_ctx(_recipe(tmp_path / "a"), tmp_path / "a" / "runs")
    run_grpo(whole)
    # Interrupted after iteration 0's checkpoint, resumed by a new trainer from the saved state.
    cut = make_ctx(_recipe(tmp_path / "b"), tmp_path / "b" / "runs", ["grpo.iterations=1"])
    run_grpo(cut)
    state0 = torch.load(checkpoint_folder(cut, 0) / TRAINER_STATE, weights_only=True)
    resumed = make_ctx(_recipe(tmp_path / "b"), tmp_path / "b" / "runs", ["grpo.iterations=2"])
    run_grpo(resumed)

    def series(ctx):
        out = {}
        for m in ctx.rundb.metrics(ctx.run):
            if m.key.startswith("train/rae_baseline/"):
                out[(m.key, m.step)] = m.value
        return out

    assert series(whole) == series(resumed) and series(whole)

    # By hand from the stored rewards (env_return is the only reward): b <- 0.5 b + 0.5 mean.
    expected: dict[str, float] = {}
    for it in range(2):
        episodes = stage_episodes(whole.store, rollout_stage(it))
        by_role: dict[str, list[float]] = {}
        for ep in episodes:
            role = f"TicTacToe-v0/seat{ep.task['seat']}"
            by_role.setdefault(role, []).append(ep.env_return)
        for role, values in by_role.items():
            expected[role] = 0.5 * expected.get(role, 0.0) + 0.5 * sum(values) / len(values)
        got = {k.removeprefix("train/rae_baseline/"): v for (k, step), v in series(whole).items() if step == it}
        assert got == pytest.approx({r: expected[r] for r in by_role})
        if it == 0:
            assert state0["rae_baselines"] == pytest.approx(expected)

    # The advantages: reward - baseline[role], every episode kept (no zero-variance dropping).
    batch = build_batch(whole, choose_groups(whole, 1, 0), dict(state0["rae_baselines"]))
    assert batch.rae_baselines == pytest.approx(expected)
    episodes = {ep.id: ep for ep in stage_episodes(whole.store, rollout_stage(1))}
    assert len(batch.sequences) == len(episodes)
    for seq in batch.sequences:
        ep = episodes[seq.episode_id]
        want = ep.env_return - expected[f"TicTacToe-v0/seat{ep.task['seat']}"]
        assert {round(a, 9) for a, m in zip(seq.advantage, seq.mask) if m} == {round(want, 9)}
        assert role_of(LabelledEpisode(ep, "grpo", ep.env_return)) == f"TicTacToe-v0/seat{ep.task['seat']}"


def test_group_relative_advantages_are_computed_within_a_role(tmp_path):
    from rlcli.engine.grpo.batch import role_groups
    from rlcli.store.records import LabelledEpisode

    class Ep:
        def __init__(self, task_index, seat):
            self.task_index, self.task = task_index, {"game": "g", "seat": seat}

    # Two seats in one task (as self-play will have) are two groups.
    episodes = [
        LabelledEpisode(Ep(0, 0), "g", 1.0),
        LabelledEpisode(Ep(0, 1), "g", -1.0),
        LabelledEpisode(Ep(0, 0), "g", 0.0),
    ]
    groups = role_groups(episodes)
    assert groups.tolist() == [0, 1, 0]
    adv = advantages.compute_advantages([1.0, -1.0, 0.0], groups, "dr_grpo")
    assert adv.tolist() == pytest.approx([0.5, 0.0, -0.5])


def test_eval_reports_win_draw_loss_per_opponent_and_seat(tmp_path, capsys, monkeypatch):
    from rlcli.engine.evaluate import run_eval, wilson_interval
    from rlcli.report.tables import games_table
    from rlcli.report.views import eval_view
    from rlcli.store.episodes import stage_episodes

    ctx = make_ctx(_recipe(tmp_path), tmp_path / "runs")
    [result] = run_eval(ctx, ["base"])
    rows = result.details["games"]
    assert [(r["opponent"], r["seat"]) for r in rows] == [
        ("bot", "first"),
        ("bot", "second"),
        ("bot", "both"),
        ("random", "first"),
        ("random", "second"),
        ("random", "both"),
    ]
    episodes = stage_episodes(ctx.store, result.stage)
    for row in rows:
        mine = [
            ep
            for ep in episodes
            if ep.task["opponent"] == row["opponent"]
            and (row["seat"] == "both" or ep.task["first"] == (row["seat"] == "first"))
        ]
        assert row["games"] == len(mine) > 0
        wins = sum(ep.env_return > 0 for ep in mine)
        losses = sum(ep.env_return < 0 for ep in mine)
        assert row["win"] == wins / len(mine) and row["loss"] == losses / len(mine)
        assert (row["win_ci_low"], row["win_ci_high"]) == wilson_interval(wins, len(mine))
        assert (row["loss_ci_low"], row["loss_ci_high"]) == wilson_interval(losses, len(mine))
    table = games_table([eval_view(result)])
    assert table is not None and table.row_count == 6
    from rlcli.cli import common

    # As wide as the table: a terminal's COLUMNS (80 on CI) would fold its title and cut its cells.
    monkeypatch.setattr(common.console, "width", 200)
    code, out, _ = cli(capsys, "--runs-dir", tmp_path / "runs", "eval", "-r", tmp_path / "r.yaml", "-c", "base")
    assert code == 0 and "Games against opponents" in out and "random" in out
