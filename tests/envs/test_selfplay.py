"""Two-player games against a model (issue 37): self-play, pools of the run's checkpoints, fixed
checkpoints, eval against opponents, and the refusals."""

from __future__ import annotations

import json
import sqlite3

import pytest

from helpers import cli, kill_when, make_ctx, run_in_process, write_recipe

pytest.importorskip("textarena")

from rlcli.envs.adapters.textarena_opponents import GAMES  # noqa: E402
from rlcli.envs.loading import load_env  # noqa: E402


def test_engine_mode_serves_the_seat_to_move_and_scores_both_at_the_end():
    env = load_env("textarena:TicTacToe-v0", {"opponent": "caller"})()
    obs, info = env.reset(3)
    to_move, seen = info["to_move"], {0: [obs], 1: []}
    assert to_move == env.inner.state.current_player_id and "Tic Tac Toe" in obs
    legal, _ = GAMES[type(env.inner).__name__]
    done, players = False, []
    while not done:
        obs, reward, done, _, step = env.step(legal(env.inner)[0])
        players.append(step["player"])
        if not done:
            assert step["to_move"] == 1 - step["player"], "the seats alternate"
            seen[step["to_move"]].append(obs)
    assert players[:2] == [to_move, 1 - to_move]
    returns = {int(k): v for k, v in step["returns"].items()}
    assert sum(returns.values()) == 0 and reward == returns[step["player"]]
    for seat in (0, 1):
        assert step["seats"][str(seat)]["score"] == returns[seat]
        assert step["endings"][str(seat)].endswith(f"Score: {returns[seat]:g}")
    # Each seat sees the other's moves as the opponent's, never its own.
    other_first = seen[1 - to_move][0]
    assert f"Player {to_move} (your opponent) moved" in other_first
    assert f"Player {1 - to_move} (your opponent)" not in other_first


# --- on the tiny model ------------------------------------------------------------------------


def _recipe(tmp_path, env=None, **sections):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return write_recipe(
        tmp_path / "r.yaml",
        env={"name": "textarena:TicTacToe-v0", "opponent": "self", "max_turns": 4, **(env or {})},
        model={"max_length": 1024},
        rollout={"tasks": 2, "group_size": 2, "max_new_tokens": 5, "batch_size": 2, **sections.pop("rollout", {})},
        grpo={"iterations": 2, "advantage": "rae", "rae_decay": 0.5, **sections.pop("grpo", {})},
        eval={"tasks": 4, "opponents": ["random", "base"], **sections.pop("eval", {})},
        **sections,
    )


def _turns(ctx, episode_id):
    return list(ctx.rundb.db["turns"].rows_where("episode_id = ?", [episode_id], order_by="turn_index"))


def test_self_play_records_both_seats_each_on_its_own_tokens(tmp_path):
    from rlcli.engine.rollout import run_rollout_stage
    from rlcli.store.episodes import stage_episodes

    ctx = make_ctx(_recipe(tmp_path), tmp_path / "runs")
    run_rollout_stage(ctx, stage="play", policy="base", split="train")
    episodes = stage_episodes(ctx.store, "play")
    # 2 tasks x 2 games, each game two episodes: seat 0 at sample 2g, seat 1 at 2g + 1.
    assert sorted((e.task_index, e.sample_index) for e in episodes) == [(t, s) for t in range(2) for s in range(4)]
    for ep in episodes:
        assert ep.status == "ok", ep.error
        assert ep.task["seat"] == ep.sample_index % 2 and ep.task["opponent"] == "self"
        turns = _turns(ctx, ep.id)
        # The episode's turns are its seat's replies, and only those: what trains is its own tokens.
        assistant = [m["content"] for m in ep.messages if m["role"] == "assistant"]
        assert [t["text"] for t in turns] == assistant and len(turns) == ep.num_turns
        assert all(json.loads(t["info"])["player"] == ep.task["seat"] for t in turns), "the seat that acted"
    # The two seats of a game: one moved first; the other reads its first move as the opponent's.
    for t in range(2):
        for g in range(2):
            seat0, seat1 = (
                next(e for e in episodes if (e.task_index, e.sample_index) == (t, 2 * g + s)) for s in (0, 1)
            )
            assert seat0.task["first"] != seat1.task["first"] and seat0.seed == seat1.seed
            first, second = (seat0, seat1) if seat0.task["first"] else (seat1, seat0)
            opening = first.messages[1]["content"]
            if opening.strip():
                assert "(your opponent) moved" in second.messages[0]["content"]
            if first.end_reason == "terminated" and second.end_reason == "terminated":
                assert first.env_return + second.env_return == 0, "zero-sum per seat"


def test_self_play_grpo_trains_both_seats_in_groups_split_by_seat(tmp_path):
    from rlcli.engine.grpo.loop import run_grpo
    from rlcli.store.episodes import episodes_for_training, stage_episodes

    ctx = make_ctx(_recipe(tmp_path, grpo={"iterations": 1}), tmp_path / "runs")
    run_grpo(ctx)
    played = stage_episodes(ctx.store, "rollout/0")
    assert len(played) == 2 * 2 * 2 and {e.task["seat"] for e in played} == {0, 1}
    trained = episodes_for_training(ctx.store, "rollout/0", "grpo")
    assert len(trained) == len(played), "both seats' episodes are trained on"
    from rlcli.engine.grpo.batch import role_groups

    groups = role_groups(trained).tolist()
    keys = {(e.episode.task_index, e.episode.task["seat"]) for e in trained}
    assert len(set(groups)) == len(keys) == 4, "one group per task and seat"


def test_a_fixed_opponent_plays_beside_the_policy_and_is_never_stored(tmp_path):
    from rlcli.engine.rollout import run_rollout_stage
    from rlcli.store.episodes import stage_episodes

    ctx = make_ctx(_recipe(tmp_path, env={"opponent": "base"}, eval={"opponents": None}), tmp_path / "runs")
    run_rollout_stage(ctx, stage="play", policy="base", split="train")
    episodes = stage_episodes(ctx.store, "play")
    # One episode per game: the policy's seat (the seed's parity); the opponent's moves are its context.
    assert sorted((e.task_index, e.sample_index) for e in episodes) == [(t, g) for t in range(2) for g in range(2)]
    for ep in episodes:
        assert ep.task["seat"] == ep.seed % 2 and ep.task["opponent"] == "base"
        assert all(json.loads(t["info"])["player"] == ep.task["seat"] for t in _turns(ctx, ep.id))
        if not ep.task["first"]:
            assert "(your opponent) moved" in ep.messages[0]["content"]


def test_pool_plays_self_until_a_checkpoint_exists_then_draws_one_reproducibly(tmp_path):
    from rlcli.engine.games import POOL_EVENT, draw_from_pool
    from rlcli.engine.grpo.loop import run_grpo
    from rlcli.store.episodes import stage_episodes
    from rlcli.store.events import list_events

    ctx = make_ctx(
        _recipe(tmp_path, env={"opponent": "pool"}, grpo={"iterations": 3, "checkpoint_every": 1}), tmp_path / "runs"
    )
    run_grpo(ctx)
    opponents = [{e.task["opponent"] for e in stage_episodes(ctx.store, f"rollout/{i}")} for i in range(3)]
    assert opponents[0] == {"self"}
    [event] = list_events(ctx.store, POOL_EVENT)
    assert event.iteration == 0 and "plays self" in event.message
    for i in (1, 2):
        drawn = draw_from_pool(ctx, "pool", f"rollout/{i}", i)
        assert drawn is not None and drawn.iteration < i
        assert opponents[i] == {f"ckpt-{drawn.id}"}, "the draw is the same when made again (a resume)"
        # Against a model other than the policy, only the policy's seat is stored.
        assert len(stage_episodes(ctx.store, f"rollout/{i}")) == 2 * 2


def test_kill_9_in_a_self_play_iteration_resumes_to_the_same_episodes(tmp_path):
    recipe = _recipe(tmp_path, env={"opponent": "pool:1"}, grpo={"iterations": 3, "checkpoint_every": 1})
    clean, killed = tmp_path / "clean", tmp_path / "killed"
    done = run_in_process(["train", "grpo", "-r", str(recipe)], clean)
    assert done.returncode == 0, done.stderr
    # Killed once rollout/1's first chunk (of two) is stored: mid-iteration, against a drawn checkpoint.
    count = "select count(*) from episodes where stage = 'rollout/1'"
    assert kill_when(["train", "grpo", "-r", str(recipe)], killed, count, 1, timeout=300) >= 1
    done = run_in_process(["train", "grpo", "-r", str(recipe)], killed)
    assert done.returncode == 0, done.stderr

    def episodes(runs):
        with sqlite3.connect(runs / "rlcli.db") as conn:
            return conn.execute(
                "select stage, task_index, sample_index, task, messages, env_return from episodes "
                "where stage like 'rollout/%' order by stage, task_index, sample_index"
            ).fetchall()

    assert episodes(killed) == episodes(clean)


def test_eval_against_each_opponent_is_a_stage_of_its_own(tmp_path, capsys, monkeypatch):
    from rlcli.engine.evaluate import run_eval
    from rlcli.store.names import parse_stage

    ctx = make_ctx(_recipe(tmp_path), tmp_path / "runs")
    results = run_eval(ctx, ["base"])
    assert [r.stage for r in results] == ["eval/base/vs-random", "eval/base/vs-base"]
    for result, opponent in zip(results, ["random", "base"]):
        assert parse_stage(result.stage).opponent == opponent
        assert {row["opponent"] for row in result.details["games"]} == {opponent}
        assert {row["seat"] for row in result.details["games"]} == {"first", "second", "both"}
    assert parse_stage("eval/ckpt-3@t0.8-k4/vs-ckpt-2").name == "eval/ckpt-3@t0.8-k4/vs-ckpt-2"


@pytest.mark.parametrize(
    "env, extra, message",
    [
        (
            {"opponent": "self"},
            {"eval": {"opponents": None}},
            "no fixed opponent to evaluate against; set eval.opponents",
        ),
        ({"opponent": "pool"}, {"grpo": {"max_staleness": 1}}, "which the asynchronous rollout worker does not do"),
        ({"opponent": "champion"}, {}, "expected random or bot"),
        ({"opponent": None, "kwargs": {"opponent": "bot"}}, {"eval": {"opponents": None}}, "set env.opponent instead"),
    ],
)
def test_bad_opponents_are_refused_in_one_sentence(tmp_path, capsys, env, extra, message):
    recipe = _recipe(tmp_path, env=env, **extra)
    code, _, err = cli(capsys, "--runs-dir", tmp_path / "runs", "rollout", "-r", recipe)
    assert code == 2 and message in " ".join(err.split()) and "Traceback" not in err
    assert not (tmp_path / "runs" / "t").exists()


def test_an_opponent_checkpoint_of_another_run_is_refused_before_any_work(tmp_path, capsys):
    from rlcli.store.stages import stage_done  # noqa: F401

    runs = tmp_path / "runs"
    other = _recipe(tmp_path / "other", env={"opponent": "random"}, eval={"opponents": None}, run={"name": "other"})
    code, _, err = cli(
        capsys, "--runs-dir", runs, "train", "grpo", "-r", other, "grpo.iterations=1", "grpo.checkpoint_every=1"
    )
    assert code == 0, err
    with sqlite3.connect(runs / "rlcli.db") as conn:
        [(ckpt,)] = conn.execute("select id from checkpoints where run = 'other'").fetchall()
    mine = _recipe(tmp_path / "mine", env={"opponent": ckpt}, eval={"opponents": None})
    code, _, err = cli(capsys, "--runs-dir", runs, "rollout", "-r", mine)
    assert code == 2, err
    assert f"env.opponent: checkpoint {ckpt} belongs to run 'other'" in " ".join(err.split())
    with sqlite3.connect(runs / "rlcli.db") as conn:
        assert conn.execute("select count(*) from stages where run = 't'").fetchone()[0] == 0


# --- Elo over checkpoints -----------------------------------------------------------------------


def test_elo_fit_solves_the_bradley_terry_equations():
    from rlcli.report.ratings import bradley_terry, elo_ratings
    from rlcli.store.records import PlayedGame

    games = (
        [PlayedGame("ckpt-2", "random", 1.0)] * 7
        + [PlayedGame("ckpt-2", "random", 0.5)] * 2
        + [PlayedGame("ckpt-2", "random", 0.0)]
        + [PlayedGame("base", "random", 1.0)] * 4
        + [PlayedGame("base", "random", 0.0)] * 4
        + [PlayedGame("ckpt-2", "base", 1.0)] * 3
        + [PlayedGame("ckpt-2", "base", 0.0)]
    )
    ratings = {r.player: r for r in elo_ratings(games)}
    assert [r.player for r in elo_ratings(games)] == ["ckpt-2", "base", "random"]
    assert ratings["random"].elo == pytest.approx(1000)
    assert (ratings["ckpt-2"].wins, ratings["ckpt-2"].draws, ratings["ckpt-2"].losses) == (10, 2, 2)
    assert (ratings["random"].games, ratings["base"].games) == (18, 12)
    # At the fit, each player's expected score equals its score (its virtual draw against strength 1 included).
    strength = bradley_terry(games)
    assert 10 ** ((ratings["ckpt-2"].elo - ratings["base"].elo) / 400) == pytest.approx(
        strength["ckpt-2"] / strength["base"]
    )
    for player, p in strength.items():
        score = sum(g.score for g in games if g.player == player) + sum(
            1 - g.score for g in games if g.opponent == player
        )
        faced = [g.opponent if g.player == player else g.player for g in games if player in (g.player, g.opponent)]
        expected = sum(p / (p + strength[other]) for other in faced) + p / (p + 1)
        assert expected == pytest.approx(score + 0.5, abs=1e-6)


def test_runs_show_rates_checkpoints_from_the_stored_games(tmp_path, capsys, monkeypatch):
    from rlcli.cli import common
    from rlcli.engine.evaluate import run_eval

    ctx = make_ctx(_recipe(tmp_path, eval={"opponents": ["random", "bot"]}), tmp_path / "runs")
    run_eval(ctx, ["base"])
    code, out, _ = cli(capsys, "--runs-dir", tmp_path / "runs", "runs", "show", "t", "--json")
    assert code == 0
    ratings = {r["player"]: r for r in json.loads(out)["ratings"]}
    assert set(ratings) == {"base", "random", "bot"} and ratings["random"]["elo"] == pytest.approx(1000)
    with sqlite3.connect(tmp_path / "runs" / "rlcli.db") as conn:
        finished = conn.execute(
            "select count(*) from episodes where stage like 'eval/base/vs-%' and status = 'ok' "
            "and (env_return != 0 or end_reason = 'terminated')"
        ).fetchone()[0]
    assert ratings["base"]["games"] == finished == ratings["random"]["games"] + ratings["bot"]["games"]
    monkeypatch.setattr(common.console, "width", 200)
    code, out, _ = cli(capsys, "--runs-dir", tmp_path / "runs", "runs", "show", "t")
    assert code == 0 and "Elo from the held-out games" in out and "vs" in out
