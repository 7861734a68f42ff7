"""run.trackers: SFT, GRPO and DPO on the tiny model mirror their metrics to TensorBoard, wandb (offline),
trackio and MLflow, read back here from each one's local files with the library's own reader, and a
kill -9 and resume neither breaks a tracker nor logs a step twice."""

from __future__ import annotations

import json
import math
import os
import sqlite3
import struct
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from helpers import REPO, kill_at_event, make_ctx, run_in_process, write_recipe
from rlcli.errors import UsageError
from rlcli.recipe import Recipe
from rlcli.store.records import GPU_MEMORY_KEYS

ALL = ["tensorboard", "wandb", "trackio", "mlflow"]
# A metrics series: {key: [(step, value), ...]} in step order.
Series = dict[str, list[tuple[int, float]]]


@pytest.fixture(scope="module")
def trackio_dir(tmp_path_factory):
    """trackio reads TRACKIO_DIR once, when it is imported: one folder for the module's tests."""
    folder = tmp_path_factory.mktemp("trackio")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRACKIO_DIR", str(folder))
        if "trackio" in sys.modules:  # imported by an earlier test file of this process: point it here
            import trackio.sqlite_storage
            import trackio.utils

            for module in (trackio.utils, trackio.sqlite_storage):
                patch.setattr(module, "TRACKIO_DIR", folder)
        yield folder


@pytest.fixture(autouse=True)
def offline(monkeypatch, trackio_dir):
    """No tracker reaches the network, whatever the environment says."""
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT", "TRACKIO_SPACE_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("TRACKIO_SERVER_URL", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    monkeypatch.setenv("DO_NOT_TRACK", "true")


# --- reading back what each tracker wrote ------------------------------------------------------------


def database_series(runs: Path, run: str, stage: str) -> Series:
    """What the run database holds for a metrics series (the steps a tracker mirrors)."""
    found: Series = defaultdict(list)
    with sqlite3.connect(runs / "rlcli.db") as conn:
        rows = conn.execute(
            "select key, step, value from metrics where run = ? and stage = ? and step >= 0 order by step, key",
            [run, stage],
        )
        for key, step, value in rows:
            if key not in GPU_MEMORY_KEYS:
                found[key].append((step, value))
    return dict(found)


def tensorboard_series(folder: Path) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    # By step: each process (a killed run and its resumes) writes its own event file, named by the second
    # it started and its pid, so files of one second are read in pid order, not in the order written.
    # A step logged twice still shows twice.
    return {
        tag: sorted(((e.step, e.value) for e in events.Scalars(tag)), key=lambda point: point[0])
        for tag in events.Tags()["scalars"]
    }


def wandb_records(path: Path):
    """The records of a wandb transaction log (run-<id>.wandb), as wandb_internal_pb2.Record: a header
    (":W&B", magic, version; 7 bytes), then LevelDB-log records in 32 KiB blocks, each a 7-byte header
    (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of a serialised Record. A log
    cut off by a kill ends where its last complete record does."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    pos, pieces = 7, []
    while True:
        if 32768 - pos % 32768 < 7:  # too little left in the block for a header: zero padding
            pos += 32768 - pos % 32768
        if pos + 7 > len(data):
            return
        length, kind = struct.unpack("<HB", data[pos + 4 : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):
            return
        pieces.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def wandb_runs(folder: Path) -> list[tuple[str, str, str, Series]]:
    """(name, group, job type, history) of every offline wandb run under folder, oldest first."""
    runs = []
    for path in sorted(folder.glob("offline-run-*/run-*.wandb")):
        name = group = job_type = ""
        started = 0
        history: Series = defaultdict(list)
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                name, group, job_type = record.run.display_name, record.run.run_group, record.run.job_type
                started = record.run.start_time.ToMicroseconds()
            elif kind == "history":
                for item in record.history.item:
                    key = item.key or "/".join(item.nested_key)
                    if not key.startswith("_"):  # _step, _runtime, _timestamp: wandb's own
                        history[key].append((record.history.step.num, json.loads(item.value_json)))
        runs.append((started, name, group, job_type, dict(history)))
    # By start time: a folder's name has the second it started, and two series can start in one second.
    return [run[1:] for run in sorted(runs, key=lambda run: run[0])]


def trackio_series(name: str) -> Series:
    from trackio.sqlite_storage import SQLiteStorage

    found: Series = defaultdict(list)
    for row in SQLiteStorage.get_logs("rlcli", name):
        for key, value in row.items():
            if key not in ("step", "timestamp") and not key.startswith("_") and isinstance(value, (int, float)):
                found[key].append((row["step"], value))
    return dict(found)


def mlflow_runs(runs_dir: Path, run: str) -> dict[str, tuple[str, Series, dict[str, str]]]:
    """MLflow runs of the run folder's store by rlcli stage: (status, metrics, parameters)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{runs_dir / run / 'mlflow' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("rlcli")
    found = {}
    for mlflow_run in client.search_runs([experiment.experiment_id]):
        series = {
            key: [(m.step, m.value) for m in client.get_metric_history(mlflow_run.info.run_id, key)]
            for key in mlflow_run.data.metrics
        }
        stage = mlflow_run.data.tags["rlcli.stage"]
        assert stage not in found, f"two MLflow runs for {stage}"
        found[stage] = (mlflow_run.info.status, series, mlflow_run.data.params)
    return found


def same(logged: Series, expected: Series, *, float32: bool = False) -> None:
    """Every key and step of the database, with its value (TensorBoard keeps float32), and nothing else."""
    assert set(logged) == set(expected), (sorted(logged), sorted(expected))
    for key, points in expected.items():
        got = logged[key]
        assert [s for s, _ in got] == [s for s, _ in points], key
        for (_, a), (_, b) in zip(got, points):
            assert (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6 if float32 else 1e-12), key


# --- SFT, GRPO and DPO to all four -----------------------------------------------------------------


def test_sft_grpo_and_dpo_reach_every_tracker(tmp_path):
    from rlcli.engine.pipeline import run_all

    # A reward that tells the random model's replies apart, so that GRPO's groups give DPO pairs.
    (tmp_path / "parity.py").write_text(
        "def score(completions, **kwargs):\n    return [float(len(c) % 2) for c in completions]\n"
    )
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run={"name": "t", "seed": 0, "stages": ["sft", "grpo", "dpo"], "trackers": ALL},
        sft={"source": "expert", "demos": 4, "batch_size": 2, "micro_batch_size": 2, "eval_fraction": 0.25},
        rollout={"tasks": 4, "group_size": 4, "max_new_tokens": 8, "batch_size": 16},
        grpo={"iterations": 2},
        rewards=[{"fn": f"{tmp_path / 'parity.py'}:score"}],
        dpo={"batch_size": 2, "micro_batch_size": 2},
    )
    runs = tmp_path / "runs"
    ctx = make_ctx(recipe, runs)
    run_all(ctx)
    ctx.rundb.close()
    expected = {stage: database_series(runs, "t", stage) for stage in ("sft", "grpo", "dpo")}
    assert {"sft/loss", "sft/eval_loss", "sft/lr"} <= set(expected["sft"])
    assert {"train/loss", "rollout/reward_mean", "perf/time_train_s"} <= set(expected["grpo"])
    assert [s for s, _ in expected["grpo"]["train/loss"]] == [0, 1]
    assert {"dpo/loss", "dpo/reward_margin"} <= set(expected["dpo"])
    folder = runs / "t"

    # TensorBoard: one folder of event files per series.
    assert sorted(p.name for p in (folder / "tensorboard").iterdir()) == ["dpo", "grpo", "sft"]
    for stage, series in expected.items():
        same(tensorboard_series(folder / "tensorboard" / stage), series, float32=True)

    # wandb: an offline run per series in the run folder, named <run>/<stage>, grouped by the run.
    logged = wandb_runs(folder / "wandb")
    assert [(name, group, job) for name, group, job, _ in logged] == [
        ("t/sft", "t", "sft"),
        ("t/grpo", "t", "grpo"),
        ("t/dpo", "t", "dpo"),
    ]
    for (_, _, _, history), series in zip(logged, expected.values()):
        same(history, series)

    # trackio: its local database (TRACKIO_DIR), project rlcli, a run per series.
    for stage, series in expected.items():
        same(trackio_series(f"t/{stage}"), series)

    # MLflow: the SQLite store in the run folder, a finished run per series with the recipe as parameters.
    stored = mlflow_runs(runs, "t")
    assert sorted(stored) == ["dpo", "grpo", "sft"]
    for stage, (status, series, params) in stored.items():
        assert status == "FINISHED"
        same(series, expected[stage])
        assert params["model.name"] == "tiny-random" and json.loads(params["run.trackers"]) == ALL
    assert not (REPO / "mlruns").exists() and not (tmp_path / "mlruns").exists()


# --- kill -9 and resume -----------------------------------------------------------------------------


def test_a_killed_sft_resumes_into_the_same_trackers_without_logging_a_step_twice(tmp_path):
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run={"name": "t", "seed": 0, "trackers": ALL},
        env={"name": "arithmetic"},
        sft={"source": "expert", "demos": 8, "epochs": 2, "batch_size": 2, "micro_batch_size": 2, "save_steps": 3}
        | {"eval_fraction": 0.0},
    )
    runs = tmp_path / "runs"
    args = ["sft", "-r", str(recipe)]
    # Killed two steps past its first checkpoint (step 3): at its first database write once steps 1-5
    # are stored (and mirrored), so the resumed stage redoes steps 4 and 5 from checkpoint-3.
    loss_rows = "select count(*) from metrics where key = 'sft/loss'"
    kill_at_event(args, runs, {"sql": loss_rows, "at_least": 5}, timeout=300, cwd=REPO)
    resumed = run_in_process(args, runs, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr
    assert "sft: resuming from" in resumed.stderr and "checkpoint-3" in resumed.stderr
    expected = database_series(runs, "t", "sft")
    steps = list(range(1, 9))  # 8 demos, 2 per step, 2 epochs
    assert [s for s, _ in expected["sft/loss"]] == steps
    folder = runs / "t"

    # TensorBoard and MLflow write each step before the next database write: every step, once.
    tensorboard = tensorboard_series(folder / "tensorboard" / "sft")
    assert [s for s, _ in tensorboard["sft/loss"]] == steps
    [(status, mlflow_series, _)] = mlflow_runs(runs, "t").values()  # the killed run went on
    assert status == "FINISHED" and [s for s, _ in mlflow_series["sft/loss"]] == steps
    # trackio sends from a thread and wandb through its service process: the kill may cut off the
    # last steps they had not written yet, but none is there twice and the resumed steps all are.
    trackio_steps = [s for s, _ in trackio_series("t/sft")["sft/loss"]]
    assert trackio_steps == sorted(set(trackio_steps)) and trackio_steps[-3:] == [6, 7, 8]
    # wandb starts a new offline run on resume (the killed one's file may hold nothing yet). The kill came
    # at the write that records step 5 as sent, just before sending it: the resumed run sends it.
    killed, (name, _, _, history) = wandb_runs(folder / "wandb")
    assert name == "t/sft" and [s for s, _ in history["sft/loss"]] == [5, 6, 7, 8]  # not 4 again
    assert killed[0] in ("", "t/sft") and all(s <= 4 for s, _ in killed[3].get("sft/loss", []))


def test_a_kill_during_a_held_out_eval_keeps_no_step_from_the_trackers(tmp_path):
    """A GRPO iteration's metrics are stored before its held-out eval and sent after it: a kill during the
    eval used to keep the step from the trackers for good (the resume skipped every step stored)."""
    recipe = write_recipe(
        tmp_path / "r.yaml",
        run={"name": "t", "seed": 0, "trackers": ["tensorboard"]},
        grpo={"iterations": 3, "eval_every": 1},
    )
    runs = tmp_path / "runs"
    args = ["train", "grpo", "-r", str(recipe)]
    # Each kill comes at the first database write once iteration i's metrics are stored: its eval's start.
    # The first resume sends step 0 before step 1; the last finds every iteration done, and sends step 2.
    for iteration in (0, 2):
        stored = f"select count(*) from metrics where key = 'rollout/reward_mean' and step = {iteration}"
        kill_at_event(args, runs, {"sql": stored, "at_least": 1}, timeout=300, cwd=REPO)
    resumed = run_in_process(args, runs, cwd=REPO)
    assert resumed.returncode == 0, resumed.stderr
    assert "all 3 iterations are done" in resumed.stderr
    expected = database_series(runs, "t", "grpo")
    assert [s for s, _ in expected["rollout/reward_mean"]] == [s for s, _ in expected["eval/success_rate"]] == [0, 1, 2]
    same(tensorboard_series(runs / "t" / "tensorboard" / "grpo"), expected, float32=True)


# --- checks --------------------------------------------------------------------------------------


def test_no_trackers_is_a_no_op(tmp_path):
    from rlcli.engine.trackers import open_trackers

    with open_trackers([], "demo", {}, log_dir=tmp_path, stage="grpo") as tracker:
        tracker.log({"train/loss": 1.0}, step=0)
    assert not any(tmp_path.iterdir())


def test_missing_tracker_package_names_what_to_install(monkeypatch, tmp_path):
    from rlcli.engine import trackers

    with monkeypatch.context() as patch, pytest.raises(UsageError, match=r"not installed: `pip install rlcli_no_"):
        patch.setitem(trackers.PACKAGES, "wandb", "rlcli_no_such_package")
        trackers.open_trackers(["wandb"], "demo", {}, log_dir=tmp_path, stage="grpo")
    with pytest.raises(UsageError, match="Unknown tracker 'comet'"):
        trackers.check_trackers(["comet"])
    monkeypatch.delenv("MLFLOW_DISABLE_TELEMETRY")
    trackers.check_trackers(ALL)  # mlflow included: every one is installed here (the test extra)
    assert os.environ["MLFLOW_DISABLE_TELEMETRY"] == "true"  # set before mlflow's import starts it


def test_recipes_validate_names_the_pip_command_for_a_missing_tracker(monkeypatch, capsys, tmp_path):
    from helpers import cli
    from rlcli.engine import trackers

    recipe = write_recipe(tmp_path / "r.yaml", run={"name": "t", "trackers": ["mlflow"]})
    with monkeypatch.context() as patch:
        patch.setitem(trackers.PACKAGES, "mlflow", "rlcli_no_such_package")
        code, out, _ = cli(capsys, "recipes", "validate", recipe)
    assert code == 2 and "pip install rlcli_no_such_package" in " ".join(out.split()), out
    code, out, _ = cli(capsys, "recipes", "validate", recipe)
    assert code == 0, out


def test_a_resumed_series_continues_its_tracker_runs_and_skips_the_steps_it_has(tmp_path):
    """Without a model: a series opened fresh, then resumed after step 2 (the stage redoes 1 and 2), then
    opened fresh again, as a new rlcli run of the same name would."""
    from rlcli.engine.trackers import open_trackers

    folder = tmp_path / "u"
    with open_trackers(ALL, "u", Recipe().to_dict(), log_dir=folder, stage="sft") as tracker:
        for step in (1, 2):
            tracker.log({"sft/loss": 1.0 * step, "sft/eval_loss": None}, step=step)
    with open_trackers(ALL, "u", Recipe().to_dict(), log_dir=folder, stage="sft", after_step=2) as tracker:
        for step in (1, 2, 3):
            tracker.log({"sft/loss": 10.0 * step}, step=step)
    first = [(1, 1.0), (2, 2.0), (3, 30.0)]
    assert tensorboard_series(folder / "tensorboard" / "sft") == {"sft/loss": first}
    assert trackio_series("u/sft") == {"sft/loss": first}  # one trackio run, continued
    [(status, series, _)] = mlflow_runs(tmp_path, "u").values()  # one MLflow run, continued
    assert status == "FINISHED" and series == {"sft/loss": first}
    assert [history for *_, history in wandb_runs(folder / "wandb")] == [
        {"sft/loss": [(1, 1.0), (2, 2.0)]},
        {"sft/loss": [(3, 30.0)]},  # offline wandb cannot continue a run: a new one from the resume on
    ]

    # A fresh series of the same name (the database had no step of it) starts new tracker runs.
    with open_trackers(["trackio", "mlflow"], "u", {}, log_dir=folder, stage="sft") as tracker:
        tracker.log({"sft/loss": 5.0}, step=1)
    assert trackio_series("u/sft") == {"sft/loss": [(1, 5.0)]}  # the newest run of that name
    with pytest.raises(AssertionError, match="two MLflow runs for sft"):
        mlflow_runs(tmp_path, "u")


def test_the_trackers_run_config_holds_no_secret_of_the_recipe(tmp_path, trackio_dir):
    from rlcli.engine.trackers import open_trackers

    secret = "s3cr3t-value-of-the-server-key"
    servers = [{"command": ["my-server"], "env": {"SEARCH_KEY": secret}}]
    recipe = Recipe.model_validate({"env": {"mcp_servers": servers, "kwargs": {"api_key": secret}}})
    with open_trackers(ALL, "secretive", recipe.to_dict(), log_dir=tmp_path / "secretive", stage="grpo") as tracker:
        tracker.log({"loss": 1.0}, 0)
    written = [path for folder in (tmp_path, trackio_dir) for path in folder.rglob("*") if path.is_file()]
    assert any(b"<redacted>" in path.read_bytes() for path in written)  # the recipe reached them, redacted
    assert [path for path in written if secret.encode() in path.read_bytes()] == []
