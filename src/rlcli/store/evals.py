"""Eval results: one row per eval stage (a checkpoint evaluated with one decoding) and task count.

A stage asked again for more tasks (GRPO's evals on grpo.eval_tasks, then `rlcli run`'s on
eval.tasks) plays only the tasks it lacks, and its smaller eval keeps its row beside the larger one:
both were measured, and the held-out curve shows the smaller one.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

from rlcli.store.db import RunDB
from rlcli.store.records import EvalResult
from rlcli.store.run_store import RunStore

if TYPE_CHECKING:
    from rlcli.recipe import Recipe


def eval_decoding(recipe: Recipe) -> tuple[float, int]:
    """The temperature and samples per task (k) of the recipe's held-out evals: greedy when k is 1,
    else the rollout temperature, unless eval.temperature says otherwise."""
    temperature = recipe.eval.temperature
    if temperature is None:
        temperature = 0.0 if recipe.eval.k == 1 else recipe.rollout.temperature
    return temperature, recipe.eval.k


def replace_eval(rundb: RunDB, result: EvalResult) -> None:
    """Store a stage's eval result in place of an earlier one over as many tasks (a stage redone)."""
    row = {**asdict(result), "details": json.dumps(result.details)}
    row.pop("id")
    with rundb.transaction() as db:
        db.execute(
            "delete from evals where run = ? and stage = ? and tasks = ?", [result.run, result.stage, result.tasks]
        )
        db.table("evals").insert(row)


def eval_result(store: RunStore, stage: str) -> EvalResult | None:
    """The stage's eval over the most tasks."""
    rows = list(
        store.rundb.db.table("evals").rows_where(
            "run = ? and stage = ?", [store.run, stage], order_by="tasks desc, id desc", limit=1
        )
    )
    return _eval(rows[0]) if rows else None


def eval_results(store: RunStore) -> list[EvalResult]:
    return [_eval(row) for row in store.rundb.db.table("evals").rows_where("run = ?", [store.run], order_by="id")]


def leading_tasks_success(store: RunStore, stage: str, tasks: int) -> float | None:
    """The success rate of an eval stage over its first `tasks` tasks (None when none of their
    episodes ran).

    An episode's task and sampling seed depend on its stage, task and sample only, so these are
    the very episodes an eval of `tasks` tasks plays: evals run on more tasks compare with it.
    Like eval_metrics, the rate is over the episodes that ran (a failed env says nothing).
    """
    n, successes = store.rundb.db.execute(
        "select count(*), sum(success) from episodes where run = ? and stage = ? and status = 'ok' and task_index < ?",
        [store.run, stage, tasks],
    ).fetchone()
    return successes / n if n else None


def _eval(row: dict[str, Any]) -> EvalResult:
    return EvalResult(**{**row, "details": json.loads(row["details"] or "{}")})
