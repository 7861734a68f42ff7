"""`rlcli runs ...`: views of the run database (tables, JSON, resume)."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from rlcli.cli_common import DebugOpt, JsonOpt, RunsDirOpt, console, open_existing, open_run, tracked

app = typer.Typer(help="Inspect runs recorded in the run database.", no_args_is_help=True)

# --- runs --------------------------------------------------------------------


@app.command("list")
def runs_list(runs_dir: RunsDirOpt = None, as_json: JsonOpt = False, debug: DebugOpt = False) -> None:
    """List runs with status, creation time and latest key metrics."""
    from rlcli import report
    from rlcli.rundb import RunDB

    rundb = RunDB.open(runs_dir)
    try:
        rows = report.runs_summary(rundb)
    finally:
        rundb.close()
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        console.print(report.runs_table(rows))


@app.command("show")
def runs_show(
    run: Annotated[str, typer.Argument(help="Run name.")],
    runs_dir: RunsDirOpt = None,
    as_json: JsonOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Show a run: stages, timings, latest metrics, checkpoints and evals."""
    from rlcli import report

    rundb = open_existing(runs_dir, f"No run named {run!r}")
    try:
        data = report.run_details(rundb, run)
    finally:
        rundb.close()
    if as_json:
        print(json.dumps(data, indent=2))
    else:
        report.print_run(console, data)


@app.command("resume")
def runs_resume(
    run: Annotated[str, typer.Argument(help="Run name.")],
    runs_dir: RunsDirOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Continue a recorded run with its stored recipe (every stage of it)."""
    with open_run(None, run, runs_dir, []) as ctx, tracked(ctx):
        from rlcli.pipeline import run_all

        run_all(ctx)
