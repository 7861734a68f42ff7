"""The `rlcli` command line: the app, its shared options, the command groups, and error handling.

Heavy libraries (torch, transformers) are imported inside the commands that need them, never when
a command module is imported, so that `rlcli --help` and `rlcli recipes validate` start fast.
"""

from __future__ import annotations

import os
import sqlite3
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

import rlcli.cli.helpfmt  # noqa: F401  (imported for its effect: help in click's conventions)
from rlcli.cli import envs, export, models, recipes, runs, serve, stages
from rlcli.cli.common import SharedOptions, console, print_error, shared
from rlcli.errors import RlcliError, UsageError

app = typer.Typer(
    name="rlcli",
    help="Reinforcement-learning experiments on language-model agents, from the terminal.\n\n"
    "Each stage is resumable and recorded in a SQLite run database (<runs-dir>/rlcli.db).",
    no_args_is_help=True,
    add_completion=True,  # rlcli --install-completion: tab completes commands, options and run stages
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
app.add_typer(stages.app)
app.add_typer(export.app)
app.add_typer(serve.app)
app.add_typer(runs.app, name="runs")
app.add_typer(envs.app, name="envs")
app.add_typer(models.app, name="models")
app.add_typer(recipes.app, name="recipes")


def print_version(value: bool) -> None:
    if value:
        from rlcli import __version__

        console.print(f"rlcli {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def shared_options(
    cli_ctx: typer.Context,
    runs_dir: Annotated[
        str | None,  # not Path: Path("") is the working directory, and an empty --runs-dir is refused
        typer.Option(
            "--runs-dir",
            envvar="RLCLI_HOME",
            metavar="PATH",
            help="Folder of the run database and run outputs (default: ./runs).",
        ),
    ] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show full tracebacks on errors.")] = False,
    version: Annotated[
        bool,
        typer.Option("--version", callback=print_version, is_eager=True, help="Print rlcli's version and exit."),
    ] = False,
) -> None:
    options = shared(cli_ctx)
    if runs_dir == "":  # an unset variable ("$RUNS"): the working directory would become the runs folder
        raise UsageError("--runs-dir is empty; expected a folder (leave the option out for ./runs).")
    options.runs_dir = Path(runs_dir) if runs_dir is not None else None
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


# The errors click says as usage errors (BadParameter, NoSuchOption, MissingParameter, ...): a base class
# of typer.BadParameter, which is click's, or that of the copy of click that typer 0.2x carries.
CLICK_ERROR: type[Any] = next(base for base in typer.BadParameter.__mro__ if base.__name__ == "ClickException")


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    misplaced = misplaced_shared_option(args)
    if misplaced:
        print_error(f"{misplaced} goes before the command, e.g. rlcli {misplaced} ... run -r recipe.yaml.")
        sys.exit(2)
    # main() reads the options back after the app has finished, to decide how to report an error.
    options = SharedOptions(debug=bool(os.environ.get("RLCLI_DEBUG")))
    try:
        # Not standalone: click's own usage errors (a bad option value, a missing argument) come here to be
        # said in one sentence, as rlcli's are, where typer would print a usage line and a box.
        status = app(args=args, prog_name="rlcli", obj=options, standalone_mode=False)
    except CLICK_ERROR as exc:
        if type(exc).__name__ != "NoArgsIsHelpError":  # the help it stands for is printed already
            print_error(usage_sentence(exc))
        sys.exit(exc.exit_code)
    except typer.Abort:  # a confirmation answered no, or stdin closed at a prompt
        print_error("aborted.")
        sys.exit(1)
    except RlcliError as exc:
        if options.debug:
            raise
        print_error(str(exc))
        sys.exit(exc.exit_code)
    except sqlite3.OperationalError as exc:
        if options.debug:
            raise
        hint = " (another process holds it; try again)" if "locked" in str(exc) else ""
        print_error(f"the run database failed: {exc}{hint}.")
        sys.exit(1)
    except Exception as exc:  # a bug: say so in one line unless asked for the traceback
        if options.debug:
            raise
        print_error(f"unexpected {type(exc).__name__}: {exc} (rlcli --debug COMMAND ... shows the traceback).")
        sys.exit(1)
    if status:  # typer.Exit(code), and an interrupt's 130, come back as the status
        sys.exit(status)


def usage_sentence(exc: Any) -> str:
    """click's message on one line, with where the command's options are listed."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    ctx = getattr(exc, "ctx", None)
    return f"{message} (see {ctx.command_path} --help)." if ctx is not None else f"{message}."
