"""`rlcli run`: every stage a recipe asks for, in order; each one skips what is already done.

run.stages may repeat grpo, dpo and eval (the VerIPO loop sft -> grpo -> dpo -> grpo -> eval): the k-th
grpo is GRPO phase k (engine/grpo/loop.py: iterations k*grpo.iterations onwards, from the newest checkpoint),
distill a phase of the same loop that distills (engine/grpo/teacher.py; grpo and distill are numbered together),
the k-th dpo is stage dpo (k = 0) or dpo/<k+1>, mining the groups stored so far, and an eval evaluates
eval.checkpoints (and, with grpo.keep_best, best) as they are when it runs (its stages are named by
checkpoint, so repeats never collide).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from rlcli.engine.context import RunContext
from rlcli.engine.memory import keeps_engine, release_stage_memory
from rlcli.errors import UsageError
from rlcli.store.checkpoints import BestAndLatest, best_and_latest
from rlcli.store.names import dpo_stage

if TYPE_CHECKING:  # the stages import torch: load them only when the recipe runs them
    from rlcli.engine.dpo import DpoSummary
    from rlcli.engine.sft import SftSummary
    from rlcli.recipe import Recipe
    from rlcli.store.records import EvalResult

    StageSummary = SftSummary | DpoSummary | list[EvalResult] | BestAndLatest


def run_all(ctx: RunContext, on_summary: Callable[[StageSummary], None] | None = None) -> BestAndLatest:
    """Run the recipe's stages (run.stages, in its order); `on_summary` receives each stage's summary
    as soon as it is done (the CLI renders it): the SFT and DPO summaries, the eval results, and last
    the run's best and latest checkpoints, which are also returned.

    Between stages, what the one before built goes before the next starts (engine/memory.py): its
    model, optimizer and scheduler, and the vLLM engine unless the next stage samples with it.
    ctx.progress shows the stage at work among them all."""

    def show(summary: StageSummary) -> None:
        if on_summary is not None:
            with ctx.progress.paused():  # a result on stdout, printed clear of the progress bar
                on_summary(summary)

    recipe = ctx.recipe
    stages = planned_stages(recipe)
    seen: Counter[str] = Counter()  # how many times each stage came before: its repeat's name
    if "dpo" in stages:  # refused before the stages ahead of it run, not after
        from rlcli.engine.dpo import check_text_model

        check_text_model(recipe)
    with ctx.progress.running(ctx.run, stages):
        for index, stage in enumerate(stages):
            if index:  # the first began with the block
                ctx.progress.stage(index)
            # grpo and distill are phases of one loop, numbered together (sft -> distill -> grpo: phases 0, 1)
            repeat = seen["loop"] if stage in ("grpo", "distill") else seen[stage]
            seen["loop" if stage in ("grpo", "distill") else stage] += 1
            try:
                _run_stage(ctx, stage, repeat, show)
            except BaseException as exc:
                release_stage_memory(keep_engine=True, failure=exc)  # the run ends here
                raise
            if index + 1 < len(stages):  # after the last, the command ends and frees (cli/common.py, stage_run)
                release_stage_memory(keep_engine=keeps_engine(stages[index + 1], _samples_with_vllm(recipe)))
    ending = best_and_latest(ctx.store)
    if ending.latest is not None or ending.best is not None:
        show(ending)
    return ending


def _run_stage(ctx: RunContext, stage: str, repeat: int, show: Callable[[StageSummary], None]) -> None:
    """The stage's `repeat`-th run (0: its first) in this pipeline."""
    recipe = ctx.recipe
    if stage == "sft":
        from rlcli.engine.sft import run_sft

        show(run_sft(ctx))
    elif stage == "grpo":
        from rlcli.engine.grpo.loop import run_grpo

        run_grpo(ctx, phase=repeat)
    elif stage == "distill":
        from rlcli.engine.grpo.loop import run_distill

        run_distill(ctx, phase=repeat)
    elif stage == "dpo":
        from rlcli.engine.dpo import run_dpo

        show(run_dpo(ctx, dpo_stage(repeat)))
    else:
        from rlcli.engine.evaluate import recipe_checkpoints, run_eval

        show(run_eval(ctx, recipe_checkpoints(recipe)))


def _samples_with_vllm(recipe: Recipe) -> bool:
    """Whether the recipe's stages sample with vLLM, and so may have left this process an engine."""
    from rlcli.generation.engines import generation_engine

    try:
        return generation_engine(recipe) == "vllm"
    except UsageError:  # a recipe vLLM cannot serve never started an engine
        return False


def planned_stages(recipe: Recipe) -> list[str]:
    """run.stages, or by default the stages the recipe's settings ask for."""
    if recipe.run.stages is not None:
        return list(recipe.run.stages)
    asked = {"sft": recipe.sft.source != "none", "grpo": recipe.grpo.iterations > 0, "eval": recipe.eval.tasks > 0}
    return [stage for stage, wanted in asked.items() if wanted]
