"""What every command shares: consoles, option types, a stage command's run (opened by engine/opening.py)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape

from rlcli.console import err_console, terminal_console, width_for
from rlcli.errors import UsageError, shorten

if TYPE_CHECKING:  # the run machinery is imported when a command opens a run, not when the CLI starts
    from rlcli.engine.context import RunContext
    from rlcli.store.db import RunDB
    from rlcli.store.run_store import RunStore

# results, on stdout; progress and errors go to err_console (stderr)
console = terminal_console(width=width_for(sys.stdout))


def run_every_stage(ctx: RunContext) -> Path | None:
    """`rlcli run` and `rlcli runs resume`: the run's stages, each result on stdout as it is done, then the
    curves where `rlcli runs plot RUN` writes them (the run's folder is rlcli's, so the file is replaced each
    time: a run again after more stages draws them too). Returns that file; None for a run of no stage."""
    from rlcli.engine.pipeline import run_all
    from rlcli.report.plot import plot_run
    from rlcli.report.tables import stage_summary_table
    from rlcli.store.evals import eval_results

    run_all(ctx, on_summary=lambda summary: console.print(stage_summary_table(summary)))
    if not ctx.store.latest_metrics() and not eval_results(ctx.store):
        return None
    curves = ctx.run_dir / "metrics.png"
    plot_run([ctx.store], curves, overwrite=True)
    return curves


def show_curves(curves: Path | None) -> None:
    """Where run_every_stage drew the curves, once the run's command is over."""
    if curves is not None:
        console.print(f"curves: {curves}", soft_wrap=True, highlight=False, markup=False)


# --- shared options ----------------------------------------------------------

RecipeOpt = Annotated[
    Path | None,
    typer.Option(
        "--recipe", "-r", help="Recipe YAML file, or a shipped recipe's name (rlcli recipes list).", show_default=False
    ),
]
RunOpt = Annotated[
    str | None, typer.Option("--run", help="Run name (default: the recipe's run.name).", show_default=False)
]
ForceOpt = Annotated[
    bool, typer.Option("--force", help="Continue an existing run even though its recipe changed in fields that matter.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of tables.")]
Overrides = Annotated[
    list[str] | None,
    typer.Argument(
        help="Recipe overrides as dotted key=value, e.g. grpo.lr=1e-5 rollout.group_size=8.", show_default=False
    ),
]


@dataclass
class SharedOptions:
    """The options given before the command (`rlcli --debug --runs-dir DIR run ...`), set by the app callback."""

    runs_dir: Path | None = None
    debug: bool = False


def print_error(message: str, mark: str = "[red]Error:[/red]") -> None:
    """`Error: message` on stderr, cut to errors.MESSAGE_LIMIT characters and never read as markup (messages
    quote brackets: pip install 'rlcli[envs]'); err_console writes out any control characters in it."""
    err_console.print(f"{mark} {escape(shorten(message))}", highlight=False)


def shared(cli_ctx: typer.Context) -> SharedOptions:
    # A command group invoked on its own (as tests do with CliRunner) has no app callback: the defaults apply.
    return cli_ctx.ensure_object(SharedOptions)


@contextlib.contextmanager
def stage_run(
    cli_ctx: typer.Context,
    recipe_path: Path | None,
    run: str | None,
    overrides: list[str] | None,
    force: bool,
    stages: list[str] | None = None,
) -> Iterator[RunContext]:
    """What a stage command runs in: its run opened under the lock, and a status that follows the command.
    When the command ends, failing or not, what its stages built is freed (engine/memory.py); the vLLM
    engine stays for the rest of the process (an in-process caller's next command reuses it)."""
    from rlcli.engine.memory import release_stage_memory
    from rlcli.engine.opening import open_run, startup_summary, tracked
    from rlcli.engine.threads import set_threads

    with open_run(recipe_path, run, shared(cli_ctx).runs_dir, overrides, force, stages) as ctx, tracked(ctx):
        set_threads(ctx.recipe.run.threads, lambda text: err_console.print(text, highlight=False))
        ctx.summary = lambda: f"{cli_ctx.command_path} · {startup_summary(ctx, stages)}"
        try:
            yield ctx
        except BaseException as exc:
            release_stage_memory(keep_engine=True, failure=exc)
            raise
        release_stage_memory(keep_engine=True)


def open_existing(cli_ctx: typer.Context, missing: str, *, writes: bool = False) -> RunDB:
    """The run database of --runs-dir; a command that reads runs must not create an empty one. A command
    that only reads (writes False) opens it read-only: it works in a runs folder it cannot write."""
    from rlcli.store.db import DB_NAME, RunDB, check_runs_folder, default_runs_dir

    runs_dir = shared(cli_ctx).runs_dir
    path = check_runs_folder(runs_dir or default_runs_dir()) / DB_NAME
    if not path.exists():
        raise UsageError(
            f"{missing}: there is no run database at {path} (use rlcli --runs-dir DIR ..., or set RLCLI_HOME)."
        )
    return RunDB.open(runs_dir, read_only=not writes)


def open_recorded_run(cli_ctx: typer.Context, run: str) -> RunStore:
    """The recorded run named `run` in the run database of --runs-dir, opened read-only; the caller
    closes store.rundb."""
    from rlcli.store.run_store import RunStore

    return RunStore(open_existing(cli_ctx, f"No run named {run!r}"), run)
