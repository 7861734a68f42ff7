"""GRPO's learning-rate schedule: warmup then constant, linear or cosine decay, stored in every
checkpoint and re-anchored when a resume changes the number of optimizer steps."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch.optim.lr_scheduler import LambdaLR

    from rlcli.recipe import GrpoSection


@dataclass(frozen=True)
class LrSchedule:
    """The learning rate's multiplier at each optimizer step: a linear warmup over `warmup` steps,
    then `kind` (constant, linear or cosine decay to 0) until step `total`.

    A checkpoint stores it. A resume that changes the number of steps (grpo.iterations) re-anchors
    it (`stretched`): from the step reached, what is left of it spreads over the steps now left.
    `anchor`, `anchor_position` and `rate` map a step to its position in the plan; they are
    0, 0.0 and 1.0 until then. `end` is the step at which the run ends.
    """

    kind: str
    warmup: int
    total: int
    end: int
    anchor: int = 0
    anchor_position: float = 0.0
    rate: float = 1.0

    def position(self, step: int) -> float:
        return self.anchor_position + (step - self.anchor) * self.rate

    def factor(self, step: int) -> float:
        position = self.position(step)
        if position < self.warmup:
            return position / max(1, self.warmup)
        progress = (position - self.warmup) / max(1, self.total - self.warmup)
        if self.kind == "linear":
            return max(0.0, 1.0 - progress)
        if self.kind == "cosine":
            return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
        return 1.0

    def stretched(self, step: int, end: int) -> LrSchedule:
        position = self.position(step)
        return replace(
            self, end=end, anchor=step, anchor_position=position, rate=(self.total - position) / (end - step)
        )


def planned_schedule(cfg: GrpoSection, total_steps: int, state: dict[str, Any] | None) -> LrSchedule:
    """The recipe's schedule over `total_steps`; on resume, the checkpoint's, stretched over a new total."""
    total_steps = max(total_steps, 1)
    fresh = LrSchedule(cfg.schedule, cfg.warmup_steps, total_steps, total_steps)
    if state is None or "schedule" not in state:  # a fresh start, or a checkpoint from before rlcli stored it
        return fresh
    saved = replace(LrSchedule(**state["schedule"]), kind=cfg.schedule, warmup=cfg.warmup_steps)
    step = state["scheduler"]["last_epoch"]
    return saved if saved.end == total_steps or total_steps <= step else saved.stretched(step, total_steps)


def apply_recipe_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: GrpoSection, schedule: LrSchedule
) -> None:
    """The recipe's lr and weight decay rather than the checkpoint's, from the next step on, at the
    schedule's current position (loading the optimizer and scheduler state brought back the old ones)."""
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group.update(
            initial_lr=cfg.lr, lr=cfg.lr * schedule.factor(scheduler.last_epoch), weight_decay=cfg.weight_decay
        )
