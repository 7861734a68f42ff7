"""Where a GRPO phase goes on after a stop: the newest readable checkpoint and its trainer state, the
rollouts that the lost weights played (set aside and played again), and the KL anchor a resume keeps
(docs/database.md, "Resuming GRPO")."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from rlcli.engine.grpo.checkpoints import TRAINER_STATE
from rlcli.engine.labelling import GRPO_LABEL_SET
from rlcli.errors import UsageError
from rlcli.models.loading import is_pruned
from rlcli.store.checkpoints import checkpoints, require_folder, train_checkpoints
from rlcli.store.names import SFT_STAGE
from rlcli.store.records import Checkpoint

if TYPE_CHECKING:
    from rlcli.engine.context import RunContext


def resume_point(ctx: RunContext, first: int = 0) -> tuple[Checkpoint | None, dict[str, Any] | None]:
    """The newest GRPO checkpoint from iteration `first` on (the phase's first) whose trainer state
    reads back, with that state; (None, None) to start the phase afresh. One that a crash left
    unreadable is passed over, saying so: its iterations are redone."""
    own = [c for c in train_checkpoints(ctx.store) if c.iteration >= first]
    for checkpoint in reversed(own):
        if is_pruned(require_folder(checkpoint)):  # grpo.keep_checkpoints deleted its state (never the newest's)
            continue
        state_file = require_folder(checkpoint) / TRAINER_STATE
        try:
            return checkpoint, torch.load(state_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a cut-off or corrupt file: EOFError, RuntimeError, UnpicklingError, ...
            ctx.console.print(
                f"train grpo: checkpoint {checkpoint.id} ({state_file}) is unreadable "
                f"({type(exc).__name__}: {exc}); falling back to the one before it."
            )
    return None, None


def supersede_lost_rollouts(ctx: RunContext, next_iteration: int, end: int) -> None:
    """The resume rule for the work after the checkpoint resumed from (docs/database.md, "Resuming GRPO").

    A resume redoes train/<next_iteration> .. from that checkpoint, so the weights those updates made
    before the kill are gone (grpo.checkpoint_every > 1 saved none of them), and the redo may compute
    others (a GPU's reductions are not bit-reproducible). A rollout stage of these iterations (its extra
    rounds included) that holds an episode such weights played is therefore superseded, and so is one begun
    after rollout/<next_iteration> that holds no episode yet (its recorded draw may rest on redone work):
    its episodes are set aside into superseded/<stage>/<n>, kept with their turns and labels but never
    trained on nor counted, and its rows and those of its label stages are removed, so that it is drawn,
    played and labelled again, as the first time, by the recomputed weights. In the synchronous loop that
    is every rollout/i begun for i > next_iteration. rollout/<next_iteration> (played by the checkpoint's
    weights), one sampled ahead with saved weights (grpo.max_staleness), and what the iterations before
    trained on are kept: an iteration's data is fixed once it has trained and its weights are saved.
    On a CPU the redo computes the same weights, and the stage is played again to the same episodes."""
    from rlcli.engine.grpo.staleness import policy_version
    from rlcli.store.episodes import stage_episodes, supersede_stage
    from rlcli.store.names import BranchStage, GrpoLabelStage, LabelStage, RolloutStage, try_parse_stage
    from rlcli.store.tasks import refresh_task_stats

    rows = {row.name: try_parse_stage(row.name) for row in ctx.store.stages()}
    for name, parsed in rows.items():
        # grpo.branch's branch/i plays with the same weights as rollout/i, and labels in its own stage.
        if not isinstance(parsed, (RolloutStage, BranchStage)) or not next_iteration <= parsed.iteration < end:
            continue
        played = {episode.policy for episode in stage_episodes(ctx.store, name)}
        versions = [v for v in map(policy_version, played) if v is not None]
        if not any(v >= next_iteration for v in versions) and (played or parsed.iteration == next_iteration):
            continue
        labels = [GrpoLabelStage(parsed.iteration, parsed.round).name] if isinstance(parsed, RolloutStage) else []
        labels += [other for other, p in rows.items() if isinstance(p, LabelStage) and p.stage == name]
        aside, moved = supersede_stage(ctx.store, name, [name, *labels])
        if moved:
            refresh_task_stats(ctx.store, aside, GRPO_LABEL_SET)  # counted without them
        kept = f"its {moved} episodes set aside as {aside}" if moved else "it had stored no episode yet"
        ctx.console.print(
            f"train grpo: {name} was begun with weights that this resume recomputes from the last checkpoint "
            f"({', '.join(sorted(played)) or 'the update before it'}); it starts again ({kept}).",
            highlight=False,
        )


def reference_checkpoint(ctx: RunContext, state: dict[str, Any] | None) -> Checkpoint | None:
    """The KL anchor that grpo.reference names: the run's SFT checkpoint, or None for the base model
    (auto: sft when the run has one). A resumed run keeps the anchor its checkpoint recorded, so the
    KL term means the same thing throughout (checkpoints from before rlcli recorded it anchored to the
    base); a recipe that now names the other one is refused."""
    choice = ctx.recipe.grpo.reference
    run_checkpoints = checkpoints(ctx.store)
    if state is not None:
        recorded = state.get("reference")
        found = next((c for c in run_checkpoints if c.id == recorded), None)
        if recorded is not None and found is None:
            raise UsageError(
                f"Run {ctx.run!r}: GRPO anchored its KL term to checkpoint {recorded}, which is no longer recorded; "
                "restore it, or start a new run."
            )
        was = "base" if found is None else "sft"
        if choice not in ("auto", was):
            raise UsageError(
                f"grpo.reference: run {ctx.run!r} started GRPO with the {was} policy as its reference and a resumed "
                f"run keeps it; set grpo.reference: {was} (or auto), or start a new run."
            )
        return found
    sft = [c for c in run_checkpoints if c.stage == SFT_STAGE]
    if choice == "sft" and not sft:
        raise UsageError(
            f"grpo.reference is sft, but run {ctx.run!r} has no SFT checkpoint; run `rlcli sft` first "
            "or set grpo.reference: base (or auto)."
        )
    return sft[-1] if sft and choice != "base" else None
