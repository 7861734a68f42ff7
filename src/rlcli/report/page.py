"""`rlcli runs report RUN`: one self-contained HTML page about a run, to send a colleague.

Everything is inline: the CSS, the curves as a base64 PNG, the episodes' screenshots as base64 PNGs.
The page fetches nothing and runs no script, so it opens offline, from a mail or a file share. Each
part comes from what the terminal commands show, not from code of its own: `runs show` (facts,
versions, evals with their intervals, warnings), `runs plot` (the curves), `runs episodes --html`
(the best and the worst episodes), `runs tasks` (task difficulty) and the run's stored recipe.
"""

from __future__ import annotations

import base64
import html
from typing import Any

import yaml

from rlcli.errors import UsageError
from rlcli.redaction import REDACTED, shareable_recipe
from rlcli.report import plot, views
from rlcli.report.html import STYLE as EPISODE_STYLE
from rlcli.report.html import episode_section
from rlcli.report.tables import eval_cells, fmt
from rlcli.report.tasks import tasks_view
from rlcli.store.names import GRPO_LABEL_SET
from rlcli.store.run_store import RunStore

STYLE = """
.part { margin: 0 0 2.5em 0; } .part > h2 { font-size: 1.35em; border-bottom: 1px solid #ccc; padding-bottom: 0.2em; }
nav a { margin-right: 1em; } .muted { color: #666; font-size: 0.9em; }
table.grid { border-collapse: collapse; font-size: 0.92em; margin: 0.5em 0; }
table.grid th, table.grid td { border-bottom: 1px solid #ddd; padding: 3px 10px; text-align: left; vertical-align: top; }
table.grid .num { text-align: right; } table.grid td.warn { color: #9a6700; }
img.curves { max-width: 100%; height: auto; border: 1px solid #ddd; }
pre.recipe { background: #f6f8fa; padding: 1em; overflow-x: auto; font-size: 0.85em; }
.bar { display: inline-block; height: 0.9em; background: #4a6fb5; vertical-align: middle; }
.failed-run { color: #c0392b; }
"""

# (id, title) of the page's parts, in order; a part with nothing to show says so rather than vanishing.
PARTS = (
    ("summary", "Summary"),
    ("evals", "Evaluation (held-out tasks)"),
    ("curves", "Curves"),
    ("warnings", "Warnings"),
    ("tasks", "Task difficulty"),
    ("best", "Best episodes"),
    ("worst", "Worst episodes"),
    ("recipe", "Recipe"),
)


def report_page(store: RunStore, episodes: int = 3) -> tuple[str, dict[str, Any]]:
    """The page, and what it holds as `runs report --json` prints it: the ids of the episodes shown
    ("best", "worst") and how many evals, warnings and tasks."""
    data = views.run_details(store)
    recipe = store.require_run().recipe
    best, worst = _episodes(store, episodes)
    pngs = views.episode_pngs(store.rundb, best + worst)
    tasks = tasks_view(store, GRPO_LABEL_SET)
    bodies = {
        "summary": _summary(data),
        "evals": _evals(data),
        "curves": _curves(store),
        "warnings": _warnings(data["events"]),
        "tasks": _tasks(tasks),
        "best": _episode_list(best, pngs, "highest"),
        "worst": _episode_list(worst, pngs, "lowest"),
        "recipe": _recipe(data, recipe),
    }
    nav = " ".join(f'<a href="#{key}">{_e(title)}</a>' for key, title in PARTS)
    parts = "\n".join(
        f'<div class="part" id="{key}">\n<h2>{_e(title)}</h2>\n{bodies[key]}\n</div>' for key, title in PARTS
    )
    title = f"Run {store.run}: report"
    page = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{_e(title)}</title>'
        f"<style>{EPISODE_STYLE}{STYLE}</style></head>\n<body>\n<h1>{_e(title)}</h1>\n<nav>{nav}</nav>\n"
        f"{parts}\n</body></html>\n"
    )
    contents = {
        "episodes": {"best": [ep["id"] for ep in best], "worst": [ep["id"] for ep in worst]},
        "evals": len(data["evals"]),
        "warnings": len(data["events"]),
        "tasks": tasks["summary"]["tasks"],
    }
    return page, contents


def _summary(data: dict[str, Any]) -> str:
    counts = data["episodes"]
    facts = [
        ("status", data["status"]),
        ("description", data["description"] or "–"),
        ("created", data["created_at"][:19].replace("T", " ")),
        ("recipe", f"{data['recipe_path'] or '–'} (sha256 {data['recipe_sha256'][:12]})"),
        ("seed", data["seed"]),
        ("host", data["hostname"]),
        ("git commit", data["git_sha"] or "–"),
        ("episodes", f"{counts['total']} ({counts['failed']} failed, {counts.get('replayed_lost', 0)} replayed_lost)"),
    ]
    rows = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
    out = [f'<table class="grid">{rows}</table>']
    if data["error"]:
        out.append(f'<p class="failed-run">The last command on this run failed: {_e(data["error"])}</p>')
    # Recorded when the run was created (store/db.py package_versions), not what this machine has now.
    versions = "".join(
        f"<tr><td>{_e(pkg)}</td><td>{_e(version or 'not installed')}</td></tr>"
        for pkg, version in data["versions"].items()
    )
    out.append(
        '<h3>Versions</h3><p class="muted">as installed when the run was created</p>'
        f'<table class="grid" id="versions"><tr><th>package</th><th>version</th></tr>{versions}</table>'
    )
    return "\n".join(out)


def _evals(data: dict[str, Any]) -> str:
    if not data["evals"]:
        return '<p class="muted">No evaluation yet: <code>rlcli eval</code>, or <code>grpo.eval_every</code>.</p>'
    columns, cells = eval_cells(data["evals"])
    numbers = [' class="num"' if c not in ("checkpoint", "vs", "decoding") else "" for c in columns]
    head = "".join(f"<th{n}>{_e(c)}</th>" for c, n in zip(columns, numbers))
    rows = "".join("<tr>" + "".join(f"<td{n}>{_e(c)}</td>" for c, n in zip(row, numbers)) + "</tr>" for row in cells)
    out = [
        f'<table class="grid" id="eval-table"><tr>{head}</tr>{rows}</table>',
        '<p class="muted">Success rate over the episodes that ran, with its 95% Wilson interval; pass@k and the '
        "means as <code>rlcli runs show</code> gives them.</p>",
    ]
    ending = data["ending"]
    lines = []
    for role in ("best", "latest"):
        row = ending[role]
        if row is not None and row["success_rate"] is not None:
            lines.append(
                f"{role}, {views.CHECKPOINT_ROLES[role]}: checkpoint {row['name']} ({row['stage']}, iteration "
                f"{fmt(row['iteration'])}), held-out success {row['success_rate']:.1%} over {row['tasks']} tasks "
                f"({row['decoding']})"
            )
    if lines:
        if ending["keep_best"]:
            lines.append(views.KEEP_BEST_NOTE)
        out.append("<p>" + "<br>".join(_e(line) for line in lines) + "</p>")
    return "\n".join(out)


def _curves(store: RunStore) -> str:
    try:
        fig, drawn, _ = plot.run_figure(store)
    except UsageError as exc:
        return f'<p class="muted">{_e(exc)}</p>'
    png = base64.b64encode(plot.figure_bytes(fig, "png")).decode("ascii")
    keys = ", ".join(drawn) or "none"
    return (
        f'<img class="curves" src="data:image/png;base64,{png}" alt="training curves of {_e(store.run)}: {_e(keys)}">\n'
        '<p class="muted">Reward and train success: faint points per iteration, the line a moving mean; a line '
        "breaks at iterations without a value (no update: every group had equal rewards). Held-out success "
        "(squares) from step -1, the starting point. What <code>rlcli runs plot</code> draws.</p>"
    )


def _warnings(events: list[dict[str, Any]]) -> str:
    if not events:
        return '<p class="muted">None raised while the run trained.</p>'
    rows = "".join(
        f"<tr><td class='num'>{_e(ev['iteration'])}</td><td>{_e(ev['kind'])}</td>"
        f"<td class='warn'>{_e(ev['message'])}</td></tr>"
        for ev in events
    )
    return f'<table class="grid" id="warning-table"><tr><th class="num">iter</th><th>kind</th><th>message</th></tr>{rows}</table>'


def _tasks(view: dict[str, Any]) -> str:
    summary = view["summary"]
    if not view["tasks"]:
        return (
            f'<p class="muted">No labelled training tasks yet (label set {_e(view["label_set"])}): they appear '
            "after a GRPO iteration's label stage.</p>"
        )
    most = max(summary["bins"].values()) or 1
    bins = "".join(
        f'<tr><td>{_e(name)}</td><td class="num">{count}</td>'
        f'<td><span class="bar" style="width:{12 * count / most:.2f}em"></span></td></tr>'
        for name, count in summary["bins"].items()
    )
    hardest = sorted(view["tasks"], key=lambda t: (t["success_rate"], t["reward_mean"], t["task"]))
    rows = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_e(cell)}</td>'
            for cell in (
                t["task"],
                t["attempts"],
                f"{t['success_rate']:.2f}",
                fmt(t["reward_mean"]),
                "–" if t["last_iteration"] is None else t["last_iteration"],
            )
        )
        + "</tr>"
        for t in hardest
    )
    return (
        f"<p>{summary['tasks']} training tasks, {summary['attempts']} episodes, success "
        f"{summary['success_rate']:.2f}, by success rate:</p>"
        f'<table class="grid" id="task-bins"><tr><th>success rate</th><th class="num">tasks</th><th></th></tr>{bins}</table>'
        f"<details><summary>every task, the hardest first ({len(hardest)})</summary>"
        '<table class="grid" id="task-table"><tr><th class="num">task</th><th class="num">attempts</th>'
        '<th class="num">success rate</th><th class="num">mean reward</th><th class="num">last iteration</th></tr>'
        f"{rows}</table></details>"
    )


def _episodes(store: RunStore, n: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The n best and the n worst by total reward (as `runs episodes --best/--worst`), none twice."""
    if n == 0:
        return [], []
    try:
        best = views.select_episodes(store, order="best", limit=n)
        shown = {ep["id"] for ep in best}
        worst = [ep for ep in views.select_episodes(store, order="worst", limit=2 * n) if ep["id"] not in shown]
    except UsageError:  # no episodes yet
        return [], []
    return best, worst[:n]


def _episode_list(episodes: list[dict[str, Any]], pngs: dict[str, bytes], which: str) -> str:
    if not episodes:
        return '<p class="muted">None to show.</p>'
    label_set = episodes[0]["label_set"]
    note = (
        f'<p class="muted">The {which} total rewards (label set {_e(label_set)}), as '
        "<code>rlcli runs episodes --best/--worst</code> orders them.</p>"
    )
    return note + "\n" + "\n".join(episode_section(ep, pngs) for ep in episodes)


def _recipe(data: dict[str, Any], recipe: dict[str, Any]) -> str:
    text = yaml.safe_dump(shareable_recipe(recipe), sort_keys=False, allow_unicode=True)  # the page is sent
    changes = data["recipe_history"][1:]  # the first entry is the recipe the run started with
    history = "".join(f"<li>{_e(h['created_at'][:19])}: {_e(h['reason'])}</li>" for h in changes)
    return (
        f'<p class="muted">The resolved recipe (every default filled in; values that look like secrets read '
        f"{_e(REDACTED)}), sha256 {_e(data['recipe_sha256'])}.</p>"
        + (f"<p>Changed {len(changes)} time(s) since the run started:</p><ul>{history}</ul>" if changes else "")
        + f'<pre class="recipe">{_e(text)}</pre>'
    )


def _e(value: Any) -> str:
    return html.escape(str(value))
