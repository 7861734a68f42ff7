"""grpo.keep_checkpoints: which GRPO checkpoints keep their weights once an iteration is done, and
deleting the others' (the quickstart's 32 would otherwise hold about 2 GB).

Kept: the n newest (a resume goes on from the newest, grpo/resume.py), those of the last
grpo.max_staleness iterations (the rollout worker may still load them), the best by held-out success
(`-c best`), and any id eval.checkpoints or an opponent names; the SFT and DPO checkpoints are no GRPO
checkpoints and are never pruned. A checkpoint whose held-out eval (grpo.eval_every) is due keeps its
weights until that eval is done, since a resume after a kill evaluates it from disk. A pruned
checkpoint keeps its row and its eval results; its folder holds one sentence saying it was pruned,
which is what loading it says (models/loading.py). Pruning is idempotent: one a kill cut short
is finished after the next iteration."""

from __future__ import annotations

from pathlib import Path

from rlcli.engine.context import RunContext
from rlcli.engine.grpo.checkpoints import checkpoint_folder
from rlcli.engine.grpo.evals import evaluates_after
from rlcli.models.loading import prune_checkpoint
from rlcli.store.checkpoints import best_checkpoint, train_checkpoints
from rlcli.store.evals import eval_results
from rlcli.store.records import Checkpoint
from rlcli.store.stages import stage_done


def prune_checkpoints(ctx: RunContext, it: int) -> None:
    """After iteration `it` (its checkpoint and held-out eval committed): prune what the recipe does not keep."""
    cfg = ctx.recipe.grpo
    if cfg.keep_checkpoints is None:
        return
    own = train_checkpoints(ctx.store)
    kept = {c.id for c in own[-cfg.keep_checkpoints :]}
    kept |= {c.id for c in own if c.iteration >= it - cfg.max_staleness}
    best = best_checkpoint(ctx.store)
    if best is not None and best.checkpoint is not None:
        kept.add(best.checkpoint.id)
    kept |= named_checkpoints(ctx)
    evaluated = {r.checkpoint_id for r in eval_results(ctx.store) if stage_done(ctx.store, r.stage)}
    for checkpoint in own:
        folder = Path(checkpoint.path)
        # Only the folders GRPO itself wrote in the run's folder: a row pointing elsewhere is left alone.
        if checkpoint.id in kept or folder != checkpoint_folder(ctx, checkpoint.iteration) or not folder.is_dir():
            continue
        if cfg.eval_every and evaluates_after(cfg, checkpoint.iteration) and checkpoint.id not in evaluated:
            continue
        prune_checkpoint(folder, pruned_sentence(ctx, checkpoint))


def named_checkpoints(ctx: RunContext) -> set[int]:
    """The checkpoint ids the recipe names: in eval.checkpoints, eval.opponents or env.opponent."""
    recipe = ctx.recipe
    names = [*recipe.eval.checkpoints, *(recipe.eval.opponents or []), recipe.env.model_opponent() or ""]
    return {int(name) for name in map(str, names) if name.isdigit()}


def pruned_sentence(ctx: RunContext, checkpoint: Checkpoint) -> str:
    return (
        f"Checkpoint {checkpoint.id} ({checkpoint.stage}) of run {ctx.run!r} was pruned by grpo.keep_checkpoints: "
        f"its weights are deleted and its eval results kept; -c latest and -c best name kept ones "
        f"(rlcli runs show {ctx.run} lists the checkpoints)."
    )
