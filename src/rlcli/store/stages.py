"""Stage bookkeeping: one process per run, skip what is done, resume what is not, record failures.

A stage is a named unit of a run (`sft`, `rollout/0`, `train/3`, `eval/base`; store/names.py builds and
parses the names). Its work must be
idempotent at the granularity it commits (episodes, optimizer checkpoints), so that re-running
after a crash continues instead of repeating.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rlcli.errors import RlcliError, UsageError
from rlcli.store.db import now
from rlcli.store.records import Run, Stage
from rlcli.store.run_store import RunStore

NEW_STAGE_HINT = "give the new work another stage name"


class RunLock:
    """An exclusive OS lock on `<runs-dir>/<run>/lock`.

    flock is released by the kernel when the process dies, even by kill -9, so a stale lock
    file never blocks: the pid written inside is only there to name the holder.
    """

    def __init__(self, runs_dir: Path, run: str):
        self.path = Path(runs_dir) / run / "lock"
        self._fh: IO[str] | None = None

    def __enter__(self) -> RunLock:
        # A holder may remove the folder (remove_folder) before it lets go: a lock taken on a file
        # that is no longer at the path holds nothing, so it is taken again on the new one.
        for _ in range(100):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                fh = self.path.open("a+")
            except FileNotFoundError:  # the folder went between the mkdir and the open
                continue
            try:
                _flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.seek(0)
                holder = fh.read().strip() or "unknown"
                fh.close()
                raise RlcliError(
                    f"Run {self.path.parent.name!r} is in use by another rlcli process (pid {holder}); "
                    "wait for it to finish or stop it."
                ) from None
            except BaseException:
                fh.close()
                raise
            if _same_file(fh, self.path):
                break
            fh.close()
        else:
            raise RlcliError(f"Could not lock run {self.path.parent.name!r}: its lock file keeps being removed.")
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh
        return self

    def remove_folder(self) -> None:
        """While holding the lock: remove the lock file, and the run's folder if nothing else is in it
        (a new run refused before any work leaves no folder behind)."""
        assert self._fh is not None, "remove_folder needs the lock held"
        self.path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # not empty: something else lives there, and stays
            self.path.parent.rmdir()

    def __exit__(self, *exc: object) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None

    @staticmethod
    def held(runs_dir: Path, run: str) -> bool:
        """Whether some process holds the run's lock now (a shared probe that never waits).

        Where the file system cannot tell (no flock), the answer is yes: a run is only called
        stopped when that is known.
        """
        try:
            with (Path(runs_dir) / run / "lock").open() as fh:
                fcntl.flock(fh, fcntl.LOCK_SH | fcntl.LOCK_NB)
                fcntl.flock(fh, fcntl.LOCK_UN)
        except FileNotFoundError:
            return False
        except OSError:  # BlockingIOError: an exclusive holder; anything else: cannot tell
            return True
        return False


def _same_file(fh: IO[str], path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fh.fileno()), os.stat(path))
    except FileNotFoundError:
        return False


def _flock(fh: IO[str], operation: int) -> None:
    try:
        fcntl.flock(fh, operation)
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOSYS):
            raise
        raise UsageError(
            f"The file system of {Path(fh.name).parent.parent} does not support file locks ({exc.strerror}), "
            "which rlcli needs to keep two processes off one run; put the runs folder on a local disk "
            "with --runs-dir DIR or RLCLI_HOME."
        ) from None


def displayed_status(runs_dir: Path, run: Run) -> str:
    """A run recorded as running whose lock no process holds was killed: it is `stopped`."""
    if run.status == "running" and not RunLock.held(runs_dir, run.name):
        return "stopped"
    return run.status


def run_stage(
    store: RunStore,
    name: str,
    work: Callable[[], dict[str, Any] | None],
    params: dict[str, Any] | None = None,
    *,
    identity: dict[str, Any] | None = None,
    new_stage_hint: str = NEW_STAGE_HINT,
    commit: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run `work` as stage `name` of `run` unless it is already done; return its result summary.

    `commit(result)`, if given, makes the stage's closing writes (a checkpoint row, metrics) in the
    transaction that marks it done: a kill leaves all of them or none.

    `identity` holds the parameters that define the stage's work (a policy, a split, reward specs):
    asked again under the same name with other values, the stage is refused, done or interrupted
    (whose episodes would mix). `params` holds the rest, such as a task count that may grow.
    """
    row = store.stage(name)
    identity = json.loads(json.dumps(identity or {}))  # compared as stored: tuples become lists
    if row is not None:
        _check_identity(store.run, row, identity, new_stage_hint)
    if row is not None and row.done:
        return row.result or {}
    started = row.started_at if row and row.started_at else now()
    stored = {**(params or {}), **identity}
    store.mark_stage(name, "running", started_at=started, params=stored, error=None, pid=os.getpid())
    # The stage's time is its runs' time: a run killed outright (kill -9) records none of its own.
    earlier, began = (row.duration_s if row else None) or 0.0, time.monotonic()

    def elapsed() -> float:
        return round(earlier + time.monotonic() - began, 3)

    try:
        result = work() or {}
        with store.rundb.transaction():
            if commit is not None:
                commit(result)
            store.mark_stage(name, "done", result=result, finished_at=now(), elapsed_s=elapsed())
    except BaseException as exc:
        reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else (str(exc) or type(exc).__name__)
        store.mark_stage(name, "failed", error=reason, finished_at=now(), elapsed_s=elapsed())
        raise
    return result


def _check_identity(run: str, row: Stage, identity: dict[str, Any], new_stage_hint: str) -> None:
    # A parameter the row lacks was not recorded (an older rlcli): nothing to compare it with.
    changed = [key for key, value in identity.items() if key in row.params and row.params[key] != value]
    if changed:
        was = ", ".join(f"{key}={row.params[key]!r}" for key in changed)
        asked = ", ".join(f"{key}={identity[key]!r}" for key in changed)
        raise UsageError(f"Stage {row.name!r} of run {run!r} was run with {was}, not {asked}; {new_stage_hint}.")


def stage_done(store: RunStore, name: str) -> bool:
    row = store.stage(name)
    return row is not None and row.done
