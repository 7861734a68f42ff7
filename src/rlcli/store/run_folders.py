"""A run's folder, <runs-dir>/<run>, and the marker file that says rlcli made it.

rlcli deletes only what it made. A run folder it creates holds a marker (MARKER) from the start;
`rlcli runs delete` removes a run's folder only when the marker is there, and a new run refuses a
folder that exists with something in it and no marker: someone's data, or what else shares the runs
folder (the model cache under RLCLI_HOME), would become the run's, and be deleted with it. A run
recorded by an older rlcli has a folder without a marker, and keeps it so: rlcli cannot tell what
else went into that folder, so it leaves deleting it to a person (check_deletable says how).
"""

from __future__ import annotations

from pathlib import Path

from rlcli.errors import UsageError

MARKER = ".rlcli-run"
LOCK = "lock"


def claim_run_folder(runs_dir: Path, run: str, recorded: bool) -> bool:
    """Make <runs-dir>/<run> the run's folder before anything is written there: created with its
    marker, or an empty one marked; True when this call created it. A run the database does not
    record yet (`recorded` False) refuses a folder that holds something and no marker."""
    folder = runs_dir / run
    if folder.is_symlink() or folder.exists():
        if not folder.is_dir():
            raise UsageError(
                f"{folder} is not a folder, and run {run!r} would have its folder there; choose another run "
                "name, or move it away."
            )
        created = False
    else:
        folder.mkdir(exist_ok=True)  # exist_ok: another rlcli starting the same new run made it meanwhile
        created = True
    marker = folder / MARKER
    if marker.exists():
        return created
    # Nothing in it but, perhaps, the lock file rlcli takes in every run folder (store/stages.py, RunLock).
    if created or {entry.name for entry in folder.iterdir()} <= {LOCK}:
        marker.write_text(f"{run}\n")
        return created
    if not recorded:
        raise UsageError(
            f"{folder} already exists and rlcli did not make it (it holds no {MARKER} file), so a new run "
            f"{run!r} will not move into it; choose another run name, or move that folder away."
        )
    return False  # an older rlcli's run: its folder stays unmarked


def holds_no_output(runs_dir: Path, run: str) -> bool:
    """Whether the run's folder holds no file but its marker and lock: no checkpoint, no half-written
    Trainer state, no tracker log (empty folders a stage made before it failed do not count)."""
    folder = runs_dir / run
    return not any(p.is_file() and p.relative_to(folder).as_posix() not in (MARKER, LOCK) for p in folder.rglob("*"))


def check_deletable(folder: Path, run: str) -> None:
    """Refuse to delete a run folder unless rlcli made it: a link, or a folder without the marker (a run
    recorded by an older rlcli), is left to be deleted by hand, as the sentence says."""
    by_hand = f"delete it by hand if it should go, then run `rlcli runs delete {run}` again to delete the run's rows"
    if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
        raise UsageError(f"{folder} is not a folder rlcli made, so rlcli will not delete it; {by_hand}.")
    if folder.exists() and not (folder / MARKER).exists():
        raise UsageError(
            f"{folder} holds no {MARKER} file (an older rlcli made the run), so rlcli cannot tell that everything "
            f"in it is the run's; look through it, {by_hand}."
        )
