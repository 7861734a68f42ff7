"""Stage bookkeeping: one process per run, skip what is done, resume what is not, record failures.

A stage is a named unit of a run (`sft`, `rollout/0`, `train/3`, `eval/final`). Its work must be
idempotent at the granularity it commits (episodes, optimizer checkpoints), so that re-running
after a crash continues instead of repeating.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rlcli.errors import RlcliError
from rlcli.store.db import RunDB, now


class RunLock:
    """An exclusive OS lock on `<runs-dir>/<run>/lock`.

    flock is released by the kernel when the process dies, even by kill -9, so a stale lock
    file never blocks: the pid written inside is only there to name the holder.
    """

    def __init__(self, runs_dir: Path, run: str):
        self.path = Path(runs_dir) / run / "lock"
        self._fh = None

    def __enter__(self) -> RunLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fh = self.path.open("a+")
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip() or "unknown"
            fh.close()
            raise RlcliError(
                f"Run {self.path.parent.name!r} is in use by another rlcli process (pid {holder}); "
                "wait for it to finish or stop it."
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(str(os.getpid()))
        fh.flush()
        self._fh = fh
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fh is not None:
            fcntl.flock(self._fh, fcntl.LOCK_UN)
            self._fh.close()
            self._fh = None


def run_stage(
    rundb: RunDB,
    run: str,
    name: str,
    work: Callable[[], dict[str, Any] | None],
    params: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run `work` as stage `name` of `run` unless it is already done; return its result summary."""
    row = rundb.stage(run, name)
    if row is not None and row.done:
        return row.result or {}
    started = row.started_at if row and row.started_at else now()
    rundb.mark_stage(run, name, "running", started_at=started, params=params or {}, error=None, pid=os.getpid())
    try:
        result = work() or {}
    except BaseException as exc:
        reason = "interrupted" if isinstance(exc, KeyboardInterrupt) else (str(exc) or type(exc).__name__)
        rundb.mark_stage(run, name, "failed", error=reason, finished_at=now())
        raise
    rundb.mark_stage(run, name, "done", result=result, finished_at=now())
    return result


def stage_done(rundb: RunDB, run: str, name: str) -> bool:
    row = rundb.stage(run, name)
    return row is not None and row.done
