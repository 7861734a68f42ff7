"""Run events: warnings raised while a run trains, one per (run, kind, iteration)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from rlcli.store.db import now
from rlcli.store.run_store import RunStore


@dataclass(frozen=True)
class RunEvent:
    id: int | None  # None until stored
    run: str
    stage: str
    iteration: int
    kind: str
    message: str
    details: dict[str, Any]
    created_at: str


def add_event(store: RunStore, stage: str, iteration: int, kind: str, message: str, details: dict[str, Any]) -> bool:
    """Store an event unless the run already has one of this kind for this iteration (a resumed
    iteration checks again); True when it is new."""
    row = [store.run, stage, iteration, kind, message, json.dumps(details), now()]
    with store.rundb.transaction() as db:
        cursor = db.execute(
            "insert or ignore into run_events (run, stage, iteration, kind, message, details, created_at) "
            "values (?, ?, ?, ?, ?, ?, ?)",
            row,
        )
        return cursor.rowcount == 1


def list_events(store: RunStore, kind: str | None = None) -> list[RunEvent]:
    """The run's events in the order they were raised."""
    where, params = "run = ?", [store.run]
    if kind is not None:
        where, params = where + " and kind = ?", params + [kind]
    rows = store.rundb.db.table("run_events").rows_where(where, params, order_by="id")
    return [RunEvent(**{**row, "details": json.loads(row["details"] or "{}")}) for row in rows]
