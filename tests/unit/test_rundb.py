"""The run database (migrations, runs, metrics, checkpoints), stage bookkeeping and the run lock."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import shutil
import socket
import sqlite3
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

import rlcli
from rlcli.errors import RlcliError, UsageError
from rlcli.recipe import Recipe, load_recipe
from rlcli.store.checkpoints import add_checkpoint, checkpoints, require_folder, resolve_checkpoint
from rlcli.store.db import DB_NAME, RunDB, check_run_name, package_versions
from rlcli.store.run_store import RunStore
from rlcli.store.stages import RunLock, run_stage, stage_done

TABLES = {"runs", "stages", "episodes", "turns", "rewards", "metrics", "checkpoints", "evals"}

# The schema contract documented in docs/database.md (new columns may be added; none may disappear).
COLUMNS = {
    "runs": [
        "name",
        "status",
        "recipe",
        "recipe_sha256",
        "recipe_path",
        "seed",
        "created_at",
        "updated_at",
        "versions",
        "git_sha",
        "hostname",
    ],
    "stages": [
        "id",
        "run",
        "name",
        "status",
        "params",
        "result",
        "error",
        "started_at",
        "finished_at",
        "pid",
        "elapsed_s",
    ],
    "episodes": [
        "id",
        "run",
        "stage",
        "iteration",
        "split",
        "task_index",
        "sample_index",
        "seed",
        "policy",
        "status",
        "end_reason",
        "env_return",
        "success",
        "num_turns",
        "num_tokens",
        "task",
        "messages",
        "template_consistent",
        "error",
        "created_at",
    ],
    "turns": [
        "id",
        "episode_id",
        "turn_index",
        "prompt_ids",
        "completion_ids",
        "logprobs",
        "text",
        "observation",
        "reward",
        "terminated",
        "truncated",
        "info",
        "gen_time_s",
        "env_time_s",
    ],
    "rewards": ["id", "episode_id", "label_set", "component", "value", "weight"],
    "metrics": ["id", "run", "stage", "step", "key", "value", "created_at"],
    "checkpoints": ["id", "run", "stage", "iteration", "path", "kind", "created_at"],
    "evals": [
        "id",
        "run",
        "stage",
        "checkpoint",
        "checkpoint_id",
        "split",
        "tasks",
        "k",
        "success_rate",
        "ci_low",
        "ci_high",
        "mean_return",
        "pass_at_k",
        "avg_at_k",
        "mean_turns",
        "mean_tokens",
        "details",
        "created_at",
    ],
}


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    # start_run looks up a git sha next to the recipe (or in the cwd): keep it out of the repository.
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def runs_dir(tmp_path) -> Path:
    return tmp_path / "runs"


@pytest.fixture
def rundb(runs_dir):
    db = RunDB.open(runs_dir)
    yield db
    db.close()


@pytest.fixture
def run1(rundb) -> str:
    rundb.start_run("r1", Recipe(), None)
    return "r1"


@pytest.fixture
def store(rundb, run1) -> RunStore:
    return RunStore(rundb, run1)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def migration_rows(path: Path) -> list[tuple]:
    conn = sqlite3.connect(path)
    try:
        return conn.execute("select migration_set, name, applied_at from _sqlite_migrations order by id").fetchall()
    finally:
        conn.close()


# --- opening and migrations ---------------------------------------------------------


def test_blank_database_gets_every_table_in_wal_mode(runs_dir):
    assert not runs_dir.exists()
    rundb = RunDB.open(runs_dir)
    try:
        assert rundb.path == runs_dir / DB_NAME and rundb.path.is_file()
        assert set(rundb.db.table_names()) >= TABLES
        assert rundb.db.execute("pragma journal_mode").fetchone()[0] == "wal"
        assert rundb.db.execute("pragma foreign_keys").fetchone()[0] == 1
        for table, columns in COLUMNS.items():
            assert set(columns) <= rundb.db[table].columns_dict.keys(), table
        assert rundb.db["turns"].columns_dict["prompt_ids"] is bytes
        assert rundb.db["runs"].pks == ["name"]
    finally:
        rundb.close()
    names = [name for _, name, _ in migration_rows(runs_dir / DB_NAME)]
    assert names[0] == "001_initial" and len(names) == len(set(names))  # each applied once, in order


def test_default_runs_dir_is_rlcli_home(rlcli_home):
    rundb = RunDB.open()
    try:
        assert rundb.path == rlcli_home / DB_NAME
    finally:
        rundb.close()


def test_reopening_applies_nothing_twice(runs_dir):
    RunDB.open(runs_dir).close()
    first = migration_rows(runs_dir / DB_NAME)
    for _ in range(2):
        rundb = RunDB.open(runs_dir)
        rundb.start_run("r1", Recipe(), None)  # data survives reopening
        rundb.close()
    assert migration_rows(runs_dir / DB_NAME) == first
    rundb = RunDB.open(runs_dir)
    try:
        assert [r.name for r in rundb.list_runs()] == ["r1"]
    finally:
        rundb.close()


def test_a_database_whose_creator_was_killed_before_linking_it_leaves_nothing_behind(runs_dir):
    """A kill -9 between building the new database aside and linking it into place left the half-built
    file (and its WAL) in the runs folder for good; the next open removes what dead processes left and
    keeps what a live one is building."""
    killed_before_link = textwrap.dedent(
        f"""
        import os, signal
        from rlcli.store.db import RunDB
        os.link = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
        RunDB.open({str(runs_dir)!r})
        """
    )
    child = subprocess.run([sys.executable, "-c", killed_before_link], check=False)
    assert child.returncode == -9
    left = [name for name in os.listdir(runs_dir) if name.endswith(".new")]
    assert left, "the kill should have left the file being built"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) as building:
        live = runs_dir / f".{DB_NAME}.{building.pid}.new"
        live.write_bytes(b"")
        try:
            RunDB.open(runs_dir).close()
        finally:
            building.kill()
    assert sorted(name for name in os.listdir(runs_dir) if ".new" in name) == [live.name]


@pytest.mark.parametrize(
    "content",
    [b"name,status\nr1,done\n" * 50, b"hi", bytes(range(256)) * 8, b"SQLite format 3\x00" + b"\x01" * 200],
    ids=["csv", "tiny", "binary", "corrupt-sqlite"],
)
def test_non_sqlite_file_is_refused_and_left_untouched(runs_dir, content):
    runs_dir.mkdir()
    path = runs_dir / DB_NAME
    path.write_bytes(content)
    with pytest.raises(UsageError) as info:
        RunDB.open(runs_dir)
    assert str(path) in str(info.value) and "untouched" in str(info.value)
    assert path.read_bytes() == content
    assert sorted(os.listdir(runs_dir)) == [DB_NAME]


def _add_future_migration(path: Path) -> None:
    conn = sqlite3.connect(path)
    conn.execute(
        "insert into _sqlite_migrations (migration_set, name, applied_at) values ('rlcli', '999_from_the_future', 'x')"
    )
    conn.commit()
    conn.close()


def test_newer_database_is_refused_and_left_untouched(runs_dir):
    RunDB.open(runs_dir).close()
    path = runs_dir / DB_NAME
    _add_future_migration(path)
    before = digest(path)
    with pytest.raises(UsageError) as info:
        RunDB.open(runs_dir)
    assert "999_from_the_future" in str(info.value) and "newer" in str(info.value)
    assert digest(path) == before
    assert sorted(os.listdir(runs_dir)) == [DB_NAME]


def test_newer_database_in_rollback_mode_is_left_untouched(runs_dir):
    RunDB.open(runs_dir).close()
    path = runs_dir / DB_NAME
    _add_future_migration(path)
    conn = sqlite3.connect(path)
    assert conn.execute("pragma journal_mode=delete").fetchone()[0] == "delete"
    conn.close()
    before = digest(path)
    with pytest.raises(UsageError, match="newer"):
        RunDB.open(runs_dir)
    assert digest(path) == before


def test_other_migration_sets_are_ignored(runs_dir):
    # Another tool's sqlite-utils migrations sharing the file are not "newer rlcli" migrations.
    RunDB.open(runs_dir).close()
    conn = sqlite3.connect(runs_dir / DB_NAME)
    conn.execute("insert into _sqlite_migrations (migration_set, name, applied_at) values ('notes', '001_x', 'x')")
    conn.commit()
    conn.close()
    before = migration_rows(runs_dir / DB_NAME)
    rundb = RunDB.open(runs_dir)  # no "newer rlcli" error
    try:
        rundb.start_run("r", Recipe(), "r.yaml")  # and the database is usable
        assert rundb.get_run("r").status == "created"
    finally:
        rundb.close()
    # Nothing was re-applied or dropped: the other tool's row and rlcli's own rows are as they were.
    assert migration_rows(runs_dir / DB_NAME) == before
    assert ("notes", "001_x", "x") in before


def _newest_migration() -> str:
    from sqlite_utils import Database

    from rlcli.store.migrations import migrations

    return migrations.pending(Database(memory=True))[-1].name


def _older_database(runs_dir: Path) -> None:
    """A run database as the rlcli before the newest migration left it, with a run and a metric."""
    from sqlite_utils import Database

    from rlcli.store.migrations import migrations

    runs_dir.mkdir()
    conn = sqlite3.connect(runs_dir / DB_NAME)
    migrations.apply(Database(conn), stop_before=_newest_migration())
    older = RunDB(Database(conn), runs_dir / DB_NAME)
    older.start_run("r1", Recipe(), None)
    older.log_metrics("r1", "grpo", 0, {"rollout/reward_mean": 0.5})
    conn.close()


def test_a_read_only_open_never_writes_and_migrates_an_older_file_where_it_may(runs_dir, capsys, monkeypatch):
    from helpers import cli

    _older_database(runs_dir)
    path = runs_dir / DB_NAME
    monkeypatch.setenv("RLCLI_HOME", str(runs_dir))
    code, out, err = cli(capsys, "runs", "show", "r1", "--json")  # migrated first: the folder may be written
    assert code == 0, err
    assert migration_rows(path)[-1][1] == _newest_migration()
    rundb = RunDB.open(runs_dir, read_only=True)
    try:
        assert [r.name for r in rundb.list_runs()] == ["r1"]
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            rundb.set_run_status("r1", "done")
    finally:
        rundb.close()
    before = digest(path)
    assert cli(capsys, "runs", "list")[0] == 0
    assert digest(path) == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through any file mode")
def test_commands_that_only_read_work_in_a_read_only_runs_folder(runs_dir, tmp_path, capsys, monkeypatch):
    """Even `runs list` used to fail there, with a message that suggested a corrupt file: every open was
    read-write, and migrated."""
    from helpers import cli

    rundb = RunDB.open(runs_dir)
    rundb.start_run("r1", Recipe(), None)
    rundb.log_metrics("r1", "grpo", 0, {"rollout/reward_mean": 0.5})
    rundb.close()
    older = tmp_path / "older"
    _older_database(older)
    monkeypatch.setenv("RLCLI_HOME", str(runs_dir))
    for folder in (runs_dir, older):
        (folder / DB_NAME).chmod(0o444)
        folder.chmod(0o555)
    try:
        for args in (
            ["runs", "list"],
            ["runs", "show", "r1"],
            ["runs", "compare", "r1"],
            ["runs", "export", "r1", "--out", tmp_path / "export"],
            ["runs", "report", "r1", "--html", tmp_path / "r1.html"],
        ):
            code, _, err = cli(capsys, *args)
            assert code == 0, (args, err)
        code, _, err = cli(capsys, "runs", "delete", "r1", "--yes")
        assert code == 2 and "cannot be written (it or its folder is read-only)" in " ".join(err.split()), err
        code, _, err = cli(capsys, "--runs-dir", older, "runs", "show", "r1")
        assert code == 2 and "written by an older rlcli" in " ".join(err.split()), err
        assert sorted(os.listdir(runs_dir)) == [DB_NAME] and sorted(os.listdir(older)) == [DB_NAME]
    finally:
        for folder in (runs_dir, older):
            folder.chmod(0o755)


# --- runs ----------------------------------------------------------------------------


def test_start_run_records_recipe_and_provenance(rundb, tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("run:\n  seed: 7\ngrpo:\n  lr: 3.0e-4\n")
    recipe = load_recipe(path)
    rundb.start_run("r1", recipe, str(path))
    row = rundb.get_run("r1")
    assert row.status == "created"
    assert row.recipe == recipe.to_dict()
    assert row.recipe_sha256 == recipe.sha256()
    assert row.recipe_path == str(path)
    assert row.seed == 7
    assert row.hostname == socket.gethostname()
    assert row.created_at and row.created_at == row.updated_at
    versions = row.versions
    for pkg in ("python", "rlcli", "torch", "transformers", "trl", "peft"):
        assert pkg in versions
    assert versions["torch"] == metadata.version("torch")
    assert versions["rlcli"] == rlcli.__version__  # the code's own (an editable install's metadata may lag)
    assert rundb.run_recipe("r1") == recipe


def test_package_versions_does_not_import_torch():
    code = "import sys; from rlcli.store.db import package_versions as p; p(); assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
    assert package_versions()["python"]


def test_resuming_the_same_recipe(rundb):
    recipe = load_recipe(None, ["run.seed=3"])
    first = rundb.start_run("r1", recipe, None)
    again = rundb.start_run("r1", load_recipe(None, ["run.seed=3"]), None)
    assert again.created_at == first.created_at
    assert again.recipe_sha256 == first.recipe_sha256
    assert len(rundb.list_runs()) == 1


def test_resume_safe_change_is_accepted_and_stored(rundb):
    rundb.start_run("r1", Recipe(), None)
    longer = load_recipe(None, ["grpo.iterations=50", "eval.tasks=5"])
    row = rundb.start_run("r1", longer, None)
    assert row.recipe_sha256 == longer.sha256()
    assert rundb.run_recipe("r1").grpo.iterations == 50


def test_changed_recipe_is_refused_naming_fields_and_force_accepts(rundb):
    rundb.start_run("r1", Recipe(), None)
    changed = load_recipe(None, ["grpo.lr=1e-3", "rollout.group_size=2"])
    with pytest.raises(UsageError) as info:
        rundb.start_run("r1", changed, None)
    message = str(info.value)
    assert "'r1'" in message and "grpo.lr" in message and "rollout.group_size" in message and "--force" in message
    assert rundb.run_recipe("r1") == Recipe()  # refused: nothing stored
    row = rundb.start_run("r1", changed, None, force=True)
    assert row.recipe_sha256 == changed.sha256()
    assert rundb.run_recipe("r1").grpo.lr == 1e-3


def test_require_run_names_the_run_and_known_runs(rundb):
    with pytest.raises(UsageError, match="no runs yet"):
        rundb.require_run("ghost")
    rundb.start_run("alpha", Recipe(), None)
    with pytest.raises(UsageError) as info:
        rundb.require_run("ghost")
    assert "'ghost'" in str(info.value) and "alpha" in str(info.value)


def test_set_run_status_and_list_runs(rundb):
    rundb.start_run("a", Recipe(), None)
    rundb.start_run("b", Recipe(), None)
    rundb.set_run_status("a", "running")
    assert [(r.name, r.status) for r in rundb.list_runs()] == [("a", "running"), ("b", "created")]


@pytest.mark.parametrize("name", ["r1", "run", "A-b_c.d", "0", "grpo.lr-1e-5", "x" * 100])
def test_valid_run_names(name):
    assert check_run_name(name) == name


@pytest.mark.parametrize(
    "name", ["", "a/b", "../up", ".hidden", "-flag", "_x", "with space", "tab\t", "é", "a\n", "a;b"]
)
def test_invalid_run_names(name):
    with pytest.raises(UsageError, match="not valid"):
        check_run_name(name)


# --- metrics -------------------------------------------------------------------------


def test_log_metrics_upserts(rundb, run1):
    rundb.log_metrics(run1, "train", 0, {"loss": 1.0, "reward": 0.1})
    rundb.log_metrics(run1, "train", 0, {"loss": 0.5})
    rows = rundb.metrics(run1, "loss")
    assert [(r.step, r.value) for r in rows] == [(0, 0.5)]
    assert rundb.db["metrics"].count == 2
    rundb.log_metrics(run1, "eval", 0, {"loss": 2.0})  # another stage is another row
    assert rundb.db["metrics"].count == 3


def test_log_metrics_skips_none_and_casts(rundb, run1):
    rundb.log_metrics(run1, "train", 1, {"a": 1, "b": None})
    rundb.log_metrics(run1, "train", 2, {})
    rows = rundb.metrics(run1)
    assert [(r.key, r.value) for r in rows] == [("a", 1.0)]
    assert isinstance(rows[0].value, float)


def test_metrics_ordered_by_step(rundb, run1):
    for step in (2, 0, 1):
        rundb.log_metrics(run1, "train", step, {"loss": float(step)})
    assert [r.step for r in rundb.metrics(run1, "loss")] == [0, 1, 2]


def test_latest_metrics(rundb, run1):
    assert rundb.latest_metrics(run1) == {}
    rundb.log_metrics(run1, "train", 0, {"loss": 1.0, "reward": 0.0})
    rundb.log_metrics(run1, "train", 1, {"loss": 0.5})
    rundb.log_metrics(run1, "train", 2, {"loss": 0.25})
    assert rundb.latest_metrics(run1) == {"loss": 0.25, "reward": 0.0}
    rundb.start_run("r2", Recipe(), None)
    rundb.log_metrics("r2", "train", 9, {"loss": 9.0})
    assert rundb.latest_metrics(run1) == {"loss": 0.25, "reward": 0.0}


# --- checkpoints -----------------------------------------------------------------------


def test_checkpoints_and_resolve(store, runs_dir):
    assert resolve_checkpoint(store, "base") is None
    assert resolve_checkpoint(store, "latest") is None  # nothing trained yet: the base model
    with pytest.raises(UsageError, match="no SFT checkpoint"):
        resolve_checkpoint(store, "sft")
    sft = add_checkpoint(store, "sft", 0, runs_dir / "r1" / "sft", "lora")
    t0 = add_checkpoint(store, "train/0", 1, runs_dir / "r1" / "train-1", "lora")
    t1 = add_checkpoint(store, "train/1", 2, runs_dir / "r1" / "train-2", "lora")
    assert [c.id for c in checkpoints(store)] == [sft, t0, t1]
    assert checkpoints(store)[0].path == str(runs_dir / "r1" / "sft")
    assert resolve_checkpoint(store, "base") is None
    assert resolve_checkpoint(store, "latest").id == t1
    assert resolve_checkpoint(store, "sft").id == sft
    assert resolve_checkpoint(store, str(t0)).path == str(runs_dir / "r1" / "train-1")
    with pytest.raises(UsageError, match="no checkpoint with id 999"):
        resolve_checkpoint(store, "999")
    with pytest.raises(UsageError, match="Unknown checkpoint 'newest'"):
        resolve_checkpoint(store, "newest")


def test_checkpoint_ids_are_per_run(rundb, store):
    rundb.start_run("r2", Recipe(), None)
    other = add_checkpoint(RunStore(rundb, "r2"), "train/0", 1, "x", "lora")
    with pytest.raises(UsageError, match=f"no checkpoint with id {other}"):
        resolve_checkpoint(store, str(other))
    assert resolve_checkpoint(store, "latest") is None


def test_checkpoint_paths_are_relative_to_the_runs_dir_and_old_rows_still_resolve(
    rundb, run1, store, runs_dir, monkeypatch
):
    folder = runs_dir / "r1" / "checkpoints" / "iter-0000"
    folder.mkdir(parents=True)
    add_checkpoint(store, "train/0", 0, folder, "lora")
    assert [path for (path,) in rundb.db.execute("select path from checkpoints")] == ["r1/checkpoints/iter-0000"]
    # Rows of older rlcli: relative to the working directory of the time, or absolute.
    with rundb.transaction() as db:
        for path in ("runs/r1/checkpoints/iter-0000", str(folder)):
            db["checkpoints"].insert({"run": run1, "stage": "train/0", "iteration": 0, "path": path, "kind": "lora"})
    for cwd in (runs_dir.parent, runs_dir):  # where the run was started, and elsewhere
        monkeypatch.chdir(cwd)
        assert [c.path for c in checkpoints(store)] == [str(folder)] * 3
    # Re-recording a folder (a redone stage) keeps its row and id.
    assert add_checkpoint(store, "train/0", 0, folder, "lora") == checkpoints(store)[0].id


def test_a_missing_checkpoint_folder_is_never_replaced_by_a_same_named_folder_in_the_cwd(
    store, runs_dir, tmp_path, monkeypatch
):
    folder = runs_dir / "r1" / "checkpoints" / "iter-0000"
    folder.mkdir(parents=True)
    add_checkpoint(store, "train/0", 0, folder, "lora")
    shutil.rmtree(folder)
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "r1" / "checkpoints" / "iter-0000").mkdir(parents=True)
    monkeypatch.chdir(elsewhere)
    [row] = checkpoints(store)
    assert row.path == str(folder)
    with pytest.raises(UsageError, match="does not exist"):
        require_folder(row)


# --- stages ------------------------------------------------------------------------------


def test_run_stage_runs_work_and_marks_done(rundb, run1, store):
    calls = []

    def work():
        calls.append(1)
        assert rundb.stage(run1, "rollout/0").status == "running"
        return {"episodes": 8}

    assert run_stage(store, "rollout/0", work, params={"tasks": 8}) == {"episodes": 8}
    row = rundb.stage(run1, "rollout/0")
    assert row.status == "done" and row.result == {"episodes": 8}
    assert row.params == {"tasks": 8}
    assert row.pid == os.getpid() and row.error is None
    assert row.started_at and row.finished_at and row.started_at <= row.finished_at
    assert calls == [1] and stage_done(store, "rollout/0")


def test_run_stage_skips_a_done_stage(rundb, run1, store):
    run_stage(store, "sft", lambda: {"loss": 0.1})
    finished = rundb.stage(run1, "sft").finished_at

    def must_not_run():
        raise AssertionError("a done stage ran again")

    assert run_stage(store, "sft", must_not_run) == {"loss": 0.1}
    assert rundb.stage(run1, "sft").finished_at == finished


def test_run_stage_work_returning_none(rundb, run1, store):
    assert run_stage(store, "eval/final", lambda: None) == {}
    assert rundb.stage(run1, "eval/final").status == "done"
    assert run_stage(store, "eval/final", lambda: 1 / 0) == {}


def test_run_stage_records_error_and_reraises(rundb, run1, store):
    def fails():
        raise RlcliError("env exploded at task 3")

    with pytest.raises(RlcliError, match="exploded"):
        run_stage(store, "train/0", fails)
    row = rundb.stage(run1, "train/0")
    assert row.status == "failed" and row.error == "env exploded at task 3"
    assert row.finished_at and not stage_done(store, "train/0")

    with pytest.raises(ZeroDivisionError):
        run_stage(store, "train/1", lambda: 1 / 0)
    assert rundb.stage(run1, "train/1").error == "division by zero"

    def bare():
        raise RuntimeError

    with pytest.raises(RuntimeError):
        run_stage(store, "train/2", bare)
    assert rundb.stage(run1, "train/2").error == "RuntimeError"


def test_run_stage_retries_a_failed_stage(rundb, run1, store):
    with pytest.raises(ValueError):
        run_stage(store, "train/0", lambda: (_ for _ in ()).throw(ValueError("first try")))
    started = rundb.stage(run1, "train/0").started_at
    assert run_stage(store, "train/0", lambda: {"ok": True}) == {"ok": True}
    row = rundb.stage(run1, "train/0")
    assert row.status == "done" and row.error is None and row.result == {"ok": True}
    assert row.started_at == started  # the stage's first start is kept
    assert len(rundb.stages(run1)) == 1


def test_a_stage_run_again_later_lasts_the_time_of_its_runs_not_the_gap_between(rundb, run1, store):
    # An eval of grpo.eval_tasks during training, asked again for eval.tasks at the end: two short
    # runs of one stage with all of GRPO between them.
    run_stage(store, "eval/base", lambda: {"tasks": 2})
    with rundb.transaction() as db:  # the first run, a day earlier
        db.execute(
            "update stages set started_at = '2026-11-27T10:00:00.000000+00:00', "
            "finished_at = '2026-11-27T10:00:01.000000+00:00' where name = 'eval/base'"
        )
    store.mark_stage("eval/base", "pending")  # more tasks asked for (engine/evaluate.py)
    run_stage(store, "eval/base", lambda: {"tasks": 4})
    row = rundb.stage(run1, "eval/base")
    assert row.started_at.startswith("2026-11-27T10:00:00")  # the first start is kept
    assert row.duration_s is not None and row.duration_s < 60  # two instant runs, not the day between


def test_run_stage_records_interrupted(rundb, run1, store):
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_stage(store, "rollout/0", interrupted)
    row = rundb.stage(run1, "rollout/0")
    assert row.status == "failed" and row.error == "interrupted"


def test_stages_listed_in_order(rundb, run1, store):
    for name in ("sft", "rollout/0", "train/0"):
        run_stage(store, name, dict)
    assert [s.name for s in rundb.stages(run1)] == ["sft", "rollout/0", "train/0"]


# --- the run lock ---------------------------------------------------------------------------

HOLDER = textwrap.dedent(
    """
    import sys, time
    from rlcli.store.stages import RunLock
    with RunLock(sys.argv[1], "r1"):
        print("locked", flush=True)
        if sys.argv[2] == "hold":
            time.sleep(60)
    print("released", flush=True)
    """
)


@pytest.fixture
def holder(runs_dir):
    procs: list[subprocess.Popen] = []

    def spawn(hold: bool = True) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(runs_dir), "hold" if hold else "exit"],
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        assert proc.stdout.readline().strip() == "locked"
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_lock_held_by_another_process_is_refused_naming_its_pid(runs_dir, holder):
    proc = holder()
    assert (runs_dir / "r1" / "lock").read_text() == str(proc.pid)
    with pytest.raises(RlcliError) as info, RunLock(runs_dir, "r1"):
        pytest.fail("acquired a lock another process holds")
    assert not isinstance(info.value, UsageError)  # exit code 1, not 2
    assert f"pid {proc.pid}" in str(info.value) and "'r1'" in str(info.value)
    with RunLock(runs_dir, "r2"):  # other runs are not blocked
        pass


def test_lock_after_kill_9_is_acquired_at_once(runs_dir, holder):
    proc = holder()
    proc.kill()  # SIGKILL: no cleanup; the stale lock file stays behind
    proc.wait(timeout=10)
    assert (runs_dir / "r1" / "lock").exists()
    # RunLock never waits (LOCK_NB): a lock still held would raise here instead of being acquired.
    with RunLock(runs_dir, "r1"):
        assert (runs_dir / "r1" / "lock").read_text() == str(os.getpid())


def test_lock_released_when_holder_exits(runs_dir, holder):
    proc = holder(hold=False)
    assert proc.stdout.readline().strip() == "released"
    assert proc.wait(timeout=10) == 0
    with RunLock(runs_dir, "r1"):
        pass


def test_lock_released_on_exit_of_the_with_block(runs_dir):
    with pytest.raises(ValueError), RunLock(runs_dir, "r1"):
        # A second open of the lock is refused even within one process (flock is per open file).
        with pytest.raises(RlcliError, match=f"pid {os.getpid()}"), RunLock(runs_dir, "r1"):
            pass
        raise ValueError("stage failed")
    out = subprocess.run(
        [sys.executable, "-c", HOLDER, str(runs_dir), "exit"], check=False, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["locked", "released"]


@pytest.mark.parametrize("code", [errno.ENOLCK, errno.EOPNOTSUPP])
def test_file_system_without_flock_is_one_sentence_and_exit_2(runs_dir, monkeypatch, code):
    def no_flock(fh, op):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    with pytest.raises(UsageError, match="does not support file locks") as info, RunLock(runs_dir, "r1"):
        pytest.fail("locked without flock")
    assert str(runs_dir) in str(info.value) and "--runs-dir" in str(info.value)


def test_recipe_history_keeps_every_version_and_why(rundb):
    rundb.start_run("r1", Recipe(), None)
    rundb.start_run("r1", Recipe(), None)  # unchanged: nothing new to record
    forced = load_recipe(None, ["grpo.lr=1e-3"])
    rundb.start_run("r1", forced, None, force=True)
    history = rundb.recipe_history("r1")
    assert [h.reason for h in history] == ["created", "recipe changed with --force: grpo.lr"]
    assert history[0].recipe == Recipe().to_dict() and history[0].recipe_sha256 == Recipe().sha256()
    assert history[1].recipe_sha256 == forced.sha256()


def test_code_hashes_are_stored_and_a_changed_file_is_recorded(rundb):
    rundb.start_run("r1", Recipe(), None, code={"envs/x.py": "aaa", "rewards.py": "bbb"})
    assert rundb.code_changes("r1", {"envs/x.py": "aaa", "rewards.py": "bbb"}) == []
    assert rundb.code_changes("r1", {"envs/x.py": "aaa", "rewards.py": "ccc"}) == ["rewards.py"]
    assert rundb.code_changes("new-run", {"rewards.py": "ccc"}) == []  # nothing recorded to compare with
    rundb.start_run("r1", Recipe(), None, code={"envs/x.py": "aaa", "rewards.py": "ccc"})
    history = rundb.recipe_history("r1")
    assert [h.reason for h in history] == ["created", "code changed: rewards.py"]
    assert history[-1].code == {"envs/x.py": "aaa", "rewards.py": "ccc"}
