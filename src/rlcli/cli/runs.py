"""`rlcli runs ...`: views of the run database (tables, JSON, plots, exports) and resume."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rlcli.cli.common import (
    JsonOpt,
    console,
    err_console,
    open_existing,
    open_recorded_run,
    run_every_stage,
    shared,
    show_curves,
    stage_run,
)
from rlcli.cli.export import DryRunOpt, PrivateOpt, PushJsonOpt, PushOpt, check_push_options, finish_push
from rlcli.errors import RlcliError, UsageError

if TYPE_CHECKING:
    from rlcli.store.run_store import RunStore

app = typer.Typer(help="Inspect runs recorded in the run database.", no_args_is_help=True)

RunArg = Annotated[str, typer.Argument(help="Run name (`rlcli runs list` shows them).", show_default=False)]


class ExportFormat(str, Enum):
    jsonl = "jsonl"
    parquet = "parquet"


@app.command("list")
def runs_list(cli_ctx: typer.Context, as_json: JsonOpt = False) -> None:
    """List runs with status, creation time and latest key metrics.

    Examples:
      rlcli runs list
      rlcli --runs-dir elsewhere/runs runs list --json
    """
    from rlcli.report import tables, views
    from rlcli.store.db import DB_NAME, RunDB, check_runs_folder, default_runs_dir

    runs_dir = check_runs_folder(shared(cli_ctx).runs_dir or default_runs_dir())
    rows = []
    if (runs_dir / DB_NAME).exists():  # else no runs yet, and listing them creates nothing
        rundb = RunDB.open(runs_dir, read_only=True)
        try:
            rows = views.runs_summary(rundb)
        finally:
            rundb.close()
    if as_json:
        print(json.dumps(rows, indent=2))
    elif not rows:  # a hint, not a result: stderr, and stdout stays empty
        err_console.print(
            f"No runs in {runs_dir} yet. Start one with: rlcli run -r recipes/quickstart.yaml",
            highlight=False,
            markup=False,
        )
    else:
        console.print(tables.runs_table(rows))


@app.command("show")
def runs_show(cli_ctx: typer.Context, run: RunArg, as_json: JsonOpt = False) -> None:
    """Show a run: stages with durations, reward and success curves, latest metrics, checkpoints, evals.

    Examples:
      rlcli runs show quickstart
      rlcli runs show quickstart --json
    """
    from rlcli.report import tables, views

    store = open_recorded_run(cli_ctx, run)
    try:
        data = views.run_details(store)
        series = views.metric_series(store)
    finally:
        store.rundb.close()
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        tables.print_run(console, data, series)


@app.command("compare")
def runs_compare(
    cli_ctx: typer.Context,
    runs: Annotated[list[str], typer.Argument(help="Run names to put side by side.", show_default=False)],
    as_json: JsonOpt = False,
) -> None:
    """Runs side by side: status, latest key metrics, best eval success per checkpoint, reward curve."""
    from rlcli.report import tables, views

    rundb = open_existing(cli_ctx, "Nothing to compare")
    try:
        rows = views.compare_runs(rundb, list(dict.fromkeys(runs)))
    finally:
        rundb.close()
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        console.print(tables.compare_table(rows))


@app.command("plot")
def runs_plot(
    cli_ctx: typer.Context,
    runs: Annotated[
        list[str],
        typer.Argument(help="Run name; give two or more to overlay their curves, a colour a run.", show_default=False),
    ],
    metric: Annotated[
        list[str] | None,
        typer.Option(
            "--metric", "-m", help="Plot this metric key instead of the default panels; repeatable.", show_default=False
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Image file to write: .png, .pdf or .svg (default: <runs-dir>/<run>/metrics.png, or with more runs "
            "<runs-dir>/<first run>/vs-<run>.png; replaced each time).",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the --out file if it exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Plot reward, success, loss, KL and entropy curves and eval success (95% CI) to an image.

    Prints the file written; with --json, an object with "run", "files" (a list of the paths written),
    "series" (each curve drawn: stage, steps, values) and "evals" (each bar: label, rate, interval); with
    more runs, "runs" holds one such "run", "series" and "evals" per run."""
    from rlcli.export_folder import check_file_target
    from rlcli.report import plot
    from rlcli.store.run_store import RunStore

    names = list(dict.fromkeys(runs))
    if out is not None:
        check_file_target(out, "--out", overwrite)  # before reading the database
    rundb = open_existing(cli_ctx, f"No run named {names[0]!r}")
    try:
        # The default file lives in the first run's folder, where rlcli owns it: it is replaced unasked.
        default = "metrics.png" if len(names) == 1 else "-".join(f"vs-{name}" for name in names[1:]) + ".png"
        path = out or rundb.path.parent / names[0] / default
        drawn = plot.plot_run([RunStore(rundb, name) for name in names], path, metric, overwrite or out is None)
    finally:
        rundb.close()
    if not as_json:
        print(path)
    elif len(drawn) == 1:
        print(json.dumps({"run": names[0], "files": [str(path)], **drawn[0]}, indent=2))
    else:
        print(json.dumps({"runs": drawn, "files": [str(path)]}, indent=2))


def complete_stage(ctx: typer.Context, incomplete: str) -> list[str]:
    """--stage's tab completion: the stages with episodes of the run named before it, and the short names
    they begin (eval, eval/base, rollout). Nothing, never an error, when there is no such run or database."""
    import sqlite3

    from rlcli.store.db import DB_NAME, RunDB, default_runs_dir
    from rlcli.store.episodes import episode_stages_newest_first
    from rlcli.store.run_store import RunStore

    # Completing an option's value, click stops parsing at that option, before it assigns the positional
    # arguments: the words it has not assigned are in ctx.args, the run's name first.
    run = ctx.params.get("run") or next(iter(ctx.args), None)
    # Completion parses without running the app's callback: --runs-dir (or RLCLI_HOME) is in the root's params.
    runs_dir = ctx.find_root().params.get("runs_dir") or default_runs_dir()
    if not run or not (Path(runs_dir) / DB_NAME).is_file():
        return []
    try:
        rundb = RunDB.open(runs_dir, read_only=True)
    except (RlcliError, sqlite3.Error):
        return []
    try:
        stages = episode_stages_newest_first(RunStore(rundb, run))
    finally:
        rundb.close()
    names = {name[:i] for name in stages for i, char in enumerate(name) if char in "/@" and i} | set(stages)
    return sorted(name for name in names if name.startswith(incomplete))


def _chosen_stage(store: RunStore, stage: str | None) -> str | None:
    """--stage as given, or the stage its prefix names (said on stderr: stdout stays the episodes or JSON)."""
    from rlcli.store.episodes import choose_episode_stage

    if stage is None:
        return None
    choice = choose_episode_stage(store, stage)
    if choice.stage != stage:
        err_console.print(
            f"--stage {stage} is {choice.stage}"
            + (f", the newest of {len(choice.matches)}." if len(choice.matches) > 1 else "."),
            highlight=False,
            markup=False,
        )
    return choice.stage


@app.command("episodes")
def runs_episodes(
    cli_ctx: typer.Context,
    run: RunArg,
    best: Annotated[
        bool, typer.Option("--best", help="Highest total reward (else return) first, then the newest.")
    ] = False,
    worst: Annotated[
        bool, typer.Option("--worst", help="Lowest total reward (else return) first, then the newest.")
    ] = False,
    iteration: Annotated[
        int | None, typer.Option("--iteration", help="Only episodes of this training iteration.", show_default=False)
    ] = None,
    stage: Annotated[
        str | None,
        typer.Option(
            "--stage",
            help="Only episodes of this stage (rollout/3, eval/base@t0.8-k1), or of the newest stage whose name it "
            "begins (eval, rollout, eval/base); tab completes.",
            show_default=False,
            autocompletion=complete_stage,
        ),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="How many episodes to show.")] = 5,
    label_set: Annotated[
        str | None,
        typer.Option(
            "--label-set",
            help="Reward label set to show and sort by (default: the one covering most episodes).",
            show_default=False,
        ),
    ] = None,
    as_json: JsonOpt = False,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="Write the episodes to this HTML page instead, screenshots inline and clicks marked on them.",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the --html file if it exists.")] = False,
) -> None:
    """Read episodes, the newest first: messages by role (images as \\[image <sha256> WxH]), reward
    components, end reason, and the error of failed ones. Without --stage, the policy's episodes (the
    expert's demonstrations only in a run that has no others)."""
    from rlcli.report import tables, views

    if best and worst:
        raise UsageError("--best and --worst exclude each other; give one of them.")
    if html is not None and as_json:
        raise UsageError("--html and --json exclude each other; give one of them.")
    if html is not None:
        from rlcli.export_folder import check_file_target

        check_file_target(html, "--html", overwrite)  # before reading the database
    store = open_recorded_run(cli_ctx, run)
    try:
        stage = _chosen_stage(store, stage)
        episodes = views.select_episodes(
            store,
            order="best" if best else "worst" if worst else "newest",
            iteration=iteration,
            stage=stage,
            limit=limit,
            label_set=label_set,
        )
        pngs = views.episode_pngs(store.rundb, episodes) if html is not None else {}
    finally:
        store.rundb.close()
    if html is not None:
        from rlcli.export_folder import write_file
        from rlcli.report.html import episodes_page

        write_file(html, episodes_page(run, episodes, pngs).encode(), "--html", overwrite)
        print(html)
    elif as_json:
        print(json.dumps(episodes, indent=2))
    else:
        tables.print_episodes(console, episodes)


@app.command("report")
def runs_report(
    cli_ctx: typer.Context,
    run: RunArg,
    html: Annotated[
        Path | None,
        typer.Option(
            "--html",
            help="HTML file to write (default: <runs-dir>/<run>/report.html, replaced each time).",
            show_default=False,
        ),
    ] = None,
    episodes: Annotated[
        int, typer.Option("--episodes", "-n", min=0, help="How many of the best and of the worst episodes to show.")
    ] = 3,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace the --html file if it exists.")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Write one self-contained HTML page about a run, to send: recipe and versions, curves, evals
    (95% CI) and warnings, the best and worst episodes, task difficulty.

    Prints the file written; with --json, an object with "run", "files", the ids of the episodes shown
    and how many evals, warnings and tasks the page holds."""
    from rlcli.export_folder import check_file_target, write_file
    from rlcli.report.page import report_page

    if html is not None:
        check_file_target(html, "--html", overwrite)  # before reading the database
    store = open_recorded_run(cli_ctx, run)
    try:
        # The default file lives in the run's folder, where rlcli owns it: it is replaced unasked.
        path = html or store.rundb.path.parent / run / "report.html"
        page, contents = report_page(store, episodes)
    finally:
        store.rundb.close()
    write_file(path, page.encode(), "--html", overwrite or html is None)
    shown = len(contents["episodes"]["best"]) + len(contents["episodes"]["worst"])
    counts = [
        (contents["evals"], "eval"),
        (contents["warnings"], "warning"),
        (contents["tasks"], "task"),
        (shown, "episode"),
    ]
    err_console.print(
        f"Report of {run}: "
        + ", ".join(f"{n} {word}{'' if n == 1 else 's'}" for n, word in counts)
        + f", {len(page) // 1024} KiB.",
        highlight=False,
        markup=False,
    )
    print(json.dumps({"run": run, "files": [str(path)], **contents}, indent=2) if as_json else path)


@app.command("tasks")
def runs_tasks(
    cli_ctx: typer.Context,
    run: RunArg,
    limit: Annotated[
        int, typer.Option("--limit", "-n", min=0, help="Rows of the table, by task index; 0 shows every task.")
    ] = 30,
    as_json: JsonOpt = False,
) -> None:
    """Training tasks by difficulty: attempts, success rate, mean reward and last iteration of each, and a histogram."""
    from rlcli.engine.labelling import GRPO_LABEL_SET
    from rlcli.report.tasks import print_tasks, tasks_view

    store = open_recorded_run(cli_ctx, run)
    try:
        view = tasks_view(store, GRPO_LABEL_SET)
    finally:
        store.rundb.close()
    if as_json:
        print(json.dumps(view, indent=2))
    else:
        print_tasks(console, view, limit)


@app.command("export")
def runs_export(
    cli_ctx: typer.Context,
    run: RunArg,
    fmt: Annotated[
        ExportFormat | None,
        typer.Option(
            "--format",
            "-f",
            help="File format of the tables (default: jsonl; parquet with --push-to-hub).",
            show_default=False,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Folder to write into (default: <runs-dir>/<run>/export; with --push-to-hub, <runs-dir>/<run>/hub-dataset, "
            "replaced each time).",
            show_default=False,
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an earlier export in that folder.")] = False,
    push_to_hub: PushOpt = None,
    private: PrivateOpt = False,
    dry_run: DryRunOpt = False,
    as_json: PushJsonOpt = False,
) -> None:
    """Export episodes, turns (token ids as lists), rewards, metrics and evals, plus run.json; with
    --push-to-hub, add a dataset card (one config per table) and upload the folder as a hub dataset.

    Prints the folder written, or with --push-to-hub (and no --dry-run) the dataset's URL."""
    from rich.table import Table

    from rlcli.report import export, hub

    check_push_options(push_to_hub, private, dry_run)
    suffix = (fmt or (ExportFormat.parquet if push_to_hub else ExportFormat.jsonl)).value
    store = open_recorded_run(cli_ctx, run)
    try:
        folder = out or store.rundb.path.parent / run / ("hub-dataset" if push_to_hub else "export")
        repo = push_to_hub
        card = (lambda counts: hub.dataset_card_files(store, repo, suffix, counts)) if repo else None
        counts = export.export_run(store, suffix, folder, overwrite or bool(repo and out is None), card)
        no_license = store.recipe().run.license is None
    finally:
        store.rundb.close()
    table = Table(title=f"Exported {run}")
    table.add_column("file")
    table.add_column("rows", justify="right")
    for name, count in counts.items():
        table.add_row(f"{name}.{suffix}", str(count))
    table.add_row("run.json", "")
    err_console.print(table)
    finish_push(folder, repo, "dataset", private, dry_run, as_json, run, no_license, counts)


@app.command("delete")
def runs_delete(
    cli_ctx: typer.Context,
    run: RunArg,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking for confirmation.")] = False,
) -> None:
    """Delete a run: its rows in every table of the run database, then its folder (checkpoints, exports)."""
    import shutil

    from rlcli.store.db import check_run_name
    from rlcli.store.run_folders import check_deletable
    from rlcli.store.stages import RunLock

    check_run_name(run)
    rundb = open_existing(cli_ctx, f"No run named {run!r}", writes=True)
    try:
        rundb.require_run(run)
        folder = rundb.path.parent / run
        check_deletable(folder, run)  # rlcli deletes only a folder it made: before asking, and before any row goes
        if not yes:
            typer.confirm(f"Delete run {run!r}: its rows in {rundb.path} and its folder {folder}?", abort=True)
        # The lock keeps a process working on the run from losing its rows halfway.
        with RunLock(rundb.path.parent, run):
            rundb.delete_run(run)
            # The rows first: a folder left behind by a failure here is harmless, rows pointing at
            # deleted checkpoints are not.
            shutil.rmtree(folder)
    finally:
        rundb.close()
    err_console.print(f"Deleted run {run!r} and {folder}.", highlight=False)


@app.command("resume")
def runs_resume(cli_ctx: typer.Context, run: RunArg) -> None:
    """Continue a recorded run with its stored recipe (every stage of it)."""
    with stage_run(cli_ctx, None, run, [], force=False) as ctx:
        curves = run_every_stage(ctx)  # results on stdout, as `rlcli run` prints them, and the curves
    show_curves(curves)
