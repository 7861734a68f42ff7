"""Rich tables, panels and sparklines of runs, stages, episodes and stage summaries.

Every function here renders data it is given (records, or the dicts of report/views.py); none
reads the database.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.measure import Measurement
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from rlcli.console import number
from rlcli.report.text import literal, printable, tool_call_note
from rlcli.report.views import (
    CHECKPOINT_ROLES,
    COMPARE_METRICS,
    KEEP_BEST_NOTE,
    OTHER_CHECKPOINTS,
    ending_view,
    eval_view,
)
from rlcli.rewards.episodes import message_text
from rlcli.store.checkpoints import BestAndLatest
from rlcli.store.names import BASE, PolicyRef, stage_family
from rlcli.store.records import EpisodeSummary


def fmt(value: Any, digits: int = 4) -> str:
    """A table cell: floats to `digits` significant digits, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, float):
        return number(value, digits)
    return str(value)


# --- runs list, show, compare ------------------------------------------------------------


def runs_table(rows: list[dict[str, Any]]) -> Table:
    """What each run is and how it did on held-out tasks (views.runs_summary). The last training
    iteration's reward, success and loss are left to --json: beside the run they read as its result."""
    table = Table(title="Runs")
    # At 80 columns every cell used to be cut ("quicks…" for two runs): now the run's name, which every
    # other command takes, and the held-out interval stay whole (a name up to RUN_NAME_WIDTH on one line),
    # each cell holds two things on two lines, the others fold, and nothing ends in an ellipsis.
    cells = [
        (
            f"{literal(row['name'])}\n[dim]{row['status']}[/dim]",
            f"{literal(short_model(row['model']))}\n{literal(row['env'] or '–')}",
            row["stages_done"]["summary"],
            # the interval, and under it the policy it measured: latest (#33)
            f"{held_out_cell(row['held_out'])}\n{literal(row['held_out']['label'])}" if row["held_out"] else "–",
            row["created_at"][5:16].replace("T", "\n"),  # 11-28, 16:26: the year seldom tells runs apart
        )
        for row in rows
    ]
    widest = max((len(row["name"]) for row in rows), default=0)
    table.add_column("run, status", overflow="fold", min_width=min(max(widest, 6), RUN_NAME_WIDTH))
    table.add_column("model, env", overflow="fold")
    table.add_column("stages", overflow="fold", max_width=STAGES_WIDTH)
    table.add_column("held-out", overflow="fold", min_width=len("100% [100–100%]") - 3)
    table.add_column("created", overflow="fold")
    for row_cells in cells:
        table.add_row(*row_cells)
    return table


RUN_NAME_WIDTH = 18
STAGES_WIDTH = 14  # "sft, distill" over "32/32, 8 evals"


def short_model(name: str | None) -> str:
    """A model's name without its hub organisation or folders: SmolLM2-135M-Instruct."""
    return name.rstrip("/").rsplit("/", 1)[-1] if name else "–"


def held_out_cell(held: dict[str, Any] | None, labelled: bool = False) -> str:
    """A held-out success with its 95% interval, 52% [42–62%] (labelled: and the policy, latest (#25));
    a dash when nothing was evaluated."""
    if held is None:
        return "–"
    cell = f"{held['success_rate']:.0%} [{held['ci_low'] * 100:.0f}–{held['ci_high']:.0%}]"
    return f"{cell} {printable(held['label'])}" if labelled else cell


def print_run(console: Console, data: dict[str, Any], series: dict[str, dict[str, Any]] | None = None) -> None:
    """The `runs show` view; `series` (from metric_series) adds a trend column to the metrics."""
    header = Text.assemble((data["name"], "bold"), f"  status: {data['status']}  created: {data['created_at'][:19]}")
    held = data["held_out"]
    header.append(
        f"\nmodel: {printable(short_model(data['model']))}  env: {printable(data['env'] or '–')}  "
        f"stages done: {data['stages_done']['summary']}\nheld-out "
        + (f"{held_out_cell(held, labelled=True)}, {held['tasks']}×{held['k']} {held['decoding']}" if held else "–")
    )
    if data.get("description"):
        header.append(f"\n{printable(data['description'])}", style="italic")
    if data.get("error"):
        header.append(f"\nfailed: {printable(data['error'])}", style="red")
    header.append(
        f"\nrecipe sha256: {data['recipe_sha256'][:12]}  seed: {data['seed']}  host: {data['hostname']}  "
        f"git: {(data['git_sha'] or '–')[:10]}  "
        f"episodes: {data['episodes']['total']} ({data['episodes']['failed']} failed, "
        f"{data['episodes'].get('replayed_lost', 0)} replayed_lost)"
    )
    changes = data["recipe_history"][1:]  # the first entry is the recipe the run started with
    if changes:
        header.append(f"\nrecipe history: {len(changes)} change(s); last: {printable(changes[-1]['reason'])}")
    parts: list[Any] = [header]
    if data["stages"]:
        parts.append(stages_table(data["stages"]))
    curves = (
        ("reward", data["reward_curve"]),
        ("success", data["success_curve"]),
        ("held-out", data["heldout_curve"]),
        ("t-kl", data.get("teacher_kl_curve", [])),  # a distill phase's reverse KL to its teacher
    )
    for title, curve in curves:
        if curve:
            per = "per eval     " if title == "held-out" else "per iteration"
            parts.append(
                Text(
                    f"{title:<8} {per}  {sparkline(curve, 60)}  "
                    f"{fmt(curve[0])} → {fmt(curve[-1])}  (min {fmt(min(curve))}, max {fmt(max(curve))})"
                )
            )
    for teacher in data.get("teachers", []):
        own = ""
        if teacher["success_rate"] is not None:
            own = f"; its held-out {teacher['success_rate']:.2f} on {teacher['tasks']} tasks, {teacher['decoding']}"
        parts.append(Text(f"teacher of {teacher['stage']}: {printable(teacher['teacher'])}{own}"))
    if data["latest_metrics"]:
        parts.append(metrics_table(data["latest_metrics"], series or {}))
    if data["checkpoints"]:
        parts.append(checkpoints_table(data["checkpoints"]))
    if data["evals"]:
        parts.append(evals_table(data["evals"]))
    if data["ending"]["best"] is not None:
        parts.append(best_latest_table(data["ending"]))
    if data.get("ratings"):
        parts.append(ratings_table(data["ratings"]))
    if data.get("events"):
        parts.append(events_table(data["events"]))
    console.print(Group(*parts))


def events_table(events: list[dict[str, Any]]) -> Table:
    """The warnings raised while the run trained (engine/guardrails.py), in order."""
    table = Table(title="Warnings", expand=False, show_lines=True)
    table.add_column("iter", justify="right")
    table.add_column("kind")
    table.add_column("message", style="yellow", overflow="fold")
    for event in events:
        table.add_row(str(event["iteration"]), literal(event["kind"]), literal(event["message"]))
    return table


# The columns of a run's stages recorded on a GPU (engine/context.py) and their figures: torch's
# allocated and reserved peaks (of the GPU where each was largest) and the vLLM engine's share.
GPU_COLUMNS = {"GPU GB": "gpu_mem_peak_gb", "reserved": "gpu_mem_reserved_gb", "vLLM GB": "vllm_mem_gb"}

# A stage row's colour: the first of these statuses among its members.
STATUS_COLOURS = (("failed", "red"), ("stopped", "red"), ("running", "yellow"), ("done", "green"))


def stages_table(stages: list[dict[str, Any]]) -> Table:
    """Stages with durations; numbered stages (rollout/0, rollout/1, ...) fold into one row each."""
    table = Table(title="Stages", expand=False)
    on_gpu = any(s.get("gpu_mem_peak_gb") is not None for s in stages)
    # Only when a stage failed: at a terminal's 80 columns every column counts.
    errors = any(s["error"] for s in stages)
    columns = ("stage", "status", "started", "finished", "duration", *(GPU_COLUMNS if on_gpu else ()))
    for col in (*columns, *(("error",) if errors else ())):
        table.add_column(col, justify="right" if col in ("duration", *GPU_COLUMNS) else "left")
    for name, members in _stage_groups(stages):
        counts = Counter(s["status"] for s in members)
        status = ", ".join(f"{n} {st}" if len(members) > 1 else st for st, n in counts.items())
        style = next((colour for status, colour in STATUS_COLOURS if status in counts), "")
        durations = [s["duration_s"] for s in members if s["duration_s"] is not None]
        failed = next((s for s in members if s["error"]), None)
        error = (
            "" if failed is None else (failed["error"] if len(members) == 1 else f"{failed['name']}: {failed['error']}")
        )
        table.add_row(
            literal(name),
            Text(status, style=style),
            (members[0]["started_at"] or "")[11:19],
            (members[-1]["finished_at"] or "")[11:19],
            _fmt_duration(sum(durations)) if durations else "–",
            *((_largest(members, key) for key in GPU_COLUMNS.values()) if on_gpu else ()),
            *((literal(error[:80], style="red"),) if errors else ()),
        )
    return table


def _largest(members: list[dict[str, Any]], key: str) -> str:
    """The largest of a stage family's figures (a row folds rollout/0..N into one)."""
    values = [s[key] for s in members if s.get(key) is not None]
    return f"{max(values):.2f}" if values else "–"


def _stage_groups(stages: list[dict[str, Any]]) -> list[tuple[str, list[dict[str, Any]]]]:
    # One row per numbered family keeps a 100-iteration run readable; the JSON keeps every stage.
    groups: dict[str, list[dict[str, Any]]] = {}
    for s in stages:
        family = stage_family(s["name"])
        groups.setdefault(family[0] if family else s["name"], []).append(s)
    out = []
    for prefix, members in groups.items():
        if len(members) == 1:
            out.append((members[0]["name"], members))
        else:
            numbers = [family[1] for m in members if (family := stage_family(m["name"]))]
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
            literal(key),
            str(entry["steps"][-1]) if entry else "",
            fmt(value),
            sparkline(entry["values"], 30) if entry and len(entry["values"]) > 1 else "",
        )
    return table


def checkpoints_table(rows: list[dict[str, Any]], shown: int = 10) -> Table:
    hidden = max(0, len(rows) - shown)
    table = Table(title="Checkpoints" + (f" (latest {shown} of {len(rows)})" if hidden else ""))
    for col in ("id", "stage", "iteration", "kind", "created", "path"):
        table.add_column(col)
    for r in rows[hidden:]:
        table.add_row(
            str(r["id"]),
            literal(r["stage"]),
            fmt(r["iteration"]),
            r["kind"] or "",
            (r["created_at"] or "")[:19].replace("T", " "),
            literal(r["path"]),
        )
    return table


# The eval table's columns in the order they give way to a narrow terminal. The checkpoint, whom it
# played, how it sampled, its success with the 95% interval and the failed episodes always stay.
EVAL_COLUMNS_DROPPED_FIRST = ("tokens", "turns", "pass@k", "entropy", "return", "tasks×k")


def evals_table(rows: list[dict[str, Any]]) -> FittedTable:
    """The eval table, as wide as the terminal allows (avg@k is left to --json: with k samples of every
    task it equals the success rate)."""
    columns, cells = eval_cells(rows)

    def build(left_out: list[str]) -> Table:
        table = Table(title="Evaluation (held-out tasks)")
        if left_out:
            table.caption = f"left out at this width: {', '.join(left_out)} (runs show --json has them)"
        kept = [i for i, col in enumerate(columns) if col not in left_out]
        for i in kept:
            # No cell folds or is cut: a column gives way whole instead.
            label = columns[i] in ("checkpoint", "vs", "decoding")
            table.add_column(columns[i], justify="left" if label else "right", no_wrap=True)
        for row in cells:
            table.add_row(*(literal(row[i]) if i == 0 else row[i] for i in kept))
        return table

    return FittedTable(build, [col for col in EVAL_COLUMNS_DROPPED_FIRST if col in columns])


UNBOUNDED = 100_000  # columns: wider than any table


class FittedTable:
    """A table that leaves out columns, in the order given, until it fits the width it is printed at:
    rich would otherwise fold numbers into several lines or cut them ("34%–6…")."""

    def __init__(self, build: Callable[[list[str]], Table], droppable: list[str]) -> None:
        self.build = build  # the table without the columns named
        self.droppable = droppable

    def fitted(self, console: Console, options: ConsoleOptions) -> Table:
        left_out: list[str] = []
        table = self.build(left_out)
        unbounded = options.update_width(UNBOUNDED)  # Measurement.get clamps a measure to the width it is given
        for column in self.droppable:
            if Measurement.get(console, unbounded, table).maximum <= options.max_width:
                break
            left_out.append(column)
            table = self.build(left_out)
        return table

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        yield self.fitted(console, options)

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        return Measurement.get(console, options, self.fitted(console, options))


def games_table(rows: list[dict[str, Any]]) -> Table | None:
    """Two-player games: each checkpoint's win/draw/loss rates with 95% Wilson intervals, per opponent
    and seat (eval details' "games"); None when no eval played one."""
    lines = [(r.get("label") or r["checkpoint"], g) for r in rows for g in r["details"].get("games", [])]
    if not lines:
        return None
    table = Table(title="Games against opponents (held-out; 95% Wilson intervals)")
    for col in ("checkpoint", "opponent", "seat", "games", "win", "draw", "loss", "unfinished"):
        table.add_column(col, justify="left" if col in ("checkpoint", "opponent", "seat") else "right", no_wrap=True)
    for label, g in lines:
        rates = [f"{g[o]:.0%} [{g[o + '_ci_low']:.0%}–{g[o + '_ci_high']:.0%}]" for o in ("win", "draw", "loss")]
        table.add_row(literal(label), g["opponent"], g["seat"], str(g["games"]), *rates, str(g["unfinished"]))
    return table


def ratings_table(ratings: list[dict[str, Any]]) -> Table:
    """Two-player games: Elo ratings of the run's checkpoints and opponents (report/ratings.py)."""
    anchor = "random = 1000" if any(r["player"] == "random" for r in ratings) else "mean 1000"
    table = Table(title=f"Elo from the held-out games ({anchor})")
    for col in ("player", "elo", "games", "wins", "draws", "losses"):
        table.add_column(col, justify="left" if col == "player" else "right", no_wrap=True)
    for r in ratings:
        table.add_row(r["player"], f"{r['elo']:.0f}", *(str(r[k]) for k in ("games", "wins", "draws", "losses")))
    return table


def eval_cells(rows: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The eval table's column names and cells (the first, the checkpoint's label, is the run's text):
    what `runs show` prints and the `runs report` page shows. Success and the means are over the
    episodes that ran; a "failed" column, shown when there are any, counts those the env failed."""
    failed = [r["details"].get("failed_episodes", 0) for r in rows]
    sampled = any(r.get("decoding", "greedy") != "greedy" for r in rows)  # a decoding column only then
    versus = any(r.get("opponent") for r in rows)  # and an opponent column for eval.opponents' stages
    columns = ["checkpoint", *(["vs"] if versus else []), *(["decoding"] if sampled else []), "tasks×k"]
    columns += ["success", "95% CI"]
    entropy = [r["details"].get("entropy") for r in rows]  # sampled evals only (engine/evaluate.py)
    columns += ["return", "pass@k", "turns", "tokens", *(["entropy"] if any(e is not None for e in entropy) else [])]
    columns += ["failed"] if any(failed) else []
    cells = [
        [
            r.get("label") or r["checkpoint"],
            *([r.get("opponent") or "–"] if versus else []),
            *([r.get("decoding", "greedy")] if sampled else []),
            f"{r['tasks']}×{r['k']}",
            f"{r['success_rate']:.1%}",
            f"{r['ci_low']:.0%}–{r['ci_high']:.0%}",
            fmt(r["mean_return"]),
            fmt(r["pass_at_k"]),
            fmt(r["mean_turns"]),
            fmt(r["mean_tokens"]),
            *([fmt(h)] if any(e is not None for e in entropy) else []),
            *([str(n_failed)] if any(failed) else []),
        ]
        for r, n_failed, h in zip(rows, failed, entropy)
    ]
    return columns, cells


def compare_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="Runs side by side")
    table.add_column("", no_wrap=True)
    for row in rows:
        table.add_column(row["name"], justify="right")

    table.add_row("model", *(literal(short_model(r["model"])) for r in rows))
    table.add_row("env", *(literal(r["env"] or "–") for r in rows))
    table.add_row("stages done", *(r["stages_done"]["summary"] for r in rows))
    table.add_row("held-out", *(held_out_cell(r["held_out"], labelled=True) for r in rows))
    # The recipe fields in which the runs differ, in place of their hashes.
    for field in dict.fromkeys(f for r in rows for f in r["recipe_differs"]):
        table.add_row(literal(field), *(_recipe_value(r["recipe_differs"], field) for r in rows))
    table.add_row("status", *(r["status"] for r in rows))
    table.add_row("created", *(r["created_at"][:16].replace("T", " ") for r in rows))
    table.add_row("episodes", *(str(r["episodes"]) for r in rows))
    for key in COMPARE_METRICS:
        if any(key in r["latest_metrics"] for r in rows):
            table.add_row(key, *(fmt(r["latest_metrics"].get(key)) for r in rows))
    labels = dict.fromkeys(label for r in rows for label in r["best_evals"])
    for label in labels:
        table.add_row(literal(f"eval success: {label}"), *(_fmt_eval(r["best_evals"].get(label), label) for r in rows))
    table.add_row("reward curve", *(sparkline(r["reward_curve"], 24) or "–" for r in rows))
    return table


def _recipe_value(fields: dict[str, Any], field: str) -> Text:
    """A recipe value as YAML would say it (1.0, null, [sft, grpo] as JSON); a dash for a field the run's
    rlcli did not have."""
    if field not in fields:
        return literal("–")
    value = fields[field]
    return literal(value if isinstance(value, str) and value else json.dumps(value))


def _fmt_eval(best: dict[str, Any] | None, label: str) -> str:
    if best is None:
        return "–"
    which = f" ckpt {best['checkpoint_id']}" if label == OTHER_CHECKPOINTS else ""
    return f"{best['success_rate']:.1%} [{best['ci_low']:.0%}–{best['ci_high']:.0%}]{which}"


# --- runs episodes ----------------------------------------------------------------------


ROLE_STYLES = {"system": "dim", "user": "cyan", "assistant": "green", "tool": "magenta"}


def print_episodes(console: Console, episodes: list[dict[str, Any]]) -> None:
    for ep in episodes:
        console.print(episode_panel(ep))


def calls_line(calls: list[dict[str, Any]], one_sequence: bool) -> str:
    """An agent program's calls to the endpoint, and how they train: one sequence when each extends the one
    before, else one sequence a call (grpo/batch.py); a call that starts anew says whether it re-tokenises."""
    number = {call["call"]: n for n, call in enumerate(calls, 1)}
    notes = []
    for n, call in enumerate(calls[1:], 2):
        if call["extends"] is None:
            notes.append(
                f"call {n} starts anew" + (" (its messages re-tokenise otherwise)" if call["retokenised"] else "")
            )
        elif call["extends"] != calls[n - 2]["call"]:
            notes.append(f"call {n} extends call {number.get(call['extends'], '?')}")
    trained = "one training sequence" if one_sequence else f"{len(calls)} training sequences, one a call"
    tokens = ", ".join(f"{c['prompt']}+{c['sampled']}" for c in calls)
    return f"endpoint calls {len(calls)} (prompt+sampled tokens: {tokens}) · {trained}" + "".join(
        f" · {x}" for x in notes
    )


def episode_panel(ep: dict[str, Any]) -> Panel:
    title = f"episode {ep['id']} · {printable(ep['stage'])} · task {ep['task_index']} sample {ep['sample_index']}"
    if ep["reward"] is not None:
        title += f" · reward {fmt(ep['reward'])}"
    facts = literal(
        f"status {ep['status']} · end {ep['end_reason'] or '–'} · success {'yes' if ep['success'] else 'no'} · "
        f"return {fmt(ep['env_return'])} · turns {ep['num_turns']} · tokens {ep['num_tokens']} · policy {ep['policy']}"
    )
    parts: list[Any] = [facts]
    if ep.get("calls"):
        parts.append(literal(calls_line(ep["calls"], ep["template_consistent"])))
    if ep.get("parent_episode_id") is not None:  # grpo.branch: the turns before branch_turn replay the parent's
        parts.append(literal(f"branch of episode {ep['parent_episode_id']} from its turn {ep['branch_turn']}"))
    if ep["error"]:
        parts.append(literal(f"error: {ep['error']}", style="bold red"))
    if ep["rewards"]:
        # A note column only when some value is a fallback (e.g. a judge reply without a score).
        notes = any(r["error"] for r in ep["rewards"].values())
        rewards = Table(title=literal(f"rewards ({ep['label_set']})"), title_justify="left", show_edge=False)
        for col in ("component", "value", "weight", *(["note"] if notes else [])):
            rewards.add_column(col, justify="right" if col in ("value", "weight") else "left")
        for component, r in ep["rewards"].items():
            note = [literal(r["error"] or "", style="yellow")] if notes else []
            rewards.add_row(
                literal(component),
                fmt(r["value"]),
                fmt(r["weight"]),
                *note,
                style="bold" if component == "total" else None,
            )
        parts.append(rewards)
    parts.append(Text(""))
    messages = Table.grid(padding=(0, 1))
    messages.add_column(no_wrap=True)
    messages.add_column()
    for m in ep["messages"]:
        role = m.get("role", "?")
        body = message_body(m)
        if m.get("tool_calls"):
            body.append(("\n" if body else "") + f"tool calls: {json.dumps(m['tool_calls'])}", style="italic")
        if call := tool_call_note(m):
            body.append(("\n" if body else "") + printable(call), style="italic")
        messages.add_row(literal(role, style=f"bold {ROLE_STYLES.get(role, '')}"), body)
    parts.append(messages)
    border = "red" if ep["status"] == "failed" else "green" if ep["success"] else "blue"
    return Panel(Group(*parts), title=Text(title), title_align="left", border_style=border)


def message_body(message: dict[str, Any]) -> Text:
    """A message's text, with a marker where each of its images was."""
    content = message.get("content")
    if not isinstance(content, list):
        return literal(message_text(message))
    body, after_image = Text(), False
    for part in content:
        if not isinstance(part, dict):
            continue
        is_image = part.get("type") == "image"
        piece = image_marker(part) if is_image else part.get("text", "")
        # A marker is set apart from the text around it; text parts run on as the template joins them.
        touching = body.plain and piece and not body.plain[-1].isspace() and not piece[0].isspace()
        if touching and (after_image or is_image):
            body.append(" ")
        after_image = is_image
        body.append(printable(piece), style="magenta" if after_image else None)
    return body


def image_marker(part: dict[str, Any]) -> str:
    """[image 3f2a1c… 320x200] for a stored image (its sha256 prefix and size); a text model's run
    stores no image, since the model never read it."""
    if "sha256" not in part:
        return "[image, not stored]"
    size = f" {part['width']}x{part['height']}" if "width" in part else " (missing from the database)"
    return f"[image {part['sha256'][:6]}…{size}]"


# --- stage summaries: what `rlcli rollout / label / sft / eval` print when they finish -----------


def episodes_table(title: str, summary: EpisodeSummary) -> Table:
    """A rollout stage's summary, a row per figure: seven columns of them overflow 80."""
    table = Table(title=literal(f"{title}: episodes"), show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for key, value in asdict(summary).items():
        table.add_row(key, fmt(value, digits=3))
    return table


def labels_table(summaries: list[Any]) -> FittedTable:
    """One row per labelled stage (engine.labelling.LabelSummary): the total's mean, then each component's;
    at a narrow terminal the last components give way first."""
    # A column per mean, headed by what it is the mean of: "total" (LabelSummary's reward_mean), then
    # each component.
    names = {"reward_mean": "total"} if any("reward_mean" in s.means for s in summaries) else {}
    names |= {k: k.removesuffix("_mean") for k in sorted({k for s in summaries for k in s.means} - set(names))}

    def build(left_out: list[str]) -> Table:
        shown = {key: name for key, name in names.items() if name not in left_out}
        table = Table(title="Labels: means per episode")
        if left_out:
            table.caption = f"left out at this width: {', '.join(left_out)} (rlcli runs episodes shows them)"
        for col in ("stage", "label set", "episodes", *shown.values()):
            table.add_column(literal(col), justify="left" if col in ("stage", "label set") else "right", no_wrap=True)
        for s in summaries:
            table.add_row(
                literal(s.stage), literal(s.label_set), str(s.episodes), *(fmt(s.means.get(k), digits=3) for k in shown)
            )
        return table

    return FittedTable(build, list(names.values())[:0:-1])


def sft_table(summary: Any) -> Table:
    """The sft stage's summary (engine.sft.SftSummary)."""
    table = Table(title="sft", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("source", summary.source),
        ("examples (train / eval)", f"{summary.train_examples} / {summary.eval_examples}"),
        ("cut at max_length", summary.truncated),
        ("steps", summary.steps),
        ("resumed from step", summary.resumed_from_step or None),
        ("train loss (mean / final)", f"{fmt(summary.train_loss)} / {fmt(summary.final_loss)}"),
        ("eval loss", fmt(summary.eval_loss)),
        ("held-out entropy (start / end)", _entropies(summary)),
        ("stopped by sft.min_entropy", "yes" if summary.stopped_at_min_entropy else None),
        ("checkpoint", f"sft (id {summary.checkpoint_id}): {summary.path}"),
    ]
    for name, value in rows:
        if value is not None:
            table.add_row(name, literal(value))
    return table


def _entropies(summary: Any) -> str | None:
    """The policy's mean token entropy over the held-out replies before and after SFT, in nats."""
    if summary.eval_entropy is None:
        return None
    return f"{fmt(summary.eval_entropy_before)} / {fmt(summary.eval_entropy)} nats"


def dpo_table(summary: Any) -> Table:
    """A DPO stage's summary (engine.dpo.DpoSummary)."""
    table = Table(title=literal(summary.stage), show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("started from", "base" if PolicyRef.parse(summary.start) == BASE else f"checkpoint {summary.start}"),
        ("preference pairs", summary.pairs),
        ("steps", summary.steps),
        ("resumed from step", summary.resumed_from_step or None),
        ("loss (mean / final)", f"{fmt(summary.train_loss)} / {fmt(summary.final_loss)}"),
        ("reward margin (final)", fmt(summary.final_reward_margin)),
        (
            "checkpoint",
            f"{summary.stage} (id {summary.checkpoint_id}): {summary.path}"
            if summary.checkpoint_id is not None
            else "none: no pairs, the policy is unchanged",
        ),
    ]
    for name, value in rows:
        if value is not None:
            table.add_row(name, literal(value))
    return table


# --- shared ----------------------------------------------------------------------------------


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


def _fmt_duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def stage_summary_table(summary: Any) -> Table | FittedTable:
    """What `rlcli run` prints as a stage finishes: the eval results, the SFT summary, or last the
    run's best and latest checkpoints."""
    if isinstance(summary, list):
        return evals_table([eval_view(r) for r in summary])
    if isinstance(summary, BestAndLatest):
        return best_latest_table(ending_view(summary))
    if hasattr(summary, "pairs"):  # engine.dpo.DpoSummary (not imported: it imports torch)
        return dpo_table(summary)
    return sft_table(summary)


def best_latest_table(ending: dict[str, Any]) -> Table:
    """The run's best checkpoint by held-out success and its newest one (views.ending_view)."""
    table = Table(title="Checkpoints: best and latest")
    for col in ("", "checkpoint", "stage", "iteration", "held-out success"):
        table.add_column(col, justify="right" if col in ("iteration", "held-out success") else "left")
    for role in ("best", "latest"):
        row = ending[role]
        if row is None:
            table.add_row(role, "–", "", "", "not evaluated" if role == "best" else "")
            continue
        success = (
            "–"
            if row["success_rate"] is None
            else f"{row['success_rate']:.1%} ({row['tasks']} tasks, {row['decoding']})"
        )
        table.add_row(
            role,
            literal(row["name"]),
            literal(row["stage"] or ""),
            fmt(row["iteration"]),
            success,
        )
    meanings = "; ".join(f"{role}: {meaning}" for role, meaning in CHECKPOINT_ROLES.items())
    table.caption = meanings + (f". {KEEP_BEST_NOTE}" if ending["keep_best"] else "")
    return table
