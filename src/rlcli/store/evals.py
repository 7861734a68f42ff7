"""Eval results: one row per eval stage (a checkpoint evaluated with one decoding)."""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import Any

from rlcli.store.db import RunDB
from rlcli.store.records import EvalResult


def replace_eval(rundb: RunDB, result: EvalResult) -> None:
    """Store a stage's eval result in place of any earlier one (a re-run with more tasks)."""
    row = {**asdict(result), "details": json.dumps(result.details)}
    row.pop("id")
    with rundb.transaction() as db:
        db.execute("delete from evals where run = ? and stage = ?", [result.run, result.stage])
        db["evals"].insert(row)


def eval_result(rundb: RunDB, run: str, stage: str) -> EvalResult | None:
    rows = list(rundb.db["evals"].rows_where("run = ? and stage = ?", [run, stage]))
    return _eval(rows[0]) if rows else None


def eval_results(rundb: RunDB, run: str) -> list[EvalResult]:
    return [_eval(row) for row in rundb.db["evals"].rows_where("run = ?", [run], order_by="id")]


def _eval(row: dict[str, Any]) -> EvalResult:
    return EvalResult(**{**row, "details": json.loads(row["details"] or "{}")})
