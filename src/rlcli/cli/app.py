"""The `rlcli` command line: the app, its shared options, the command groups, and error handling.

Heavy libraries (torch, transformers) are imported inside the commands that need them, never when
a command module is imported, so that `rlcli --help` and `rlcli recipes validate` start fast.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

import rlcli.cli.helpfmt  # noqa: F401  (imported for its effect: help in click's conventions)
from rlcli.cli import envs, export, models, recipes, runs, stages
from rlcli.cli.common import SharedOptions, console, err_console, shared
from rlcli.errors import RlcliError
from rlcli.report.text import printable

app = typer.Typer(
    name="rlcli",
    help="Reinforcement-learning experiments on language-model agents, from the terminal.\n\n"
    "Each stage is resumable and recorded in a SQLite run database (<runs-dir>/rlcli.db).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
app.add_typer(stages.app)
app.add_typer(export.app)
app.add_typer(runs.app, name="runs")
app.add_typer(envs.app, name="envs")
app.add_typer(models.app, name="models")
app.add_typer(recipes.app, name="recipes")


def print_version(value: bool) -> None:
    if value:
        from importlib.metadata import version

        console.print(f"rlcli {version('rlcli')}", highlight=False)
        raise typer.Exit()


@app.callback()
def shared_options(
    cli_ctx: typer.Context,
    runs_dir: Annotated[
        Path | None,
        typer.Option(
            "--runs-dir", envvar="RLCLI_HOME", help="Folder of the run database and run outputs (default: ./runs)."
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=print_version, is_eager=True, help="Print rlcli's version and exit."),
    ] = False,
) -> None:
    options = shared(cli_ctx)
    options.runs_dir = runs_dir
    options.debug = options.debug or debug  # main() may have turned it on from $RLCLI_DEBUG


SHARED_OPTIONS = ("--debug", "--runs-dir")


def misplaced_shared_option(args: list[str]) -> str | None:
    """A shared option given after the command (`rlcli run -r x.yaml --debug`, as rlcli 0.1 took it)."""
    command = next(
        (i for i, arg in enumerate(args) if not arg.startswith("-") and (i == 0 or args[i - 1] != "--runs-dir")), None
    )
    if command is None:
        return None
    return next((arg.split("=")[0] for arg in args[command + 1 :] if arg.split("=")[0] in SHARED_OPTIONS), None)


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    misplaced = misplaced_shared_option(args)
    if misplaced:
        err_console.print(
            f"[red]Error:[/red] {misplaced} goes before the command, e.g. rlcli {misplaced} ... run -r recipe.yaml.",
            highlight=False,
        )
        sys.exit(2)
    # main() reads the options back after the app has finished, to decide how to report an error.
    options = SharedOptions(debug=bool(os.environ.get("RLCLI_DEBUG")))
    try:
        app(args=args, prog_name="rlcli", obj=options)
    except RlcliError as exc:
        if options.debug:
            raise
        # escape: messages quote brackets ("pip install 'rlcli[envs]'") that are not terminal markup;
        # printable: they quote env and model text, which may hold terminal escapes
        err_console.print(f"[red]Error:[/red] {escape(printable(exc))}", highlight=False)
        sys.exit(exc.exit_code)
    except sqlite3.OperationalError as exc:
        if options.debug:
            raise
        hint = " (another process holds it; try again)" if "locked" in str(exc) else ""
        err_console.print(
            f"[red]Error:[/red] the run database failed: {escape(printable(exc))}{hint}.", highlight=False
        )
        sys.exit(1)
    except Exception as exc:  # a bug: say so in one line unless asked for the traceback
        if options.debug:
            raise
        err_console.print(
            f"[red]Error:[/red] unexpected {type(exc).__name__}: {escape(printable(exc))} "
            "(rlcli --debug COMMAND ... shows the traceback).",
            highlight=False,
        )
        sys.exit(1)
