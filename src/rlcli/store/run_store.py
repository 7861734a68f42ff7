"""RunStore: one run's view of the run database.

Nearly every read and write of a stage concerns one run, so the store's functions used to take the
database and the run's name as a pair, and every caller passed both. A RunStore binds the two once,
where a run is opened or named (RunContext.store, the CLI's commands), in the spirit of simonw/llm's
objects bound to one conversation: the pair disappears from signatures, and no caller can pair one
run's name with another database. What concerns the whole database (opening
it, migrations, listing, comparing or deleting runs) stays on RunDB.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcli.store.db import RunDB

if TYPE_CHECKING:
    from rlcli.recipe import Recipe
    from rlcli.store.records import Metric, Run, Stage


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

    def tracker_step(self, stage: str) -> int | None:
        return self.rundb.tracker_step(self.run, stage)

    def record_tracker_step(self, stage: str, step: int) -> None:
        self.rundb.record_tracker_step(self.run, stage, step)

    def unsent_metrics(self, stage: str, after: int, before: int | None = None) -> list[tuple[int, dict[str, float]]]:
        return self.rundb.unsent_metrics(self.run, stage, after, before)
