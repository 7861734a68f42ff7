"""RunStore: one run's view of the run database.

Nearly every read and write of a stage concerns one run, so the store's functions used to take the
database and the run's name as a pair, and every caller passed both. A RunStore binds the two once,
where a run is opened or named (RunContext.store, the CLI's commands), in the spirit of simonw/llm's
objects bound to one conversation: the pair disappears from signatures, and no caller can pair one
run's name with another database. What concerns the whole database (opening
it, migrations, listing, comparing or deleting runs) stays on RunDB.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

from rlcli.store.db import RunDB

if TYPE_CHECKING:
    from rlcli.recipe import Recipe
    from rlcli.store.records import Metric, Run, Stage

P = ParamSpec("P")
R = TypeVar("R")


@dataclass(frozen=True)
class RunStore:
    """The run database bound to the run named `run`; the methods are RunDB's per-run calls."""

    rundb: RunDB
    run: str

    def require_run(self) -> Run:
        """The run's row; a run the database does not know is a UsageError that lists the known ones."""
        return self.rundb.require_run(self.run)

    def recipe(self) -> Recipe:
        return self.rundb.run_recipe(self.run)

    def set_status(self, status: str, error: str | None = None) -> None:
        self.rundb.set_run_status(self.run, status, error)

    def stage(self, name: str) -> Stage | None:
        return self.rundb.stage(self.run, name)

    def stages(self) -> list[Stage]:
        return self.rundb.stages(self.run)

    def mark_stage(self, name: str, status: str, **fields: Any) -> None:
        self.rundb.mark_stage(self.run, name, status, **fields)

    def log_metrics(self, stage: str, step: int, values: dict[str, float | None]) -> None:
        self.rundb.log_metrics(self.run, stage, step, values)

    def metrics(self, key: str | None = None) -> list[Metric]:
        return self.rundb.metrics(self.run, key)

    def latest_metrics(self) -> dict[str, float]:
        return self.rundb.latest_metrics(self.run)


class AcceptsRunPair(Generic[P, R]):
    """Temporary: a function that takes a RunStore first, callable with the database and the run's name
    in its place too.

    Files other changes are editing at the same time (engine/sft.py, dpo.py, hf_trainer.py, games.py)
    still pass the pair to the functions wrapped with this; remove it once they pass a RunStore."""

    def __init__(self, fn: Callable[Concatenate[RunStore, P], R]) -> None:
        self.fn = fn
        functools.update_wrapper(self, fn)

    @overload
    def __call__(self, store: RunStore, /, *args: P.args, **kwargs: P.kwargs) -> R: ...

    @overload
    def __call__(self, rundb: RunDB, run: str, /, *args: P.args, **kwargs: P.kwargs) -> R: ...

    def __call__(self, first: Any, /, *args: Any, **kwargs: Any) -> R:
        if isinstance(first, RunStore):
            return self.fn(first, *args, **kwargs)
        return self.fn(RunStore(first, args[0]), *args[1:], **kwargs)
