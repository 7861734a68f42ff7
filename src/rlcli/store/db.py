"""The run database: one class owns the SQLite file, its migrations and its transactions.

`<runs-dir>/rlcli.db` is the single source of truth of every run; anyone can open it with
sqlite3, sqlite-utils or Datasette. docs/database.md documents the schema.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from rlcli.errors import UsageError
from rlcli.recipe import Recipe, changed_fields
from rlcli.store.migrations import migrations
from rlcli.store.records import Checkpoint, Metric, Run, Stage

SQLITE_MAGIC = b"SQLite format 3\x00"
DB_NAME = "rlcli.db"


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def default_runs_dir() -> Path:
    return Path(os.environ.get("RLCLI_HOME") or "runs")


class RunDB:
    def __init__(self, db: Database, path: Path):
        self.db = db
        self.path = path

    # --- opening -------------------------------------------------------------

    @classmethod
    def open(cls, runs_dir: str | Path | None = None) -> RunDB:
        runs_dir = Path(runs_dir) if runs_dir else default_runs_dir()
        path = runs_dir / DB_NAME
        if path.exists():
            with path.open("rb") as fh:
                head = fh.read(len(SQLITE_MAGIC))
            if head and head != SQLITE_MAGIC:
                raise UsageError(f"{path} is not an SQLite database; rlcli left it untouched.")
        runs_dir.mkdir(parents=True, exist_ok=True)
        # A generous busy timeout: a reader such as Datasette may hold the file briefly.
        conn = sqlite3.connect(str(path), timeout=30)
        try:
            db = Database(conn)
            # Every migration this rlcli knows is pending on an empty database.
            known = {m.name for m in migrations.pending(Database(memory=True))}
            unknown = [m.name for m in migrations.applied(db) if m.name not in known]
        except sqlite3.DatabaseError as exc:
            conn.close()
            raise UsageError(f"{path} cannot be opened as a run database ({exc}); rlcli left it untouched.") from None
        if unknown:
            conn.close()
            raise UsageError(
                f"{path} was written by a newer rlcli (unknown migrations: {', '.join(unknown)}); "
                "upgrade rlcli to use it. The file was left untouched."
            )
        # Only now may the file change: it is ours and not from a newer rlcli.
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA foreign_keys=ON")
        migrations.apply(db)
        return cls(db, path)

    def close(self) -> None:
        self.db.conn.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        with self.db.atomic() as db:
            yield db

    # --- runs ----------------------------------------------------------------

    def get_run(self, name: str) -> Run | None:
        rows = list(self.db["runs"].rows_where("name = ?", [name]))
        return _run(rows[0]) if rows else None

    def require_run(self, name: str) -> Run:
        run = self.get_run(name)
        if run is None:
            names = [r["name"] for r in self.db["runs"].rows_where(select="name", order_by="created_at")]
            known = f" Known runs: {', '.join(names[-10:])}." if names else " The database has no runs yet."
            raise UsageError(f"No run named {name!r} in {self.path}.{known}")
        return run

    def start_run(self, name: str, recipe: Recipe, recipe_path: str | None, *, force: bool = False) -> Run:
        """Create the run, or resume it if the recipe is unchanged in every field that matters."""
        resolved = recipe.to_dict()
        existing = self.get_run(name)
        if existing is not None:
            changed = changed_fields(existing.recipe, resolved)
            if changed and not force:
                raise UsageError(
                    f"Run {name!r} exists with a different recipe (changed: {', '.join(changed)}); "
                    "use another --run name, or --force to continue it with the new recipe."
                )
            with self.transaction():
                self.db["runs"].update(
                    name,
                    {"recipe": json.dumps(resolved), "recipe_sha256": recipe.sha256(), "updated_at": now()},
                )
            return self.require_run(name)
        row = {
            "name": name,
            "status": "created",
            "recipe": json.dumps(resolved),
            "recipe_sha256": recipe.sha256(),
            "recipe_path": str(recipe_path) if recipe_path else None,
            "seed": recipe.run.seed,
            "created_at": now(),
            "updated_at": now(),
            "versions": json.dumps(package_versions()),
            "git_sha": git_sha(Path(recipe_path).parent if recipe_path else Path.cwd()),
            "hostname": socket.gethostname(),
        }
        with self.transaction():
            self.db["runs"].insert(row)
        return _run(row)

    def set_run_status(self, name: str, status: str) -> None:
        with self.transaction():
            self.db["runs"].update(name, {"status": status, "updated_at": now()})

    def list_runs(self) -> list[Run]:
        return [_run(row) for row in self.db["runs"].rows_where(order_by="created_at")]

    def run_recipe(self, name: str) -> Recipe:
        return Recipe.model_validate(self.require_run(name).recipe)

    # --- stages --------------------------------------------------------------

    def stage(self, run: str, name: str) -> Stage | None:
        rows = list(self.db["stages"].rows_where("run = ? and name = ?", [run, name]))
        return _stage(rows[0]) if rows else None

    def stages(self, run: str) -> list[Stage]:
        return [_stage(row) for row in self.db["stages"].rows_where("run = ?", [run], order_by="id")]

    def mark_stage(self, run: str, name: str, status: str, **fields: Any) -> None:
        """Set a stage's status and any of its columns; params and result are given as dicts."""
        row = self.stage(run, name)
        values = {"status": status, **{k: json.dumps(v) if k in ("params", "result") else v for k, v in fields.items()}}
        with self.transaction():
            if row is None:
                self.db["stages"].insert({"run": run, "name": name, **values})
            else:
                self.db["stages"].update(row.id, values)

    # --- metrics and checkpoints --------------------------------------------

    def log_metrics(self, run: str, stage: str, step: int, values: dict[str, float | None]) -> None:
        rows = [
            {"run": run, "stage": stage, "step": step, "key": k, "value": float(v), "created_at": now()}
            for k, v in values.items()
            if v is not None
        ]
        with self.transaction():
            self.db["metrics"].upsert_all(rows, pk=("run", "stage", "step", "key"), alter=False)

    def metrics(self, run: str, key: str | None = None) -> list[Metric]:
        where, params = "run = ?", [run]
        if key:
            where, params = where + " and key = ?", params + [key]
        return [
            Metric(r["run"], r["stage"], r["step"], r["key"], r["value"], r["created_at"])
            for r in self.db["metrics"].rows_where(where, params, order_by="step, id")
        ]

    def latest_metrics(self, run: str) -> dict[str, float]:
        sql = """
            select key, value from metrics m where run = ? and step = (
                select max(step) from metrics where run = m.run and key = m.key
            ) order by key
        """
        return {k: v for k, v in self.db.execute(sql, [run]).fetchall()}

    def add_checkpoint(self, run: str, stage: str, iteration: int, path: str | Path, kind: str) -> int:
        with self.transaction():
            table = self.db["checkpoints"].insert(
                {
                    "run": run,
                    "stage": stage,
                    "iteration": iteration,
                    "path": str(path),
                    "kind": kind,
                    "created_at": now(),
                }
            )
        return table.last_pk

    def checkpoints(self, run: str) -> list[Checkpoint]:
        return [Checkpoint(**row) for row in self.db["checkpoints"].rows_where("run = ?", [run], order_by="id")]

    def resolve_checkpoint(self, run: str, which: str) -> Checkpoint | None:
        """base -> None (the base model); sft / latest / a numeric id -> that checkpoint."""
        if which == "base":
            return None
        rows = self.checkpoints(run)
        if which == "latest":
            if not rows:
                return None
            return rows[-1]
        if which == "sft":
            sft_rows = [r for r in rows if r.stage == "sft"]
            if not sft_rows:
                raise UsageError(f"Run {run!r} has no SFT checkpoint; run `rlcli sft` first or choose base/latest.")
            return sft_rows[-1]
        if which.isdigit():
            for row in rows:
                if row.id == int(which):
                    return row
            raise UsageError(f"Run {run!r} has no checkpoint with id {which}; `rlcli runs show {run}` lists them.")
        raise UsageError(f"Unknown checkpoint {which!r}: expected base, sft, latest or a checkpoint id.")


def _run(row: dict[str, Any]) -> Run:
    return Run(**{**row, "recipe": json.loads(row["recipe"]), "versions": json.loads(row["versions"] or "{}")})


def _stage(row: dict[str, Any]) -> Stage:
    return Stage(
        **{
            **row,
            "params": json.loads(row["params"] or "{}"),
            "result": json.loads(row["result"]) if row["result"] else None,
        }
    )


def package_versions() -> dict[str, str | None]:
    """Versions from package metadata; importing torch just to ask would cost seconds."""
    import platform
    from importlib import metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for pkg in ("rlcli", "torch", "transformers", "trl", "peft", "bitsandbytes", "datasets"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    return versions


def git_sha(folder: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def check_run_name(name: str) -> str:
    import re

    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name or ""):
        raise UsageError(
            f"Run name {name!r} is not valid: use letters, digits and -_. only, starting with a letter or digit."
        )
    return name
