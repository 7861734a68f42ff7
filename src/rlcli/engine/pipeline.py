"""`rlcli run`: every stage a recipe asks for, in order; each one skips what is already done."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from rlcli.engine.context import RunContext

if TYPE_CHECKING:  # the stages import torch: load them only when the recipe runs them
    from rlcli.engine.sft import SftSummary
    from rlcli.store.records import EvalResult

    StageSummary = SftSummary | list[EvalResult]


def run_all(ctx: RunContext, on_summary: Callable[[StageSummary], None] | None = None) -> None:
    """Run the recipe's stages; `on_summary` receives each stage's summary as soon as it is done
    (the CLI renders it), the SFT summary and then the eval results."""
    show = on_summary or (lambda summary: None)
    recipe = ctx.recipe
    if recipe.sft.source != "none":
        from rlcli.engine.sft import run_sft

        show(run_sft(ctx))
    if recipe.grpo.iterations > 0:
        from rlcli.engine.train import run_grpo

        run_grpo(ctx)
    if recipe.eval.tasks > 0:
        from rlcli.engine.evaluate import run_eval

        wanted = [c for c in recipe.eval.checkpoints if c != "sft" or recipe.sft.source != "none"]
        show(run_eval(ctx, wanted))
