"""`rlcli run`: every stage a recipe asks for, in order; each one skips what is already done."""

from __future__ import annotations

from rlcli.store.stages import RunContext


def run_all(ctx: RunContext) -> None:
    recipe = ctx.recipe
    if recipe.sft.source != "none":
        from rlcli.engine.sft import run_sft

        run_sft(ctx)
    if recipe.grpo.iterations > 0:
        from rlcli.engine.train import run_grpo

        run_grpo(ctx)
    if recipe.eval.tasks > 0:
        from rlcli.engine.evaluate import run_eval

        wanted = [c for c in recipe.eval.checkpoints if c != "sft" or recipe.sft.source != "none"]
        run_eval(ctx, wanted)
