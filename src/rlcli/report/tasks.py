"""`rlcli runs tasks RUN`: the run's training tasks by difficulty, as a dict (--json) and as tables."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from rlcli.store.run_store import RunStore
from rlcli.store.tasks import TaskStats, stored_task_stats

# Success-rate bins of the summary: never solved, hard, medium, easy, always solved.
BINS = (
    ("never solved (0)", lambda p: p == 0),
    ("hard (0-1/3)", lambda p: 0 < p < 1 / 3),
    ("medium (1/3-2/3)", lambda p: 1 / 3 <= p <= 2 / 3),
    ("easy (2/3-1)", lambda p: 2 / 3 < p < 1),
    ("always solved (1)", lambda p: p == 1),
)


def tasks_view(store: RunStore, label_set: str) -> dict[str, Any]:
    """Every task's statistics and a count of tasks per success-rate bin."""
    store.require_run()
    stats = stored_task_stats(store, label_set)
    return {
        "run": store.run,
        "label_set": label_set,
        "tasks": [_task_row(s) for s in stats],
        "summary": {
            "tasks": len(stats),
            "attempts": sum(s.attempts for s in stats),
            "success_rate": sum(s.successes for s in stats) / max(1, sum(s.attempts for s in stats)),
            "bins": {name: sum(1 for s in stats if inside(s.success_rate)) for name, inside in BINS},
        },
    }


def _task_row(s: TaskStats) -> dict[str, Any]:
    return {
        "task": s.task_index,
        "attempts": s.attempts,
        "successes": s.successes,
        "success_rate": s.success_rate,
        "reward_mean": s.reward_mean,
        "last_iteration": s.last_iteration,
    }


def print_tasks(console: Console, view: dict[str, Any], limit: int) -> None:
    """The tasks table (the first `limit` tasks by index; 0: all) and the difficulty histogram."""
    rows = view["tasks"]
    if not rows:
        console.print(
            f"Run {view['run']!r} has no labelled training tasks yet (label set {view['label_set']!r}); "
            "they appear after a GRPO iteration's label stage."
        )
        return
    shown = rows[:limit] if limit else rows
    table = Table(title=f"Tasks of {view['run']}" + (f" (first {len(shown)} of {len(rows)})" if shown != rows else ""))
    for col in ("task", "attempts", "success rate", "mean reward", "last seen"):
        table.add_column(col, justify="right")
    for r in shown:
        last = "–" if r["last_iteration"] is None else f"iter {r['last_iteration']}"
        table.add_row(str(r["task"]), str(r["attempts"]), f"{r['success_rate']:.2f}", f"{r['reward_mean']:.3g}", last)
    console.print(table)

    summary = view["summary"]
    histogram = Table(
        title=f"{summary['tasks']} tasks, {summary['attempts']} episodes, success {summary['success_rate']:.2f}"
    )
    histogram.add_column("success rate")
    histogram.add_column("tasks", justify="right")
    histogram.add_column("")
    most = max(summary["bins"].values())
    for name, count in summary["bins"].items():
        histogram.add_row(name, str(count), "█" * round(30 * count / most) if most else "")
    console.print(histogram)
