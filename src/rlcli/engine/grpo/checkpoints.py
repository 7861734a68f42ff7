"""Where and when GRPO saves: every grpo.checkpoint_every-th iteration and each phase's last, in
<run>/checkpoints/iter-NNNN with the trainer's state beside the weights."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rlcli.store.checkpoints import checkpoints
from rlcli.store.names import SFT_STAGE
from rlcli.store.records import Checkpoint

if TYPE_CHECKING:
    from rlcli.engine.context import RunContext
    from rlcli.recipe import GrpoSection

TRAINER_STATE = "trainer_state.pt"


def saves_checkpoint(cfg: GrpoSection, it: int) -> bool:
    """Every checkpoint_every-th iteration, and the last of each GRPO phase (a multiple of grpo.iterations)."""
    return (it + 1) % cfg.checkpoint_every == 0 or (it + 1) % cfg.iterations == 0


def checkpoint_folder(ctx: RunContext, it: int) -> Path:
    return ctx.run_dir / "checkpoints" / f"iter-{it:04d}"


def newest_sft(ctx: RunContext) -> Checkpoint | None:
    sft = [c for c in checkpoints(ctx.store) if c.stage == SFT_STAGE]
    return sft[-1] if sft else None
