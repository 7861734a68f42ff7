"""grpo.eval_every's held-out evals during a GRPO phase: the starting point's, then every n-th
iteration's checkpoint and the last one's, with the model in memory where it holds those weights."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlcli.engine.context import RunContext
from rlcli.engine.evaluate import TrainingEvals
from rlcli.engine.grpo.checkpoints import saves_checkpoint
from rlcli.engine.grpo.learner import METRICS_STAGE, GrpoTrainer
from rlcli.store.checkpoints import train_checkpoints
from rlcli.store.names import train_stage

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rlcli.recipe import GrpoSection


class HeldOutEvals:
    """grpo.eval_every's held-out evals during a GRPO phase (engine/evaluate.py, TrainingEvals), with
    the trainer's model where it holds the weights evaluated; none when eval_every is 0."""

    def __init__(
        self, ctx: RunContext, model: PreTrainedModel | None, tokenizer: PreTrainedTokenizerBase | None
    ) -> None:
        self.ctx = ctx
        self.evals = TrainingEvals(ctx, model, tokenizer, METRICS_STAGE) if ctx.recipe.grpo.eval_every else None

    def before(self, trainer: GrpoTrainer) -> None:
        """In phase 0 the starting point's eval (SFT, else base), then those of the phase's checkpoints
        before the iteration it goes on from, which a kill cut off or that predate eval_every. The
        model in memory holds the weights resumed from, else the starting point's; every other one is
        loaded from disk. A later phase's start (the DPO checkpoint) gets no eval here: its step would
        be the phase before's last; an eval stage after dpo in run.stages measures it."""
        if self.evals is None:
            return
        resumed, cfg = trainer.resumed, self.ctx.recipe.grpo
        if trainer.first == 0:
            self.evals.evaluate(trainer.origin, -1, in_memory=resumed is None)
        for ckpt in train_checkpoints(self.ctx.store):
            done = trainer.first <= ckpt.iteration < min(trainer.next_iteration, trainer.end)
            if done and evaluates_after(cfg, ckpt.iteration):
                self.evals.evaluate(ckpt, ckpt.iteration, in_memory=resumed is not None and ckpt.id == resumed.id)

    def after(self, it: int) -> dict[str, float]:
        """The held-out metrics of iteration it's checkpoint, when its eval is due (with the model in memory)."""
        if self.evals is None or not evaluates_after(self.ctx.recipe.grpo, it):
            return {}
        saved = [c for c in train_checkpoints(self.ctx.store) if c.stage == train_stage(it)]
        return self.evals.evaluate(saved[-1], it, in_memory=True)


def evaluates_after(cfg: GrpoSection, it: int) -> bool:
    """grpo.eval_every: iteration it's checkpoint gets a held-out eval (every n iterations, and the last)."""
    due = (it + 1) % cfg.eval_every == 0 or (it + 1) % cfg.iterations == 0 if cfg.eval_every else False
    return due and saves_checkpoint(cfg, it)
