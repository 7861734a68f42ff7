"""The `rlcli` command line: parse, load the recipe, open the run database, call a stage.

Heavy libraries (torch, transformers) are imported inside the stage modules, never at import
time here, so that `rlcli --help` and `rlcli recipes validate` start fast.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from rlcli.cli.common import (
    DebugOpt, ForceOpt, JsonOpt, Overrides, RecipeOpt, RunOpt, RunsDirOpt, console, err_console, open_existing,
    open_run, tracked,
)
from rlcli.errors import RlcliError, UsageError

app = typer.Typer(
    name="rlcli",
    help="Reinforcement-learning experiments on language-model agents, from the terminal.\n\n"
    "Each stage is resumable and recorded in a SQLite run database (<runs-dir>/rlcli.db).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
)
train_app = typer.Typer(help="Online training algorithms.", no_args_is_help=True)
recipes_app = typer.Typer(help="Check recipe files.", no_args_is_help=True)
app.add_typer(train_app, name="train")
app.add_typer(recipes_app, name="recipes")


def _mount_optional_apps() -> None:
    # The runs, envs and models command groups live in their own modules (cheap to import).
    for module, name in (("rlcli.cli.runs", "runs"), ("rlcli.cli.envs", "envs"), ("rlcli.cli.models", "models")):
        try:
            sub = __import__(module, fromlist=["app"])
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            continue
        app.add_typer(sub.app, name=name)


_mount_optional_apps()

# --- stage commands ----------------------------------------------------------


@app.command("run")
def run_cmd(
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    runs_dir: RunsDirOpt = None,
    force: ForceOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Run every stage of a recipe (SFT, GRPO, eval), skipping what is already done."""
    with open_run(recipe, run, runs_dir, overrides, force) as ctx, tracked(ctx):
        from rlcli.engine.pipeline import run_all

        run_all(ctx)


@app.command("sft")
def sft_cmd(
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    runs_dir: RunsDirOpt = None,
    force: ForceOpt = False,
    debug: DebugOpt = False,
) -> None:
    """SFT warm-start from a dataset, expert demonstrations, or the run's best episodes."""
    with open_run(recipe, run, runs_dir, overrides, force) as ctx, tracked(ctx):
        from rlcli.engine.sft import run_sft

        run_sft(ctx)


@app.command("rollout")
def rollout_cmd(
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    runs_dir: RunsDirOpt = None,
    policy: Annotated[
        Optional[str], typer.Option(help="base, latest, expert or a checkpoint id (default: rollout.policy).")
    ] = None,
    stage: Annotated[str, typer.Option(help="Stage name the episodes are recorded under.")] = "rollout",
    split: Annotated[str, typer.Option(help="Task split: train or eval.")] = "train",
    force: ForceOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Collect episodes (tasks x group size) with a policy and record them token by token."""
    with open_run(recipe, run, runs_dir, overrides, force) as ctx, tracked(ctx):
        from rlcli.engine.rollout import run_rollout_stage

        run_rollout_stage(ctx, stage=stage, policy=policy or ctx.recipe.rollout.policy, split=split)


@app.command("label")
def label_cmd(
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    runs_dir: RunsDirOpt = None,
    label_set: Annotated[str, typer.Option(help="Name under which these reward components are stored.")] = "default",
    force: ForceOpt = False,
    debug: DebugOpt = False,
) -> None:
    """(Re)label the run's episodes with the recipe's reward functions, without new rollouts."""
    with open_run(recipe, run, runs_dir, overrides, force) as ctx, tracked(ctx):
        from rlcli.engine.labelling import run_label_stage

        run_label_stage(ctx, label_set=label_set)


@train_app.command("grpo")
def train_grpo_cmd(
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    runs_dir: RunsDirOpt = None,
    force: ForceOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Online GRPO: per iteration rollout -> label -> advantages -> update -> checkpoint."""
    with open_run(recipe, run, runs_dir, overrides, force) as ctx, tracked(ctx):
        from rlcli.engine.train import run_grpo

        run_grpo(ctx)


@app.command("eval")
def eval_cmd(
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    runs_dir: RunsDirOpt = None,
    checkpoint: Annotated[
        Optional[list[str]],
        typer.Option("--checkpoint", "-c", help="base, sft, latest or a checkpoint id; repeatable (default: eval.checkpoints)."),
    ] = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
    debug: DebugOpt = False,
) -> None:
    """Evaluate checkpoints on held-out tasks: success rate (95% CI), mean return, pass@k."""
    with open_run(recipe, run, runs_dir, overrides, force) as ctx, tracked(ctx):
        from rlcli.engine.evaluate import run_eval

        rows = run_eval(ctx, checkpoint or ctx.recipe.eval.checkpoints)
    if as_json:
        print(json.dumps(rows, indent=2))


@app.command("export")
def export_cmd(
    run: Annotated[str, typer.Argument(help="Run name.")],
    merge: Annotated[Path, typer.Option("--merge", help="Folder to write the merged full model to.")],
    checkpoint: Annotated[str, typer.Option(help="latest, sft or a checkpoint id.")] = "latest",
    runs_dir: RunsDirOpt = None,
    debug: DebugOpt = False,
) -> None:
    """Write a run's checkpoint merged into its base model, loadable with from_pretrained."""
    from rlcli.models.loading import export_merged

    rundb = open_existing(runs_dir, f"No run named {run!r}")
    try:
        recipe = rundb.run_recipe(run)
        row = rundb.resolve_checkpoint(run, checkpoint)
        if row is None:
            raise UsageError(f"Run {run!r} has no checkpoint to export yet.")
        export_merged(recipe.model, recipe.lora, recipe.quantization, row["path"], merge)
    finally:
        rundb.close()
    err_console.print(f"Merged model written to [bold]{merge}[/bold]")


# --- recipes -------------------------------------------------------------------


@recipes_app.command("validate")
def recipes_validate(
    files: Annotated[list[Path], typer.Argument(help="Recipe YAML files.")],
    debug: DebugOpt = False,
) -> None:
    """Check recipe files against the schema (fast: loads no model)."""
    from rlcli.recipe import load_recipe

    failed = 0
    for path in files:
        try:
            load_recipe(path)
        except UsageError as exc:
            failed += 1
            err_console.print(f"[red]✗[/red] {exc}", highlight=False)
        else:
            console.print(f"[green]✓[/green] {path}", highlight=False)
    if failed:
        raise typer.Exit(2)


# --- entry point ---------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args or bool(os.environ.get("RLCLI_DEBUG"))
    try:
        app(args=args, prog_name="rlcli")
    except RlcliError as exc:
        if debug:
            raise
        # escape: messages quote brackets ("pip install 'rlcli[envs]'") that are not terminal markup
        err_console.print(f"[red]Error:[/red] {escape(str(exc))}", highlight=False)
        sys.exit(exc.exit_code)
    except sqlite3.OperationalError as exc:
        if debug:
            raise
        hint = " (another process holds it; try again)" if "locked" in str(exc) else ""
        err_console.print(f"[red]Error:[/red] the run database failed: {escape(str(exc))}{hint}.", highlight=False)
        sys.exit(1)
    except Exception as exc:  # a bug: say so in one line unless asked for the traceback
        if debug:
            raise
        err_console.print(
            f"[red]Error:[/red] unexpected {type(exc).__name__}: {escape(str(exc))} "
            "(run with --debug for the traceback).",
            highlight=False,
        )
        sys.exit(1)
