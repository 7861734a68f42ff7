"""What every stage needs: the validated recipe, the run database, the run's name and folder."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console

from rlcli.recipe import Recipe
from rlcli.store.db import RunDB
from rlcli.store.stages import run_stage


@dataclass
class RunContext:
    recipe: Recipe
    rundb: RunDB
    run: str
    runs_dir: Path
    # Progress bars and notes go to stderr, so that --json output on stdout stays clean.
    console: Console = field(default_factory=lambda: Console(stderr=True))

    def __post_init__(self) -> None:
        self.runs_dir = Path(self.runs_dir)

    @property
    def run_dir(self) -> Path:
        return self.runs_dir / self.run

    def stage(
        self, name: str, work: Callable[[], dict[str, Any] | None], params: dict[str, Any] | None = None, **options: Any
    ) -> dict[str, Any]:
        """`run_stage` on this run; options are run_stage's keywords (identity, new_stage_hint, commit)."""
        return run_stage(self.rundb, self.run, name, work, params, **options)
