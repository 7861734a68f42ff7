"""The stage commands: run, sft, rollout, label, train grpo, train dpo, eval.

Each one opens its run and calls one engine stage; the engine module is imported inside the
command, so that `rlcli --help` never imports torch.
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from rlcli.cli.common import (
    ForceOpt,
    JsonOpt,
    Overrides,
    RecipeOpt,
    RunOpt,
    console,
    err_console,
    run_every_stage,
    show_curves,
    stage_run,
)
from rlcli.errors import UsageError
from rlcli.store.names import DpoStage, try_parse_stage

# A stage's final tables are its results: on stdout (`rlcli run ... > out.txt` keeps them), while
# progress and logs go to stderr (ctx.console). Under --json, stdout holds the JSON alone and the
# tables go to stderr.

app = typer.Typer()
train_app = typer.Typer(help="Online training algorithms.", no_args_is_help=True)
app.add_typer(train_app, name="train")


@app.command("run")
def run_cmd(
    cli_ctx: typer.Context,
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    force: ForceOpt = False,
) -> None:
    """Run every stage of a recipe (SFT, GRPO, eval), skipping what is already done.

    Examples:
      rlcli run -r quickstart  # the shipped quickstart, on CPU
      rlcli run -r my-quickstart.yaml grpo.iterations=8 --run short
      rlcli run --run short  # go on with a recorded run, its recipe as stored
    """
    with stage_run(cli_ctx, recipe, run, overrides, force) as ctx:
        curves = run_every_stage(ctx)
    show_curves(curves)


@app.command("sft")
def sft_cmd(
    cli_ctx: typer.Context,
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    force: ForceOpt = False,
) -> None:
    """SFT warm-start from a dataset, expert demonstrations, or the run's best episodes.

    Examples:
      rlcli sft -r quickstart  # on the recipe's sft.source: expert demos
      rlcli sft -r my-recipe.yaml sft.source=data.jsonl sft.epochs=2
    """
    with stage_run(cli_ctx, recipe, run, overrides, force, ["sft"]) as ctx:
        from rlcli.engine.sft import run_sft
        from rlcli.report.tables import sft_table

        console.print(sft_table(run_sft(ctx)))


@app.command("rollout")
def rollout_cmd(
    cli_ctx: typer.Context,
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    policy: Annotated[
        str | None, typer.Option(help="base, latest, best, expert or a checkpoint id (default: rollout.policy).")
    ] = None,
    stage: Annotated[str, typer.Option(help="Stage name the episodes are recorded under.")] = "rollout",
    split: Annotated[str, typer.Option(help="Task split: train or eval.")] = "train",
    force: ForceOpt = False,
) -> None:
    """Collect episodes (tasks x group size) with a policy and record them token by token.

    Examples:
      rlcli rollout -r quickstart --policy expert --stage demos
      rlcli rollout -r quickstart --policy latest --split eval rollout.tasks=16
    """
    with stage_run(cli_ctx, recipe, run, overrides, force, ["eval"]) as ctx:
        from rlcli.engine.rollout import run_rollout_stage
        from rlcli.report.tables import episodes_table

        summary = run_rollout_stage(ctx, stage=stage, policy=policy or ctx.recipe.rollout.policy, split=split)
        console.print(episodes_table(stage, summary))


@app.command("label")
def label_cmd(
    cli_ctx: typer.Context,
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    label_set: Annotated[str, typer.Option(help="Name under which these reward components are stored.")] = "default",
    force: ForceOpt = False,
) -> None:
    """(Re)label the run's episodes with the recipe's reward functions, without new rollouts.

    Examples:
      rlcli label -r my-recipe.yaml --label-set strict
    """
    with stage_run(cli_ctx, recipe, run, overrides, force, []) as ctx:
        from rlcli.engine.labelling import run_label_stage
        from rlcli.report.tables import labels_table

        console.print(labels_table(run_label_stage(ctx, label_set=label_set)))


@train_app.command("grpo")
def train_grpo_cmd(
    cli_ctx: typer.Context,
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    force: ForceOpt = False,
) -> None:
    """Online GRPO: per iteration rollout -> label -> advantages -> update -> checkpoint.

    Examples:
      rlcli train grpo -r arithmetic
      rlcli train grpo -r arithmetic grpo.iterations=20  # resumes, no --force
      rlcli train grpo -r arithmetic grpo.lr=3e-5 --run arithmetic-lr3e-5
    """
    with stage_run(cli_ctx, recipe, run, overrides, force, ["grpo"]) as ctx:
        from rlcli.engine.grpo.loop import run_grpo

        run_grpo(ctx)


@train_app.command("distill")
def train_distill_cmd(
    cli_ctx: typer.Context,
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    force: ForceOpt = False,
) -> None:
    """On-policy distillation: per iteration the student samples, the teacher scores every sampled token, and
    the update follows the per-token reverse KL (GRPO's loop and settings, distill.teacher's logprobs).

    Examples:
      rlcli train distill -r quickstart distill.teacher=run:quickstart --run qs-distill
      rlcli train distill -r arithmetic distill.teacher=best distill.reward_weight=0.5
    """
    with stage_run(cli_ctx, recipe, run, overrides, force, ["distill"]) as ctx:
        from rlcli.engine.grpo.loop import run_distill

        run_distill(ctx)


@train_app.command("dpo")
def train_dpo_cmd(
    cli_ctx: typer.Context,
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    stage: Annotated[
        str,
        typer.Option(help="Stage name: dpo, or dpo/<n> for another DPO stage of the run (new pairs, a new start)."),
    ] = "dpo",
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """DPO on preference pairs mined from the run's labelled groups (best vs worst episode by reward)."""
    if not isinstance(try_parse_stage(stage), DpoStage):
        raise UsageError(f"--stage {stage!r}: expected dpo or dpo/<name>, e.g. dpo/2.")
    with stage_run(cli_ctx, recipe, run, overrides, force, ["dpo"]) as ctx:
        from dataclasses import asdict

        from rlcli.engine.dpo import run_dpo
        from rlcli.report.tables import stage_summary_table

        summary = run_dpo(ctx, stage)
        (err_console if as_json else console).print(stage_summary_table(summary))
    if as_json:
        print(json.dumps(asdict(summary), indent=2))


@app.command("eval")
def eval_cmd(
    cli_ctx: typer.Context,
    overrides: Overrides = None,
    recipe: RecipeOpt = None,
    run: RunOpt = None,
    checkpoint: Annotated[
        list[str] | None,
        typer.Option(
            "--checkpoint",
            "-c",
            help="base, sft, latest (the newest checkpoint), best (the best held-out success so far) or a "
            "checkpoint id; repeatable (default: eval.checkpoints, and best with grpo.keep_best).",
        ),
    ] = None,
    as_json: JsonOpt = False,
    force: ForceOpt = False,
) -> None:
    """Evaluate checkpoints on held-out tasks: success rate (95% CI), mean return, pass@k.

    Examples:
      rlcli eval -r quickstart  # the checkpoints eval.checkpoints names
      rlcli eval -r quickstart -c best eval.tasks=96
      rlcli eval -r quickstart -c base -c latest --json
    """
    with stage_run(cli_ctx, recipe, run, overrides, force, ["eval"]) as ctx:
        from rlcli.engine.evaluate import recipe_checkpoints, run_eval
        from rlcli.report.tables import evals_table, games_table
        from rlcli.report.views import eval_view

        rows = [eval_view(r) for r in run_eval(ctx, checkpoint or recipe_checkpoints(ctx.recipe))]
        (err_console if as_json else console).print(evals_table(rows))
        if (games := games_table(rows)) is not None:  # two-player games: win/draw/loss per opponent and seat
            (err_console if as_json else console).print(games)
    if as_json:
        print(json.dumps(rows, indent=2))
