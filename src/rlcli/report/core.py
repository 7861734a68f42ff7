"""Views of the run database: rich tables and sparklines in the terminal, dicts for --json, PNG
plots and file exports. Every view is a query on the database; nothing here writes to it.

docs/reporting.md describes the commands built on these functions.
"""

from __future__ import annotations

import datetime as dt
import itertools
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rlcli.errors import UsageError
from rlcli.store.db import RunDB

KEY_METRICS = ("rollout/reward_mean", "rollout/success_rate", "train/loss")
COMPARE_METRICS = (
    "rollout/reward_mean",
    "rollout/success_rate",
    "train/loss",
    "train/kl",
    "train/entropy",
    "perf/tokens_per_s",
)
REWARD_KEY = "rollout/reward_mean"
SUCCESS_KEY = "rollout/success_rate"


# --- runs list -----------------------------------------------------------------


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


# --- runs show -----------------------------------------------------------------


def run_details(rundb: RunDB, name: str) -> dict[str, Any]:
    run = rundb.require_run(name)
    stages = [
        {
            "name": s["name"],
            "status": s["status"],
            "started_at": s["started_at"],
            "finished_at": s["finished_at"],
            "duration_s": _duration(s["started_at"], s["finished_at"]),
            "error": s["error"],
            "result": json.loads(s["result"]) if s["result"] else None,
        }
        for s in rundb.stages(name)
    ]
    episodes = rundb.db.execute(
        "select count(*), sum(status = 'failed') from episodes where run = ?", [name]
    ).fetchone()
    return {
        "name": run["name"],
        "status": run["status"],
        "description": json.loads(run["recipe"]).get("run", {}).get("description") or "",
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
        "reward_curve": _curve(rundb, name, REWARD_KEY),
        "success_curve": _curve(rundb, name, SUCCESS_KEY),
        "checkpoints": rundb.checkpoints(name),
        "evals": eval_rows(rundb, name),
    }


def eval_rows(rundb: RunDB, run: str) -> list[dict[str, Any]]:
    """Evals rows with their details parsed and a display label that tells checkpoints apart."""
    rows = []
    for row in rundb.db["evals"].rows_where("run = ?", [run], order_by="id"):
        rows.append({**row, "details": json.loads(row["details"] or "{}"), "label": _eval_label(row)})
    return rows


def _eval_label(row: dict[str, Any]) -> str:
    # "latest" means a different checkpoint each time it is evaluated: name the one it was; a
    # sampled eval says how it sampled, to tell it from the greedy one of the same checkpoint.
    which, ckpt = row["checkpoint"], row["checkpoint_id"]
    decoding = row["stage"].partition("@")[2]
    label = which if ckpt is None else f"ckpt-{ckpt}" if which == str(ckpt) else f"{which} (ckpt-{ckpt})"
    return f"{label} @{decoding}" if decoding else label


def _curve(rundb: RunDB, run: str, key: str) -> list[float]:
    return [row["value"] for row in rundb.metrics(run, key)]


def metric_series(rundb: RunDB, run: str) -> dict[str, dict[str, Any]]:
    """Every metric of a run as {key: {"stage", "steps", "values"}}, in step order."""
    series: dict[str, dict[str, Any]] = {}
    for row in rundb.metrics(run):
        entry = series.setdefault(row["key"], {"stage": row["stage"], "steps": [], "values": []})
        entry["steps"].append(row["step"])
        entry["values"].append(row["value"])
    return series


def print_run(console: Console, data: dict[str, Any], series: dict[str, dict[str, Any]] | None = None) -> None:
    """The `runs show` view; `series` (from metric_series) adds a trend column to the metrics."""
    header = Text.assemble((data["name"], "bold"), f"  status: {data['status']}  created: {data['created_at'][:19]}")
    if data.get("description"):
        header.append(f"\n{data['description']}", style="italic")
    header.append(
        f"\nrecipe sha256: {data['recipe_sha256'][:12]}  seed: {data['seed']}  host: {data['hostname']}  "
        f"git: {(data['git_sha'] or '–')[:10]}  "
        f"episodes: {data['episodes']['total']} ({data['episodes']['failed']} failed)"
    )
    parts: list[Any] = [header]
    if data["stages"]:
        parts.append(stages_table(data["stages"]))
    for title, curve in (("reward", data["reward_curve"]), ("success", data["success_curve"])):
        if curve:
            parts.append(
                Text(f"{title:<8} per iteration  {sparkline(curve, 60)}  "
                     f"{_fmt(curve[0])} → {_fmt(curve[-1])}  (min {_fmt(min(curve))}, max {_fmt(max(curve))})")
            )
    if data["latest_metrics"]:
        parts.append(metrics_table(data["latest_metrics"], series or {}))
    if data["checkpoints"]:
        parts.append(checkpoints_table(data["checkpoints"]))
    if data["evals"]:
        parts.append(evals_table(data["evals"]))
    console.print(Group(*parts))


def stages_table(stages: list[dict[str, Any]]) -> Table:
    """Stages with durations; numbered stages (rollout/0, rollout/1, ...) fold into one row each."""
    table = Table(title="Stages", expand=False)
    for col in ("stage", "status", "started", "finished", "duration", "error"):
        table.add_column(col, justify="right" if col == "duration" else "left")
    for name, members in _stage_groups(stages):
        counts = Counter(s["status"] for s in members)
        status = ", ".join(f"{n} {st}" if len(members) > 1 else st for st, n in counts.items())
        style = "red" if "failed" in counts else "yellow" if "running" in counts else "green" if "done" in counts else ""
        durations = [s["duration_s"] for s in members if s["duration_s"] is not None]
        failed = next((s for s in members if s["error"]), None)
        error = "" if failed is None else (failed["error"] if len(members) == 1 else f"{failed['name']}: {failed['error']}")
        table.add_row(
            name,
            Text(status, style=style),
            (members[0]["started_at"] or "")[11:19],
            (members[-1]["finished_at"] or "")[11:19],
            _fmt_duration(sum(durations)) if durations else "–",
            Text(error[:80], style="red"),
        )
    return table


def _stage_groups(stages: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    # One row per numbered family keeps a 100-iteration run readable; the JSON keeps every stage.
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in stages:
        match = re.fullmatch(r"(.*)/(\d+)", s["name"])
        groups.setdefault(match.group(1) if match else s["name"], []).append(s)
    out = []
    for prefix, members in groups.items():
        if len(members) == 1:
            out.append((members[0]["name"], members))
        else:
            numbers = [int(m["name"].rsplit("/", 1)[1]) for m in members]
            out.append((f"{prefix}/{min(numbers)}…{max(numbers)}", members))
    return out


def metrics_table(latest: dict[str, float], series: dict[str, dict[str, Any]]) -> Table:
    table = Table(title="Latest metrics")
    table.add_column("key")
    table.add_column("step", justify="right")
    table.add_column("value", justify="right")
    table.add_column("trend")
    for key, value in latest.items():
        entry = series.get(key)
        table.add_row(
            key,
            str(entry["steps"][-1]) if entry else "",
            _fmt(value),
            sparkline(entry["values"], 30) if entry and len(entry["values"]) > 1 else "",
        )
    return table


def checkpoints_table(rows: list[dict[str, Any]], shown: int = 10) -> Table:
    hidden = max(0, len(rows) - shown)
    table = Table(title="Checkpoints" + (f" (latest {shown} of {len(rows)})" if hidden else ""))
    for col in ("id", "stage", "iteration", "kind", "created", "path"):
        table.add_column(col)
    for r in rows[hidden:]:
        table.add_row(str(r["id"]), r["stage"], _fmt(r["iteration"]), r["kind"] or "",
                      (r["created_at"] or "")[:19].replace("T", " "), r["path"])
    return table


def evals_table(rows: list[dict[str, Any]]) -> Table:
    # Sized for an 80-column terminal; avg@k is left to --json (with k samples of every task it
    # equals the success rate).
    table = Table(title="Evaluation (held-out tasks)")
    for col in ("checkpoint", "tasks×k", "success", "95% CI", "return", "pass@k", "turns", "tokens"):
        table.add_column(col, justify="left" if col == "checkpoint" else "right", min_width=min(len(col), 8))
    for r in rows:
        table.add_row(
            str(r.get("label") or r["checkpoint"]),
            f"{r['tasks']}×{r['k']}",
            f"{r['success_rate']:.1%}",
            f"{r['ci_low']:.0%}–{r['ci_high']:.0%}",
            _fmt(r["mean_return"]),
            _fmt(r["pass_at_k"]),
            _fmt(r["mean_turns"]),
            _fmt(r["mean_tokens"]),
        )
    return table


# --- runs compare ----------------------------------------------------------------


def compare_runs(rundb: RunDB, names: list[str]) -> list[dict[str, Any]]:
    out = []
    for name in names:
        run = rundb.require_run(name)
        latest = rundb.latest_metrics(name)
        best: dict[str, dict[str, Any]] = {}
        for row in eval_rows(rundb, name):
            # The raw checkpoint label (base, sft, latest, expert, an id) is what runs share.
            label = row["checkpoint"]
            if label not in best or row["success_rate"] > best[label]["success_rate"]:
                best[label] = {k: row[k] for k in ("success_rate", "ci_low", "ci_high", "tasks", "k", "stage")}
        episodes = rundb.db.execute("select count(*) from episodes where run = ?", [name]).fetchone()[0]
        out.append(
            {
                "name": name,
                "status": run["status"],
                "created_at": run["created_at"],
                "recipe_sha256": run["recipe_sha256"],
                "episodes": episodes,
                "latest_metrics": {k: latest[k] for k in COMPARE_METRICS if k in latest},
                "best_evals": best,
                "reward_curve": _curve(rundb, name, REWARD_KEY),
            }
        )
    return out


def compare_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Runs side by side")
    table.add_column("", no_wrap=True)
    for row in rows:
        table.add_column(row["name"], justify="right")

    table.add_row("status", *(r["status"] for r in rows))
    table.add_row("created", *(r["created_at"][:16].replace("T", " ") for r in rows))
    table.add_row("recipe sha256", *(r["recipe_sha256"][:12] for r in rows))
    table.add_row("episodes", *(str(r["episodes"]) for r in rows))
    for key in COMPARE_METRICS:
        if any(key in r["latest_metrics"] for r in rows):
            table.add_row(key, *(_fmt(r["latest_metrics"].get(key)) for r in rows))
    labels = dict.fromkeys(label for r in rows for label in r["best_evals"])
    for label in labels:
        table.add_row(f"eval success: {label}", *(_fmt_eval(r["best_evals"].get(label)) for r in rows))
    table.add_row("reward curve", *(sparkline(r["reward_curve"], 24) or "–" for r in rows))
    return table


def _fmt_eval(best: dict[str, Any] | None) -> str:
    if best is None:
        return "–"
    return f"{best['success_rate']:.1%} [{best['ci_low']:.0%}–{best['ci_high']:.0%}]"


# --- runs plot -----------------------------------------------------------------

# Default panels: (title, metric keys drawn in it). A panel whose keys are all missing is skipped.
DEFAULT_PANELS = (
    ("Reward (mean ± std)", (REWARD_KEY,)),
    ("Success rate", (SUCCESS_KEY,)),
    ("Policy loss", ("train/loss",)),
    ("KL to reference", ("train/kl",)),
    ("Entropy", ("train/entropy",)),
    ("SFT loss", ("sft/loss", "sft/eval_loss")),
)


def plot_run(rundb: RunDB, name: str, out: Path, metrics: list[str] | None = None) -> Path:
    """Write a PNG (or any format matplotlib knows by the suffix) of a run's curves and evals."""
    run = rundb.require_run(name)
    series = metric_series(rundb, name)
    evals = eval_rows(rundb, name)
    if metrics:
        missing = [key for key in metrics if key not in series]
        if missing:
            known = ", ".join(series) or "none"
            raise UsageError(f"Run {name!r} has no metric {missing[0]!r}; its metrics: {known}.")
        panels = [(key, (key,)) for key in metrics]
    else:
        panels = [(title, keys) for title, keys in DEFAULT_PANELS if any(k in series for k in keys)]
    show_evals = bool(evals) and not metrics
    if not panels and not show_evals:
        raise UsageError(f"Run {name!r} has nothing to plot yet: no metrics and no evals; train or evaluate it first.")

    # The object API with an explicit Agg canvas: no pyplot global state, no GUI backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    count = len(panels) + show_evals
    cols = 1 if count == 1 else 2
    rows = math.ceil(count / cols)
    fig = Figure(figsize=(6.0 * cols, 3.4 * rows), layout="constrained")
    canvas = FigureCanvasAgg(fig)
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in canvas.get_supported_filetypes():
        raise UsageError(f"Cannot write {out}: give --out a file ending in .png (or .pdf, .svg).")
    fig.suptitle(f"{name} ({run['status']})")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, (title, keys) in zip(axes, panels):
        present = [key for key in keys if key in series]
        for key in present:
            _plot_series(ax, key, series[key], std=series.get("rollout/reward_std") if key == REWARD_KEY else None)
        ax.set_title(title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if SUCCESS_KEY in keys:
            ax.set_ylim(-0.02, 1.02)
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        if len(present) > 1:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    if show_evals:
        _plot_evals(axes[len(panels)], evals)
    for ax in axes[count:]:
        ax.set_visible(False)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    return out


def _plot_series(ax: Any, key: str, entry: dict[str, Any], std: dict[str, Any] | None) -> None:
    steps, values = entry["steps"], entry["values"]
    ax.plot(steps, values, marker="o", markersize=3, label=key)
    if std is not None:
        by_step = dict(zip(std["steps"], std["values"]))
        pairs = [(s, v, by_step[s]) for s, v in zip(steps, values) if s in by_step]
        if pairs:
            s, v, d = zip(*pairs)
            ax.fill_between(s, [a - b for a, b in zip(v, d)], [a + b for a, b in zip(v, d)], alpha=0.2)
    ax.set_xlabel("iteration" if entry["stage"] == "grpo" else f"{entry['stage']} step")


def _plot_evals(ax: Any, evals: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import PercentFormatter

    labels = [r["label"] for r in evals]
    rates = [r["success_rate"] for r in evals]
    # Clamped at 0: at 0% or 100% the interval's rounding can put its end a hair inside the rate.
    errors = [[max(0.0, r["success_rate"] - r["ci_low"]) for r in evals],
              [max(0.0, r["ci_high"] - r["success_rate"]) for r in evals]]
    colours = [f"C{i % 10}" for i in range(len(evals))]
    ax.bar(range(len(evals)), rates, yerr=errors, capsize=5, color=colours, alpha=0.85)
    # The rate goes under the label: inside the bar it would collide with the error bar.
    ticks = [f"{label}\n{rate:.1%}" for label, rate in zip(labels, rates)]
    ax.set_xticks(range(len(evals)), ticks, rotation=20 if len(evals) > 3 else 0)
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title("Eval success (95% CI)")
    ax.grid(alpha=0.3, axis="y")


# --- runs episodes -------------------------------------------------------------


def select_episodes(
    rundb: RunDB,
    run: str,
    *,
    order: str = "id",
    iteration: int | None = None,
    stage: str | None = None,
    limit: int = 5,
    label_set: str | None = None,
) -> list[dict[str, Any]]:
    """Episodes with their reward components; order is id, best or worst (by the label set's total).

    Without --label-set, the label set that labelled most of the chosen episodes is used.
    """
    rundb.require_run(run)
    where, params = ["e.run = ?"], [run]
    if stage is not None:
        where.append("e.stage = ?")
        params.append(stage)
    if iteration is not None:
        where.append("e.iteration = ?")
        params.append(iteration)
    condition = " and ".join(where)
    if not rundb.db.execute(f"select 1 from episodes e where {condition} limit 1", params).fetchone():
        raise UsageError(_no_episodes(rundb, run, stage, iteration))

    label_sets = [
        name for name, _ in rundb.db.execute(
            f"select r.label_set, count(*) from rewards r join episodes e on e.id = r.episode_id "
            f"where {condition} and r.component = 'total' group by r.label_set order by count(*) desc, r.label_set",
            params,
        ).fetchall()
    ]
    if label_set is not None and label_set not in label_sets:
        known = ", ".join(label_sets) or "none"
        raise UsageError(f"No rewards under label set {label_set!r} for these episodes of run {run!r}; label sets: {known}.")
    label_set = label_set or (label_sets[0] if label_sets else None)

    # Episodes without a total (failed or unlabelled) come last whichever way the order goes.
    order_by = {
        "id": "e.id",
        "best": "total is null, total desc, e.id",
        "worst": "total is null, total asc, e.id",
    }[order]
    rows = list(rundb.db.query(
        f"select e.*, r.value as total from episodes e left join rewards r "
        f"on r.episode_id = e.id and r.label_set = ? and r.component = 'total' "
        f"where {condition} order by {order_by} limit ?",
        [label_set, *params, limit],
    ))
    components: dict[int, dict[str, dict[str, Any]]] = {row["id"]: {} for row in rows}
    if rows and label_set is not None:
        marks = ", ".join("?" * len(rows))
        for r in rundb.db.query(
            f"select * from rewards where label_set = ? and episode_id in ({marks}) order by id",
            [label_set, *components],
        ):
            components[r["episode_id"]][r["component"]] = {"value": r["value"], "weight": r["weight"], "error": r["error"]}
    episodes = []
    for row in rows:
        total = row.pop("total")
        episodes.append({
            **row,
            "task": json.loads(row["task"] or "{}"),
            "messages": json.loads(row["messages"] or "[]"),
            "label_set": label_set,
            "reward": total,
            "rewards": components[row["id"]],
        })
    return episodes


def _no_episodes(rundb: RunDB, run: str, stage: str | None, iteration: int | None) -> str:
    stages = [s for (s,) in rundb.db.execute(
        "select stage from episodes where run = ? group by stage order by min(id)", [run]).fetchall()]
    if not stages:
        return f"Run {run!r} has no episodes yet; run `rlcli rollout` or `rlcli train grpo` first."
    asked = [f"stage {stage!r}"] if stage else []
    if iteration is not None:
        asked.append(f"iteration {iteration}")
    return f"Run {run!r} has no episodes for {' and '.join(asked)}; stages with episodes: {', '.join(stages)}."


ROLE_STYLES = {"system": "dim", "user": "cyan", "assistant": "green", "tool": "magenta"}


def print_episodes(console: Console, episodes: list[dict[str, Any]]) -> None:
    for ep in episodes:
        console.print(episode_panel(ep))


def episode_panel(ep: dict[str, Any]) -> Panel:
    from rlcli.rewards.core import message_text

    title = f"episode {ep['id']} · {ep['stage']} · task {ep['task_index']} sample {ep['sample_index']}"
    if ep["reward"] is not None:
        title += f" · reward {_fmt(ep['reward'])}"
    facts = Text(
        f"status {ep['status']} · end {ep['end_reason'] or '–'} · success {'yes' if ep['success'] else 'no'} · "
        f"return {_fmt(ep['env_return'])} · turns {ep['num_turns']} · tokens {ep['num_tokens']} · policy {ep['policy']}"
    )
    parts: list[Any] = [facts]
    if ep["error"]:
        parts.append(Text(f"error: {ep['error']}", style="bold red"))
    if ep["rewards"]:
        # A note column only when some value is a fallback (e.g. a judge reply without a score).
        notes = any(r["error"] for r in ep["rewards"].values())
        rewards = Table(title=f"rewards ({ep['label_set']})", title_justify="left", show_edge=False)
        for col in ("component", "value", "weight", *(["note"] if notes else [])):
            rewards.add_column(col, justify="right" if col in ("value", "weight") else "left")
        for component, r in ep["rewards"].items():
            note = [Text(r["error"] or "", style="yellow")] if notes else []
            rewards.add_row(component, _fmt(r["value"]), _fmt(r["weight"]), *note,
                            style="bold" if component == "total" else None)
        parts.append(rewards)
    parts.append(Text(""))
    messages = Table.grid(padding=(0, 1))
    messages.add_column(no_wrap=True)
    messages.add_column()
    for m in ep["messages"]:
        role = m.get("role", "?")
        body = Text(message_text(m))
        if m.get("tool_calls"):
            body.append(("\n" if body else "") + f"tool calls: {json.dumps(m['tool_calls'])}", style="italic")
        messages.add_row(Text(role, style=f"bold {ROLE_STYLES.get(role, '')}"), body)
    parts.append(messages)
    border = "red" if ep["status"] == "failed" else "green" if ep["success"] else "blue"
    return Panel(Group(*parts), title=title, title_align="left", border_style=border)


# --- runs export -----------------------------------------------------------------

# The int32 / float32 blobs that rollout.pack_ids / pack_floats write; exported as plain lists.
LIST_COLUMNS = {"prompt_ids": "int32", "completion_ids": "int32", "logprobs": "float32"}
SQL_TYPES = {"INTEGER": "int64", "FLOAT": "float64", "REAL": "float64", "TEXT": "string"}
# Each table's rows for one run, in a stable order.
EXPORT_QUERIES = {
    "episodes": "select * from episodes where run = ? order by id",
    "turns": "select t.* from turns t join episodes e on e.id = t.episode_id where e.run = ? "
    "order by t.episode_id, t.turn_index",
    "rewards": "select r.* from rewards r join episodes e on e.id = r.episode_id where e.run = ? order by r.id",
    "metrics": "select * from metrics where run = ? order by stage, step, key",
    "evals": "select * from evals where run = ? order by id",
}
CHUNK_ROWS = 1000


def export_run(rundb: RunDB, name: str, fmt: str, out: Path) -> dict[str, int]:
    """Write a run's tables to `out` as <table>.jsonl or <table>.parquet, plus run.json; return row counts.

    One file per table, as in the database (turns join episodes on episode_id): token ids and
    logprobs become lists, and columns holding JSON text (messages, task, info, details) stay text.
    """
    from rlcli.engine.rollout import unpack_floats, unpack_ids

    run = rundb.require_run(name)
    if out.exists() and not out.is_dir():
        raise UsageError(f"Cannot export into {out}: it is a file; give --out a folder.")
    out.mkdir(parents=True, exist_ok=True)
    decoders = {column: unpack_ids if dtype == "int32" else unpack_floats for column, dtype in LIST_COLUMNS.items()}

    def decoded(rows: Iterable[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for row in rows:
            yield {k: decoders[k](v) if k in decoders else v for k, v in row.items()}

    counts = {}
    for table, sql in EXPORT_QUERIES.items():
        rows = decoded(rundb.db.query(sql, [name]))
        path = out / f"{table}.{fmt}"
        columns = {c.name: c.type.upper() for c in rundb.db[table].columns}
        counts[table] = _write_jsonl(path, rows) if fmt == "jsonl" else _write_parquet(path, rows, columns)
    details = run_details(rundb, name)
    details["recipe"] = json.loads(run["recipe"])
    (out / "run.json").write_text(json.dumps(details, indent=2))
    return counts


def _write_jsonl(path: Path, rows: Iterable[dict[str, Any]]) -> int:
    count = 0
    with path.open("w") as fh:
        for row in rows:
            fh.write(json.dumps(row) + "\n")
            count += 1
    return count


def _write_parquet(path: Path, rows: Iterable[dict[str, Any]], columns: dict[str, str]) -> int:
    import datasets

    datasets.disable_progress_bars()  # else to_parquet draws a bar on stderr for every table
    # Explicit features from the SQLite schema: a chunk whose column is all NULL must not turn
    # that column's type into null, and an empty table still gets its columns.
    features = datasets.Features({
        name: datasets.Sequence(datasets.Value(LIST_COLUMNS[name])) if name in LIST_COLUMNS
        else datasets.Value(SQL_TYPES[sql_type])
        for name, sql_type in columns.items()
    })
    # Chunks bound the Python objects alive at once; Arrow holds the rows compactly.
    parts = []
    iterator = iter(rows)
    while chunk := list(itertools.islice(iterator, CHUNK_ROWS)):
        parts.append(datasets.Dataset.from_dict({k: [r[k] for r in chunk] for k in features}, features=features))
    dataset = (
        datasets.concatenate_datasets(parts) if parts
        else datasets.Dataset.from_dict({k: [] for k in features}, features=features)
    )
    dataset.to_parquet(str(path))
    return len(dataset)


# --- shared --------------------------------------------------------------------


def sparkline(values: list[float], width: int | None = None) -> str:
    """Block characters scaled between the min and max; longer series are averaged into `width`.

    NaN and infinite values are left out rather than flattening the rest of the curve.
    """
    bars = "▁▂▃▄▅▆▇█"
    values = [v for v in values if v is not None and math.isfinite(v)]
    if not values:
        return ""
    if width and len(values) > width:
        n = len(values)
        buckets = [values[i * n // width : (i + 1) * n // width] for i in range(width)]
        values = [sum(b) / len(b) for b in buckets]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(bars[int((v - lo) / span * (len(bars) - 1))] for v in values)


def _duration(started: str | None, finished: str | None) -> float | None:
    if not started or not finished:
        return None
    return round((dt.datetime.fromisoformat(finished) - dt.datetime.fromisoformat(started)).total_seconds(), 3)


def _fmt_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)
