"""Checkpoint rows: saved weights (and a GRPO checkpoint's optimizer state) under the runs dir.

A row's `path` is stored relative to the runs dir (the folder of rlcli.db), so that a run resumes
from any working directory; records come back with absolute paths. Rows written by older rlcli
hold a path relative to the working directory of the time, or an absolute one: both still resolve.
"""

from __future__ import annotations

import os
from pathlib import Path

from rlcli.errors import UsageError
from rlcli.store.db import RunDB, now
from rlcli.store.records import Checkpoint


def add_checkpoint(rundb: RunDB, run: str, stage: str, iteration: int, path: str | Path, kind: str) -> int:
    """Record the folder `path` (as the caller sees it) and return the row's id.

    A stage that is redone writes the same folder again: its row is reused, so that evals and
    exports that point at the id stay valid.
    """
    stored = _stored_path(rundb, Path(path))
    with rundb.transaction() as db:
        same = list(db["checkpoints"].rows_where("run = ? and stage = ? and path = ?", [run, stage, stored]))
        if same:
            db["checkpoints"].update(same[-1]["id"], {"iteration": iteration, "kind": kind, "created_at": now()})
            return same[-1]["id"]
        row = {"run": run, "stage": stage, "iteration": iteration, "path": stored, "kind": kind, "created_at": now()}
        return db["checkpoints"].insert(row).last_pk


def checkpoints(rundb: RunDB, run: str) -> list[Checkpoint]:
    """The run's checkpoints, oldest first, with absolute paths."""
    rows = rundb.db["checkpoints"].rows_where("run = ?", [run], order_by="id")
    return [Checkpoint(**{**row, "path": str(_resolved_path(rundb, row["path"], run))}) for row in rows]


def resolve_checkpoint(rundb: RunDB, run: str, which: str) -> Checkpoint | None:
    """base -> None (the base model); sft / latest / a numeric id -> that checkpoint."""
    if which == "base":
        return None
    rows = checkpoints(rundb, run)
    if which == "latest":
        return rows[-1] if rows else None
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


def train_checkpoints(rundb: RunDB, run: str) -> list[Checkpoint]:
    """GRPO's checkpoints (stages train/<i>), oldest first."""
    return [c for c in checkpoints(rundb, run) if c.stage.startswith("train/")]


def require_folder(checkpoint: Checkpoint) -> Path:
    """The checkpoint's folder; a recorded one that is gone is an error, never a silent fresh start."""
    folder = Path(checkpoint.path)
    if not folder.is_dir():
        raise UsageError(
            f"Checkpoint {checkpoint.id} of run {checkpoint.run!r} ({checkpoint.stage}) is recorded at {folder}, "
            "which does not exist; restore that folder, or give the --runs-dir that holds it."
        )
    return folder


def _runs_dir(rundb: RunDB) -> Path:
    return Path(os.path.abspath(rundb.path.parent))  # normalised like _stored_path's paths ("..")


def _stored_path(rundb: RunDB, path: Path) -> str:
    """Relative to the runs dir when the folder lies inside it, else absolute."""
    absolute = Path(os.path.abspath(path))
    try:
        return str(absolute.relative_to(_runs_dir(rundb)))
    except ValueError:
        return str(absolute)


def _resolved_path(rundb: RunDB, stored: str, run: str) -> Path:
    """The absolute folder of a stored path, whichever rlcli wrote it.

    Older rows: relative to the working directory they were written from (which is where they
    are found when it is this one), or absolute. Either way, a folder that has since moved with
    its runs dir is found below this runs dir, from the run's own folder on.
    """
    path, runs_dir = Path(stored), _runs_dir(rundb)
    candidates = [path] if path.is_absolute() else [runs_dir / path, Path.cwd() / path]
    run_folders = [i for i, part in enumerate(path.parts[:-1]) if part == run]
    if run_folders:
        candidates.append(runs_dir.joinpath(*path.parts[run_folders[-1] :]))
    return next((c for c in candidates if c.exists()), candidates[0])
