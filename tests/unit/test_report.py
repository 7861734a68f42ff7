"""`rlcli runs show | compare | plot | episodes | export`, on a run database built by hand (trackers:
tests/stages/test_trackers.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import cli
from rlcli.recipe import Recipe
from rlcli.store.blobs import pack_floats, pack_ids
from rlcli.store.checkpoints import add_checkpoint
from rlcli.store.db import DB_NAME, RunDB
from rlcli.store.events import add_event
from rlcli.store.run_store import RunStore

STAGES = [  # (name, status, start second, end second, error)
    ("sft", "done", 0, 30, None),
    *(
        (f"{kind}/{i}", "done", 30 + 10 * i, 35 + 10 * i, None)
        for i in range(3)
        for kind in ("rollout", "label", "train")
    ),
    ("eval/base", "done", 100, 110, None),
    ("eval/ckpt-2", "done", 110, 125, None),
    ("train/3", "failed", 130, 131, "loss is NaN"),
]
REWARD = [0.1, 0.4, 0.7]  # mean reward per iteration
SUCCESS = [0.0, 0.5, 0.75]


def stamp(second: int) -> str:
    return f"2025-01-01T00:{second // 60:02d}:{second % 60:02d}.000+00:00"


def make_run(rundb: RunDB, name: str, *, scale: float = 1.0, evals: bool = True) -> None:
    """A run with stages, episodes (one failed), turns, rewards, metrics, checkpoints and evals."""
    recipe = Recipe()
    recipe.run.description = "hand-built for the report tests"
    rundb.start_run(name, recipe, None)
    db = rundb.db
    for stage, status, start, end, error in STAGES:
        db["stages"].insert(
            {
                "run": name,
                "name": stage,
                "status": status,
                "started_at": stamp(start),
                "finished_at": stamp(end),
                "error": error,
            }
        )
    for it in range(3):
        for task in range(2):
            for sample in range(2):
                failed = it == 1 and task == 1 and sample == 1
                total = round(scale * (it * 0.3 + task * 0.1 + sample * 0.05), 4)
                messages = [
                    {"role": "system", "content": "Answer with a number."},
                    {"role": "user", "content": f"[{it}] What is {task} + {sample}?"},
                    {"role": "assistant", "content": str(task + sample)},
                ]
                episode = (
                    db["episodes"]
                    .insert(
                        {
                            "run": name,
                            "stage": f"rollout/{it}",
                            "iteration": it,
                            "split": "train",
                            "task_index": task,
                            "sample_index": sample,
                            "seed": 7,
                            "policy": "base",
                            "status": "failed" if failed else "ok",
                            "end_reason": "error" if failed else "terminated",
                            "env_return": total,
                            "success": int(total > 0.3 and not failed),
                            "num_turns": 1,
                            "num_tokens": 3,
                            "task": json.dumps({"a": task, "b": sample}),
                            "messages": json.dumps(messages),
                            "template_consistent": 1,
                            "error": "env crashed: boom" if failed else None,
                            "created_at": stamp(40 + it),
                        }
                    )
                    .last_pk
                )
                db["turns"].insert(
                    {
                        "episode_id": episode,
                        "turn_index": 0,
                        "prompt_ids": pack_ids([1, 2, 3, 40000 + task]),
                        "completion_ids": pack_ids([5, 6, sample]),
                        "logprobs": pack_floats([-0.1, -2.5, -0.003]),
                        "text": str(task + sample),
                        "observation": "[]",
                        "reward": total,
                        "terminated": 1,
                        "truncated": 0,
                        "info": "{}",
                        "gen_time_s": 0.01,
                        "env_time_s": 0.001,
                    }
                )
                if not failed:
                    db["rewards"].insert_all(
                        [
                            {
                                "episode_id": episode,
                                "label_set": "grpo",
                                "component": "correct",
                                "value": total,
                                "weight": 1.0,
                                "error": None,
                            },
                            {
                                "episode_id": episode,
                                "label_set": "grpo",
                                "component": "total",
                                "value": total,
                                "weight": None,
                                "error": None,
                            },
                        ]
                    )
        rundb.log_metrics(
            name,
            "grpo",
            it,
            {
                "rollout/reward_mean": REWARD[it] * scale,
                "rollout/reward_std": 0.1,
                "rollout/success_rate": SUCCESS[it],
                "train/loss": 0.5 - 0.1 * it,
                "train/kl": 0.01 * it,
                "train/entropy": 1.5 - 0.2 * it,
            },
        )
    for step in range(5):
        rundb.log_metrics(name, "sft", step, {"sft/loss": 2.0 / (step + 1)})
    add_checkpoint(RunStore(rundb, name), "sft", 0, f"/tmp/{name}/sft", "lora")
    ckpt = add_checkpoint(RunStore(rundb, name), "train/2", 2, f"/tmp/{name}/ckpt-2", "lora")
    if evals:
        for stage, which, ckpt_id, rate in (
            ("eval/base", "base", None, 0.25),
            ("eval/ckpt-2", "latest", ckpt, 0.6 * scale),
        ):
            db["evals"].insert(
                {
                    "run": name,
                    "stage": stage,
                    "checkpoint": which,
                    "checkpoint_id": ckpt_id,
                    "split": "eval",
                    "tasks": 20,
                    "k": 1,
                    "success_rate": rate,
                    "ci_low": rate - 0.15,
                    "ci_high": rate + 0.15,
                    "mean_return": rate,
                    "pass_at_k": rate,
                    "avg_at_k": rate,
                    "mean_turns": 1.0,
                    "mean_tokens": 3.0,
                    "details": json.dumps({"failed_episodes": 0}),
                    "created_at": stamp(120),
                }
            )


@pytest.fixture(scope="module")
def template_db(tmp_path_factory) -> Path:
    """Built once: each test gets a copy, so none can see another's writes."""
    folder = tmp_path_factory.mktemp("template")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(folder)  # start_run records the git commit of the working directory: not the repository's
        rundb = RunDB.open(folder)
        make_run(rundb, "demo")
        make_run(rundb, "other", scale=0.5)
        rundb.start_run("empty", Recipe(), None)
        rundb.close()  # the last connection checkpoints the WAL into rlcli.db
    return folder / DB_NAME


@pytest.fixture
def runs_dir(rlcli_home, template_db, tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)  # nothing a command writes by default may land in the repository
    rlcli_home.mkdir()
    shutil.copy(template_db, rlcli_home / DB_NAME)
    return rlcli_home


@pytest.fixture(autouse=True)
def wide_console(monkeypatch):
    # Tables wrap to the 80 columns of a pipe; the assertions look for whole cells.
    from rlcli.cli.common import console

    monkeypatch.setattr(console, "width", 160)


def test_show_json_has_stable_keys_and_evals(capsys, runs_dir):
    code, out, _ = cli(capsys, "runs", "show", "demo", "--json")
    assert code == 0
    data = json.loads(out)
    assert {"name", "status", "recipe_sha256", "stages", "evals"} <= data.keys()
    assert data["name"] == "demo" and data["description"] == "hand-built for the report tests"
    for stage in data["stages"]:
        assert {"name", "status", "started_at", "finished_at", "error"} <= stage.keys()
    sft = next(s for s in data["stages"] if s["name"] == "sft")
    assert sft["duration_s"] == 30.0
    assert [(e["label"], e["decoding"]) for e in data["evals"]] == [("base", "greedy"), ("latest (#2)", "greedy")]
    assert data["reward_curve"] == pytest.approx(REWARD) and data["success_curve"] == pytest.approx(SUCCESS)
    assert data["episodes"] == {"total": 12, "failed": 1, "replayed_lost": 0}


def test_show_counts_the_lost_episodes_played_again(capsys, runs_dir):
    # Episodes whose env was lost with a killed worker are played again (episodes.lost counts the
    # lost plays; GRPO logs rollout/replayed_lost): runs show says how many, beside failed.
    rundb = RunDB.open(runs_dir)
    try:
        with rundb.transaction() as db:
            db.execute("update episodes set lost = 2 where id = (select min(id) from episodes where run = 'demo')")
            db.execute("update episodes set lost = 1 where id = (select max(id) from episodes where run = 'demo')")
    finally:
        rundb.close()
    code, out, _ = cli(capsys, "runs", "show", "demo", "--json")
    assert code == 0 and json.loads(out)["episodes"] == {"total": 12, "failed": 1, "replayed_lost": 3}
    code, out, _ = cli(capsys, "runs", "show", "demo")
    assert code == 0 and "episodes: 12 (1 failed, 3 replayed_lost)" in out


def test_show_terminal_view(capsys, runs_dir):
    code, out, _ = cli(capsys, "runs", "show", "demo")
    assert code == 0
    # Numbered stages fold into one row; the failed one names its error.
    assert "rollout/0…2" in out and "loss is NaN" in out
    assert "▁" in out and "█" in out  # the reward / success sparklines
    assert "latest (#2)" in out and "Checkpoints" in out and "Latest metrics" in out


def test_compare_json_and_table(capsys, runs_dir):
    code, out, _ = cli(capsys, "runs", "compare", "demo", "other", "--json")
    assert code == 0
    demo, other = json.loads(out)
    assert demo["best_evals"]["latest"]["success_rate"] == pytest.approx(0.6)
    assert other["best_evals"]["latest"]["success_rate"] == pytest.approx(0.3)
    assert other["latest_metrics"]["rollout/reward_mean"] == pytest.approx(0.35)
    assert demo["reward_curve"] == pytest.approx(REWARD)
    code, out, _ = cli(capsys, "runs", "compare", "demo", "other", "empty")
    assert code == 0 and "eval success: latest" in out and "60.0%" in out


def test_compare_folds_checkpoints_evaluated_by_id_into_one_row(capsys, runs_dir):
    rundb = RunDB.open(runs_dir)
    try:
        template = next(rundb.db["evals"].rows_where("run = 'demo' and checkpoint = 'latest'"))
        for ckpt_id, rate in ((5, 0.45), (7, 0.55), (9, 0.5)):  # as grpo.eval_every records them
            row = {**template, "checkpoint": str(ckpt_id), "checkpoint_id": ckpt_id, "success_rate": rate}
            rundb.db["evals"].insert({k: v for k, v in row.items() if k != "id"})
    finally:
        rundb.close()
    code, out, _ = cli(capsys, "runs", "compare", "demo", "other", "--json")
    demo = json.loads(out)[0]
    assert set(demo["best_evals"]) == {"base", "latest", "other checkpoints"}
    assert demo["best_evals"]["other checkpoints"]["checkpoint_id"] == 7
    code, out, _ = cli(capsys, "runs", "compare", "demo", "other")
    assert code == 0 and "eval success: other checkpoints" in out and "55.0% [45%–75%] ckpt 7" in out
    assert "eval success: 5" not in out and "eval success: 9" not in out


def test_plot_writes_a_real_png(capsys, runs_dir, tmp_path):
    from matplotlib.image import imread

    png = tmp_path / "plots" / "demo.png"
    code, out, _ = cli(capsys, "runs", "plot", "demo", "--out", png)
    assert code == 0 and out.strip() == str(png)
    assert png.stat().st_size > 10_000
    pixels = imread(png)[..., :3].reshape(-1, 3)
    assert len({tuple(p) for p in pixels[:: max(1, len(pixels) // 50_000)]}) > 10


def test_plot_eval_bars_at_100_percent(capsys, runs_dir, tmp_path):
    # Regression: Wilson's upper end at 100% is 0.9999999999999999, a negative error bar for matplotlib.
    from rlcli.engine.evaluate import wilson_interval
    from rlcli.store.db import RunDB

    rundb = RunDB.open(runs_dir)
    low, high = wilson_interval(48, 48)
    rundb.db.execute("update evals set success_rate = 1.0, ci_low = ?, ci_high = ? where run = 'demo'", [low, high])
    rundb.db.conn.commit()
    rundb.close()
    code, _, err = cli(capsys, "runs", "plot", "demo", "--out", tmp_path / "full.png")
    assert code == 0, err


def test_plot_json_names_the_file(capsys, runs_dir, tmp_path):
    png = tmp_path / "demo.png"
    code, out, _ = cli(capsys, "runs", "plot", "demo", "--out", png, "--json")
    data = json.loads(out)
    assert code == 0 and data["run"] == "demo" and data["files"] == [str(png)]
    assert data["series"]["rollout/reward_mean"]["values"] == [0.1, 0.4, 0.7]
    assert [e["label"] for e in data["evals"]] == ["base", "latest (#2)"]
    assert png.stat().st_size > 5_000


def test_plot_default_path_and_chosen_metrics(capsys, runs_dir):
    code, out, _ = cli(capsys, "runs", "plot", "demo", "-m", "train/kl", "-m", "sft/loss")
    assert code == 0 and Path(out.strip()) == runs_dir / "demo" / "metrics.png"
    assert Path(out.strip()).stat().st_size > 5_000


def test_plot_never_replaces_a_file_unasked_and_writes_atomically(capsys, runs_dir, tmp_path):
    out = tmp_path / "mine.png"
    out.write_text("my notes")
    code, _, err = cli(capsys, "runs", "plot", "demo", "--out", out)
    assert code == 2 and "pass --overwrite" in err and len(err.strip().splitlines()) == 1
    assert out.read_text() == "my notes"
    code, _, err = cli(capsys, "runs", "plot", "demo", "--out", out, "--overwrite")
    assert code == 0, err
    assert out.read_bytes().startswith(b"\x89PNG") and list(tmp_path.glob(".mine.png.*")) == []
    code, _, err = cli(capsys, "runs", "plot", "demo", "--out", tmp_path)
    assert code == 2 and "it is a folder" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["empty"], "nothing to plot"),
        (["demo", "--metric", "train/nope"], "no metric 'train/nope'"),
        (["demo", "--out", "plot.txt"], ".png"),
    ],
)
def test_plot_bad_input_exits_2(capsys, runs_dir, args, message):
    code, _, err = cli(capsys, "runs", "plot", *args)
    assert code == 2 and message in err


def test_episodes_best_and_worst_order_by_total_reward(capsys, runs_dir):
    totals = []
    for flag in ("--best", "--worst"):
        code, out, _ = cli(capsys, "runs", "episodes", "demo", flag, "--limit", "12", "--json")
        assert code == 0
        episodes = json.loads(out)
        assert len(episodes) == 12 and all(e["label_set"] == "grpo" for e in episodes)
        assert episodes[-1]["status"] == "failed" and episodes[-1]["reward"] is None  # unrewarded last
        rewards = [e["reward"] for e in episodes[:-1]]
        assert rewards == sorted(rewards, reverse=flag == "--best")
        assert all(e["rewards"]["total"]["value"] == e["reward"] for e in episodes[:-1])
        totals.append(rewards[0])
    assert totals == [pytest.approx(0.75), 0.0]


def test_episodes_filters_and_panels(capsys, runs_dir):
    code, out, _ = cli(capsys, "runs", "episodes", "demo", "--iteration", "1", "--json")
    assert code == 0 and {e["stage"] for e in json.loads(out)} == {"rollout/1"}
    code, out, _ = cli(capsys, "runs", "episodes", "demo", "--stage", "rollout/1", "--worst", "-n", "4")
    assert code == 0
    # Messages render verbatim (the "[1]" is not taken for markup); the failed episode shows its error.
    assert "[1] What is 0 + 0?" in out and "assistant" in out and "correct" in out
    assert "env crashed: boom" in out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--stage", "rollout/9"], "stages with episodes: rollout/0, rollout/1, rollout/2"),
        (["--label-set", "nope"], "label sets: grpo"),
        (["--best", "--worst"], "exclude each other"),
    ],
)
def test_episodes_bad_input_exits_2(capsys, runs_dir, args, message):
    code, _, err = cli(capsys, "runs", "episodes", "demo", *args)
    assert code == 2 and message in err


def read_table(path: Path) -> list[dict]:
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in path.read_text().splitlines()]
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pylist()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_export_round_trips(capsys, runs_dir, tmp_path, fmt):
    rundb = RunDB.open(runs_dir)
    try:
        add_event(
            RunStore(rundb, "demo"), "train/2", 2, "no_signal", "GRPO is getting no signal", {"iterations": [0, 1, 2]}
        )
        add_event(RunStore(rundb, "empty"), "train/0", 0, "no_signal", "another run's", {})
    finally:
        rundb.close()
    out_dir = tmp_path / f"export-{fmt}"
    code, out, _ = cli(capsys, "runs", "export", "demo", "--format", fmt, "--out", out_dir)
    assert code == 0 and out.strip() == str(out_dir)
    rundb = RunDB.open(runs_dir)
    try:
        episodes = read_table(out_dir / f"episodes.{fmt}")
        assert [e["id"] for e in episodes] == [
            r["id"] for r in rundb.db["episodes"].rows_where("run = 'demo'", order_by="id")
        ]
        stored = rundb.db["episodes"].get(episodes[0]["id"])["messages"]  # JSON text
        # JSONL nests it; parquet keeps the text (a column has one type; a message's content varies).
        assert episodes[0]["messages"] == (json.loads(stored) if fmt == "jsonl" else stored)
        turns = read_table(out_dir / f"turns.{fmt}")
        assert len(turns) == 12
        first = next(t for t in turns if t["episode_id"] == episodes[1]["id"])
        assert first["prompt_ids"] == [1, 2, 3, 40000] and first["completion_ids"] == [5, 6, 1]
        assert first["logprobs"] == pytest.approx([-0.1, -2.5, -0.003], rel=1e-6)
        rewards = read_table(out_dir / f"rewards.{fmt}")
        stored = {
            (r["episode_id"], r["component"]): r["value"]
            for r in rundb.db.query(
                "select r.* from rewards r join episodes e on e.id = r.episode_id where e.run = 'demo'"
            )
        }
        assert {(r["episode_id"], r["component"]): r["value"] for r in rewards} == stored
        metrics = read_table(out_dir / f"metrics.{fmt}")
        assert len(metrics) == 3 * 6 + 5 and all(m["run"] == "demo" for m in metrics)
        assert {m["key"]: m["value"] for m in metrics if m["step"] == 2 and m["stage"] == "grpo"}["train/kl"] == 0.02
        evals = read_table(out_dir / f"evals.{fmt}")
        assert [e["success_rate"] for e in evals] == [0.25, 0.6]
        events = read_table(out_dir / f"run_events.{fmt}")
        assert [(e["kind"], e["iteration"]) for e in events] == [("no_signal", 2)]
        details = events[0]["details"]
        assert (details if fmt == "jsonl" else json.loads(details)) == {"iterations": [0, 1, 2]}
        for table in ("task_stats", "replays", "dpo_pairs"):
            assert read_table(out_dir / f"{table}.{fmt}") == [], "exported, with no rows in this run"
        run = json.loads((out_dir / "run.json").read_text())
        assert run["name"] == "demo" and run["recipe"]["run"]["description"]
    finally:
        rundb.close()


def test_export_of_a_running_run_reads_one_snapshot(capsys, runs_dir, tmp_path, monkeypatch):
    """Another process writing to the run while it is exported (a rollout storing a chunk) must not
    leave the files in a mixed state: every table, and run.json, as of one moment."""
    import itertools
    import sqlite3

    import sqlite_utils

    from rlcli.report import export

    stored = itertools.count()

    def store_an_episode() -> None:  # as a running rollout would, from its own connection
        db = sqlite_utils.Database(sqlite3.connect(str(runs_dir / DB_NAME), timeout=30))
        with db.conn:
            first = db.execute("select min(id) from episodes where run = 'demo'").fetchone()[0]
            row = {k: v for k, v in db["episodes"].get(first).items() if k != "id"}
            episode = db["episodes"].insert({**row, "stage": f"rollout/{3 + next(stored)}"}).last_pk
            for turn in db["turns"].rows_where("episode_id = ?", [first]):
                db["turns"].insert({**{k: v for k, v in turn.items() if k != "id"}, "episode_id": episode})
            for reward in db["rewards"].rows_where("episode_id = ?", [first]):
                db["rewards"].insert({**{k: v for k, v in reward.items() if k != "id"}, "episode_id": episode})
            db["metrics"].insert(
                {"run": "demo", "stage": "grpo", "step": 3 + next(stored), "key": "rollout/reward_mean", "value": 1}
            )
        db.conn.close()

    written = export._write_jsonl

    def write_then_store(path, rows):
        count = written(path, rows)
        store_an_episode()  # between one table's read and the next's
        return count

    monkeypatch.setattr(export, "_write_jsonl", write_then_store)
    out_dir = tmp_path / "export"
    code, _, err = cli(capsys, "runs", "export", "demo", "--out", out_dir)
    assert code == 0, err
    episodes = {e["id"] for e in read_table(out_dir / "episodes.jsonl")}
    turns = read_table(out_dir / "turns.jsonl")
    rewards = read_table(out_dir / "rewards.jsonl")
    assert len(episodes) == 12 and len(turns) == 12 and {t["episode_id"] for t in turns} == episodes
    assert {r["episode_id"] for r in rewards} <= episodes
    assert len(read_table(out_dir / "metrics.jsonl")) == 3 * 6 + 5
    run = json.loads((out_dir / "run.json").read_text())
    assert run["episodes"]["total"] == 12
    with sqlite3.connect(runs_dir / DB_NAME) as conn:  # the writes went in: they came after the snapshot
        assert conn.execute("select count(*) from episodes where run = 'demo'").fetchone()[0] > 12


def test_export_of_a_run_without_episodes(capsys, runs_dir, tmp_path):
    import pyarrow.parquet as pq

    code, _, _ = cli(capsys, "runs", "export", "empty", "-f", "parquet", "-o", tmp_path / "e")
    assert code == 0 and read_table(tmp_path / "e" / "turns.parquet") == []
    assert "prompt_ids" in pq.read_schema(tmp_path / "e" / "turns.parquet").names  # columns kept when empty


def test_export_into_a_file_exits_2(capsys, runs_dir, tmp_path):
    (tmp_path / "taken").write_text("")
    code, _, err = cli(capsys, "runs", "export", "demo", "--out", tmp_path / "taken")
    assert code == 2 and "give --out a folder" in err


def test_export_refuses_a_folder_it_did_not_write(capsys, runs_dir, tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    code, _, err = cli(capsys, "runs", "export", "demo", "--out", mine)
    assert code == 2 and "not written by rlcli" in err and "Traceback" not in err
    assert [p.name for p in mine.iterdir()] == ["notes.txt"] and (mine / "notes.txt").read_text() == "keep me"


def test_export_again_needs_overwrite(capsys, runs_dir, tmp_path):
    out_dir = tmp_path / "export"
    assert cli(capsys, "runs", "export", "demo", "--out", out_dir)[0] == 0
    (out_dir / "episodes.jsonl").write_text("edited\n")
    code, _, err = cli(capsys, "runs", "export", "demo", "--out", out_dir)
    assert code == 2 and "--overwrite" in err
    assert (out_dir / "episodes.jsonl").read_text() == "edited\n"
    code, _, _ = cli(capsys, "runs", "export", "demo", "--out", out_dir, "--overwrite")
    assert code == 0 and (out_dir / "episodes.jsonl").read_text() != "edited\n"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no temp folder left


@pytest.mark.parametrize(
    "args",
    [["show", "ghost"], ["compare", "demo", "ghost"], ["plot", "ghost"], ["episodes", "ghost"], ["export", "ghost"]],
)
def test_unknown_run_exits_2(capsys, runs_dir, args):
    code, _, err = cli(capsys, "runs", *args)
    assert code == 2 and "No run named 'ghost'" in err and "Traceback" not in err


def test_without_a_database_exits_2(capsys, tmp_path):
    code, _, err = cli(capsys, "--runs-dir", tmp_path / "nowhere", "runs", "episodes", "demo")
    assert code == 2 and "no run database" in err


def test_every_runs_command_and_option_has_help():
    import typer.main

    from rlcli.cli.runs import app

    group = typer.main.get_command(app)
    for name, command in group.commands.items():
        assert command.help, name
        for param in command.params:
            assert getattr(param, "help", None), f"runs {name} {param.name}"


# --- hostile text ---------------------------------------------------------------------------------

TITLE = "\x1b]0;TITLE\x1b\\"  # sets the window title in most terminals
CLEAR = "\x1b[2J"  # clears the screen


def test_terminal_views_escape_control_characters_and_never_read_names_as_markup(capsys, rlcli_home, tmp_path):
    monkey_text = f"{TITLE}{CLEAR}\x07hi\x9b"
    rundb = RunDB.open(rlcli_home)
    try:
        recipe = Recipe()
        recipe.run.description = f"[/x] desc {CLEAR}"
        rundb.start_run("h", recipe, None)
        db = rundb.db
        stage = "mine[/x]"
        db["stages"].insert({"run": "h", "name": stage, "status": "failed", "error": f"[/x] {CLEAR}"})
        episode = (
            db["episodes"]
            .insert(
                {
                    "run": "h",
                    "stage": stage,
                    "iteration": None,
                    "split": "train",
                    "task_index": 0,
                    "sample_index": 0,
                    "seed": 7,
                    "policy": "base",
                    "status": "ok",
                    "end_reason": "terminated",
                    "env_return": 0.0,
                    "success": 0,
                    "num_turns": 1,
                    "num_tokens": 1,
                    "task": json.dumps({"q": monkey_text}),
                    "messages": json.dumps(
                        [{"role": "user", "content": monkey_text}, {"role": "assistant", "content": monkey_text}]
                    ),
                    "template_consistent": 1,
                    "created_at": stamp(1),
                }
            )
            .last_pk
        )
        db["rewards"].insert_all(
            {"episode_id": episode, "label_set": "[/x]", "component": component, "value": 1.0, "weight": 1.0}
            for component in ("[/x]c", "total")
        )
        add_event(RunStore(rundb, "h"), stage, 0, "[/x]kind", f"[/x] {CLEAR}", {})
        add_checkpoint(RunStore(rundb, "h"), stage, 0, tmp_path / "[/x]", "lora")
    finally:
        rundb.close()
    for args in (["episodes", "h"], ["show", "h"], ["list"], ["compare", "h"], ["tasks", "h"]):
        code, out, err = cli(capsys, "runs", *args)
        assert code == 0, (args, err)
        assert "\x1b" not in out + err and "\x07" not in out and "\x9b" not in out, args
        if args[0] in ("episodes", "show"):
            assert "[/x]" in out, args
    code, out, _ = cli(capsys, "runs", "episodes", "h")
    assert "\\x1b]0;TITLE\\x1b\\" in out and "\\x1b[2J" in out and "[/x]c" in out and "mine[/x]" in out


def test_envs_try_escapes_control_characters_of_the_env_and_the_error(capsys, tmp_path):
    env = tmp_path / "hostile.py"
    env.write_text(
        "class Hostile:\n"
        "    def reset(self, seed):\n"
        f"        return {TITLE + '[/x]'!r}, {{}}\n"
        "    def step(self, action):\n"
        f"        return {CLEAR!r}, 1.0, True, False, {{}}\n"
        "def make_env():\n"
        "    return Hostile()\n"
    )
    code, out, err = cli(capsys, "envs", "try", env, "--policy", "random")
    assert code == 0, err
    assert "\x1b" not in out and "\\x1b]0;TITLE" in out and "[/x]" in out and "\\x1b[2J" in out
    broken = tmp_path / "broken.py"
    broken.write_text(f"def make_env():\n    raise RuntimeError({CLEAR!r})\n")
    code, out, err = cli(capsys, "envs", "try", broken, "--policy", "random")
    assert code == 1 and "\x1b" not in err and "\\x1b[2J" in err


def test_episodes_beyond_sqlites_variable_limit(capsys, rlcli_home, monkeypatch):
    # `runs episodes -n 40000` failed with "too many SQL variables": one parameter per episode shown,
    # over SQLite's limit (32766 by default, 999 before 3.32). Here the limit is 999, with 1200 episodes.
    import sqlite3

    from rlcli.store import db as store_db

    connect = sqlite3.connect

    def low_limit(*args, **kwargs):
        conn = connect(*args, **kwargs)
        conn.setlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER, 999)
        return conn

    rundb = RunDB.open(rlcli_home)
    try:
        rundb.start_run("big", Recipe(), None)
        with rundb.transaction() as db:
            for i in range(1200):
                episode = (
                    db["episodes"]
                    .insert(
                        {
                            "run": "big",
                            "stage": "rollout",
                            "split": "train",
                            "task_index": i,
                            "sample_index": 0,
                            "seed": i,
                            "policy": "base",
                            "status": "ok",
                            "end_reason": "terminated",
                            "env_return": 1.0,
                            "success": 1,
                            "num_turns": 1,
                            "num_tokens": 1,
                            "task": "{}",
                            "messages": "[]",
                            "template_consistent": 1,
                            "created_at": stamp(1),
                        }
                    )
                    .last_pk
                )
                db["rewards"].insert(
                    {"episode_id": episode, "label_set": "l", "component": "total", "value": 1.0, "weight": None}
                )
    finally:
        rundb.close()
    monkeypatch.setattr(store_db.sqlite3, "connect", low_limit)
    code, out, err = cli(capsys, "runs", "episodes", "big", "-n", "1200", "--json")
    assert code == 0, err
    assert len(json.loads(out)) == 1200


def test_numbers_people_read_are_not_in_e_notation():
    """tok/s 1570.3 reads `1,570`, not `1.57e+03`: in table cells and in GRPO's line per iteration."""
    import io

    from rich.console import Console

    from rlcli.engine.grpo.metrics import MetricsView
    from rlcli.report.tables import fmt

    assert fmt(1570.3) == "1,570" and fmt(123456.0) == "123,456"
    assert fmt(0.1234567) == "0.1235" and fmt(3e-05) == "3e-05" and fmt(12.5) == "12.5" and fmt(None) == "–"
    assert fmt(float("nan")) == "nan"
    out = io.StringIO()
    MetricsView(Console(file=out, width=200)).show(0, {"perf/tokens_per_s": 1570.3, "train/kl": 0.00123})
    line = out.getvalue().splitlines()[-1]
    assert "1,570" in line and "e+" not in line and "0.00123" in line
