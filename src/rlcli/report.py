"""Views of the run database: rich tables in the terminal, dicts for --json."""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table

from rlcli.rundb import RunDB

KEY_METRICS = ("rollout/reward_mean", "rollout/success_rate", "train/loss")


def runs_summary(rundb: RunDB) -> list[dict[str, Any]]:
    rows = []
    for run in rundb.list_runs():
        rows.append(
            {
                "name": run["name"],
                "status": run["status"],
                "created_at": run["created_at"],
                "metrics": {k: v for k, v in rundb.latest_metrics(run["name"]).items() if k in KEY_METRICS},
            }
        )
    return rows


def runs_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Runs")
    for col in ("run", "status", "created", *KEY_METRICS):
        table.add_column(col)
    for row in rows:
        metrics = row["metrics"]
        table.add_row(
            row["name"],
            row["status"],
            row["created_at"][:19].replace("T", " "),
            *(_fmt(metrics.get(k)) for k in KEY_METRICS),
        )
    return table


def run_details(rundb: RunDB, name: str) -> dict[str, Any]:
    run = rundb.require_run(name)
    stages = [
        {
            "name": s["name"],
            "status": s["status"],
            "started_at": s["started_at"],
            "finished_at": s["finished_at"],
            "error": s["error"],
            "result": json.loads(s["result"]) if s["result"] else None,
        }
        for s in rundb.stages(name)
    ]
    evals = [
        {k: v for k, v in row.items() if k not in ("details",)} | {"details": json.loads(row["details"] or "{}")}
        for row in rundb.db["evals"].rows_where("run = ?", [name], order_by="id")
    ]
    episodes = rundb.db.execute(
        "select count(*), sum(status = 'failed') from episodes where run = ?", [name]
    ).fetchone()
    return {
        "name": run["name"],
        "status": run["status"],
        "created_at": run["created_at"],
        "recipe_sha256": run["recipe_sha256"],
        "recipe_path": run["recipe_path"],
        "seed": run["seed"],
        "git_sha": run["git_sha"],
        "hostname": run["hostname"],
        "versions": json.loads(run["versions"] or "{}"),
        "stages": stages,
        "episodes": {"total": episodes[0] or 0, "failed": episodes[1] or 0},
        "latest_metrics": rundb.latest_metrics(name),
        "reward_curve": _curve(rundb, name, "rollout/reward_mean"),
        "checkpoints": rundb.checkpoints(name),
        "evals": evals,
    }


def _curve(rundb: RunDB, run: str, key: str) -> list[float]:
    return [row["value"] for row in rundb.metrics(run, key)]


def print_run(console: Console, data: dict[str, Any]) -> None:
    header = (
        f"[bold]{data['name']}[/bold]  status: {data['status']}  created: {data['created_at'][:19]}\n"
        f"recipe sha256: {data['recipe_sha256'][:12]}  seed: {data['seed']}  host: {data['hostname']}  "
        f"episodes: {data['episodes']['total']} ({data['episodes']['failed']} failed)"
    )
    stages = Table(title="Stages", expand=False)
    for col in ("stage", "status", "started", "finished", "error"):
        stages.add_column(col)
    for s in data["stages"]:
        style = {"done": "green", "failed": "red", "running": "yellow"}.get(s["status"], "")
        stages.add_row(
            s["name"],
            f"[{style}]{s['status']}[/{style}]" if style else s["status"],
            (s["started_at"] or "")[11:19],
            (s["finished_at"] or "")[11:19],
            (s["error"] or "")[:80],
        )
    parts: list[Any] = [header, stages]
    if data["latest_metrics"]:
        metrics = Table(title="Latest metrics")
        metrics.add_column("key")
        metrics.add_column("value", justify="right")
        for k, v in data["latest_metrics"].items():
            metrics.add_row(k, _fmt(v))
        parts.append(metrics)
    if data["reward_curve"]:
        parts.append(f"reward per iteration  {sparkline(data['reward_curve'])}  "
                     f"({_fmt(data['reward_curve'][0])} → {_fmt(data['reward_curve'][-1])})")
    if data["evals"]:
        parts.append(evals_table(data["evals"]))
    console.print(Panel(Group(*parts), title="rlcli run", expand=False))


def evals_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Evaluation (held-out tasks)")
    for col in ("checkpoint", "tasks", "k", "success", "95% CI", "mean return", "pass@k", "avg@k", "turns", "tokens"):
        table.add_column(col, justify="right" if col != "checkpoint" else "left")
    for r in rows:
        table.add_row(
            str(r["checkpoint"]),
            str(r["tasks"]),
            str(r["k"]),
            f"{r['success_rate']:.1%}",
            f"{r['ci_low']:.1%}–{r['ci_high']:.1%}",
            _fmt(r["mean_return"]),
            _fmt(r["pass_at_k"]),
            _fmt(r["avg_at_k"]),
            _fmt(r["mean_turns"]),
            _fmt(r["mean_tokens"]),
        )
    return table


def sparkline(values: list[float]) -> str:
    bars = "▁▂▃▄▅▆▇█"
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(bars[int((v - lo) / span * (len(bars) - 1))] for v in values)


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
