"""rlcli deletes only what it made: the marker in each run folder it creates, a new run that refuses a
folder it did not make, `runs delete` that removes only a marked folder, run names that are rlcli's own
paths in the runs folder, and runs folders that cannot be one (empty, a file)."""

from __future__ import annotations

import shutil
import sqlite3
from pathlib import Path

import pytest

from helpers import cli, make_ctx, write_recipe
from rlcli.engine.opening import open_run
from rlcli.errors import UsageError
from rlcli.store.db import DB_NAME
from rlcli.store.run_folders import MARKER


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    # An empty --runs-dir would be the working directory: a scratch one, never the repository.
    monkeypatch.chdir(tmp_path)


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return " ".join(lines[0].split())


def runs_recorded(runs: Path) -> list[str]:
    with sqlite3.connect(runs / DB_NAME) as conn:
        return [name for (name,) in conn.execute("select name from runs order by name")]


def test_a_run_folder_rlcli_makes_is_marked_and_deleted_with_the_run(capsys, tmp_path, rlcli_home):
    recipe = write_recipe(tmp_path / "r.yaml")
    with open_run(recipe, None, rlcli_home, []) as ctx:
        (ctx.run_dir / "checkpoints").mkdir()
    assert (rlcli_home / "t" / MARKER).read_text() == "t\n"
    code, _, err = cli(capsys, "runs", "delete", "t", "--yes")
    assert code == 0, err
    assert not (rlcli_home / "t").exists() and runs_recorded(rlcli_home) == []


def test_a_new_run_refuses_a_folder_rlcli_did_not_make(capsys, tmp_path, rlcli_home):
    """A new run used to take over any folder of its name, and `runs delete` then removed it whole."""
    data = rlcli_home / "data"
    data.mkdir(parents=True)
    (data / "important.csv").write_text("a,b\n")
    recipe = write_recipe(tmp_path / "r.yaml")
    code, _, err = cli(capsys, "rollout", "-r", recipe, "--run", "data")
    line = one_line(err)
    assert code == 2 and f"{data} already exists and rlcli did not make it" in line and "another run name" in line
    assert sorted(p.name for p in data.iterdir()) == ["important.csv"]
    assert runs_recorded(rlcli_home) == []
    # An empty folder (or one holding only a lock file) is nobody's: the run takes it, marked.
    (rlcli_home / "empty").mkdir()
    with open_run(recipe, "empty", rlcli_home, []):
        pass
    assert (rlcli_home / "empty" / MARKER).exists()


def test_delete_leaves_an_unmarked_folder_to_be_deleted_by_hand(capsys, tmp_path, rlcli_home):
    """A run recorded by an older rlcli, whose folder holds something else too: its rows and folder stay
    until a person has looked (then delete removes the rows)."""
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml", run={"name": "data", "seed": 0}), rlcli_home)
    ctx.rundb.close()
    (rlcli_home / "data").mkdir()
    (rlcli_home / "data" / "important.csv").write_text("a,b\n")
    code, _, err = cli(capsys, "runs", "delete", "data", "--yes")
    line = one_line(err)
    assert code == 2 and f"holds no {MARKER} file" in line and "delete it by hand" in line, line
    assert (rlcli_home / "data" / "important.csv").exists() and runs_recorded(rlcli_home) == ["data"]
    # Resuming it neither refuses the folder nor marks it: what else is in there is still not known.
    with open_run(tmp_path / "r.yaml", None, rlcli_home, []):
        pass
    assert not (rlcli_home / "data" / MARKER).exists()
    shutil.rmtree(rlcli_home / "data")  # by hand
    code, _, err = cli(capsys, "runs", "delete", "data", "--yes")
    assert code == 0, err
    assert runs_recorded(rlcli_home) == []


def test_run_names_of_rlclis_own_paths_are_refused(capsys, tmp_path, monkeypatch, rlcli_home):
    """With RLCLI_HOME set, the run `models` was the model cache: `runs delete models --yes` deleted every
    pulled model. `rlcli.db` was the database file: an unexpected error, exit 1."""
    monkeypatch.delenv("RLCLI_MODELS")
    from rlcli.models.cache import models_dir

    cache = models_dir()
    assert cache == rlcli_home / "models"
    (cache / "my-model").mkdir(parents=True)
    (cache / "my-model" / "config.json").write_text("{}")
    # A run of that name recorded by an older rlcli, in the folder of the cache.
    ctx = make_ctx(write_recipe(tmp_path / "r.yaml", run={"name": "models", "seed": 0}), rlcli_home)
    ctx.rundb.close()
    code, _, err = cli(capsys, "runs", "delete", "models", "--yes")
    assert code == 2 and "Run name 'models' is reserved" in one_line(err)
    assert (cache / "my-model" / "config.json").exists()
    recipe = write_recipe(tmp_path / "s.yaml")
    for name in ("Models", "rlcli.db", "rlcli.db-wal"):
        code, _, err = cli(capsys, "rollout", "-r", recipe, "--run", name)
        assert code == 2 and f"Run name {name!r} is reserved" in one_line(err)
    with pytest.raises(UsageError, match="is reserved"):
        open_run(write_recipe(tmp_path / "u.yaml", run={"name": "models", "seed": 0}), None, rlcli_home, []).__enter__()


def test_a_runs_folder_that_is_empty_or_a_file_is_refused(capsys, tmp_path):
    """An empty --runs-dir ("$UNSET") made the working directory the runs folder; a file gave an
    "unexpected" error, exit 1."""
    code, _, err = cli(capsys, "--runs-dir", "", "runs", "list")
    assert code == 2 and "--runs-dir is empty" in one_line(err)
    assert list(tmp_path.iterdir()) == []
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    recipe = write_recipe(tmp_path / "r.yaml")
    for args in (("runs", "list"), ("runs", "show", "t"), ("rollout", "-r", recipe)):
        code, _, err = cli(capsys, "--runs-dir", not_a_folder, *args)
        line = one_line(err)
        assert code == 2 and f"{not_a_folder} is a file, not a folder" in line, (args, line)
    code, _, err = cli(capsys, "--runs-dir", not_a_folder / "runs", "rollout", "-r", recipe)
    assert code == 2 and "cannot be created" in one_line(err)
