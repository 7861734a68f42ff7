"""GRPO's learner: the policy and what updates it, one iteration at a time (grpo/loop.py runs the loop).

GrpoTrainer has a torchtune recipe's shape: `resume` finds where a phase goes on, `setup` loads the
policy, its KL reference, AdamW and the learning-rate schedule from there, `update` is one policy
update on an iteration's batch (grpo/batch.py), `save` writes its checkpoint folder and `commit` the
rows that go with it. It holds torch state only: which episodes to train on is grpo/selection.py's.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

# Heavy, but this module is only imported by the commands that train.
import torch

from rlcli.engine.context import RunContext
from rlcli.engine.grpo.batch import IterationBatch
from rlcli.engine.grpo.checkpoints import TRAINER_STATE, checkpoint_folder, newest_sft, saves_checkpoint
from rlcli.engine.grpo.resume import reference_checkpoint, resume_point, supersede_lost_rollouts
from rlcli.engine.grpo.schedule import LrSchedule, apply_recipe_hyperparameters, planned_schedule
from rlcli.engine.grpo.update import minibatches_per_epoch
from rlcli.engine.grpo.update import update as update_policy
from rlcli.generation.seeds import derive_seed
from rlcli.models.loading import (
    attach_reference,
    check_reference_possible,
    fsync_folder,
    load_policy,
    replace_folder,
    save_checkpoint,
)
from rlcli.store.checkpoints import add_checkpoint, require_folder
from rlcli.store.iterations import IterationStats
from rlcli.store.names import BASE, GRPO_STAGE, PolicyRef, train_stage
from rlcli.store.records import Checkpoint
from rlcli.store.replays import record_replays
from rlcli.store.stages import stage_done

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

METRICS_STAGE = GRPO_STAGE


class GrpoTrainer:
    """One GRPO phase's learner over iterations first .. end-1 (phase k of N-iteration phases runs
    k*N .. k*N+N-1): the policy (model, tokenizer), AdamW, the learning-rate schedule and the KL
    reference. Phase 0 starts from the run's SFT checkpoint (else the base model), a later phase from
    `start` (run_grpo's phase_start); a resumed one from the phase's newest readable checkpoint."""

    model: PreTrainedModel  # with LoRA, peft's wrapper around one
    tokenizer: PreTrainedTokenizerBase
    optimizer: torch.optim.AdamW
    scheduler: LambdaLR
    schedule: LrSchedule
    reference: Checkpoint | None  # the KL anchor: an SFT checkpoint, or None for the base model

    def __init__(self, ctx: RunContext, phase: int, start: Checkpoint | None, kind: str = "grpo") -> None:
        self.ctx, self.cfg, self.phase = ctx, ctx.recipe.grpo, phase
        check_reference_possible(ctx.recipe.lora, self.cfg.beta)
        self.first, self.end = phase * self.cfg.iterations, (phase + 1) * self.cfg.iterations
        self.title = f"train {kind} phase {phase}" if phase else f"train {kind}"  # kind: grpo, or distill
        self.origin = start if phase else newest_sft(ctx)  # the weights the phase starts from (None: the base)
        # The policy of the phase's first rollout, named by the stage that wrote those weights.
        self.start_policy = PolicyRef.written_by(self.origin.stage) if self.origin is not None else BASE
        self.resumed: Checkpoint | None = None
        self.state: dict[str, Any] | None = None  # the resumed checkpoint's trainer state
        # grpo.advantage rae: the baseline per game and seat after the iterations so far (saved in the
        # checkpoint's trainer state, so a resume goes on from the checkpoint's).
        self.rae_baselines: dict[str, float] = {}
        self.next_iteration = self.first

    def resume(self) -> range:
        """The iterations left to run: those after the phase's newest readable checkpoint (resume_point),
        whose weights and trainer state `setup` then loads."""
        self.resumed, self.state = resume_point(self.ctx, self.first)
        self.next_iteration = self.resumed.iteration + 1 if self.resumed else self.first
        return range(self.next_iteration, self.end)

    def setup(self) -> None:
        """Load the policy from the checkpoint resumed from (else the phase's starting point), its KL
        reference, AdamW and the learning-rate schedule; a resume restores their state."""
        recipe, cfg = self.ctx.recipe, self.cfg
        torch.manual_seed(derive_seed(recipe.run.seed, "init"))  # a fresh LoRA adapter's random init
        # Before minutes of loading: a refused reference stops here.
        self.reference = reference_checkpoint(self.ctx, self.state)
        weights = self.resumed or self.origin
        self.model, self.tokenizer = load_policy(
            recipe.model, recipe.lora, recipe.quantization, adapter=weights.path if weights else None, trainable=True
        )
        if cfg.beta > 0 and self.reference is not None:
            attach_reference(self.model, require_folder(self.reference))
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if hasattr(self.model, "enable_input_require_grads"):
                self.model.enable_input_require_grads()
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.schedule = planned_schedule(cfg, cfg.epochs * minibatches_per_epoch(recipe) * cfg.iterations, self.state)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule.factor)
        if self.state:
            self.rae_baselines = dict(self.state.get("rae_baselines", {}))
            self.optimizer.load_state_dict(self.state["optimizer"])
            self.scheduler.load_state_dict(self.state["scheduler"])
            apply_recipe_hyperparameters(self.optimizer, self.scheduler, cfg, self.schedule)
        # Stages after the checkpoint were done with weights that were not saved: redo them.
        for it in range(self.next_iteration, self.end):
            if stage_done(self.ctx.store, train_stage(it)):
                self.ctx.store.mark_stage(train_stage(it), "pending")
        supersede_lost_rollouts(self.ctx, self.next_iteration, self.end)
        self.ctx.console.print(
            f"{self.title}: iterations {self.next_iteration}..{self.end - 1}, starting from {self._starting_point()}"
        )

    def release(self) -> None:
        """Drop the policy (its KL reference is an adapter of it), AdamW and the schedule, once the phase
        is over: whatever still holds this learner then holds none of their memory."""
        for name in ("model", "tokenizer", "optimizer", "scheduler"):
            self.__dict__.pop(name, None)

    def _starting_point(self) -> str:
        if self.resumed:
            shown = f"checkpoint {self.resumed.id}"
        elif self.phase and self.origin is not None:
            shown = f"{self.start_policy} (checkpoint {self.origin.id})"
        else:
            shown = str(self.start_policy)
        anchor = f", KL to {'sft' if self.reference else 'base'} (beta {self.cfg.beta:g})" if self.cfg.beta > 0 else ""
        return shown + anchor

    def policy(self, it: int) -> PolicyRef:
        """The weights iteration it's rollouts play: the update before's, or the phase's starting point."""
        return PolicyRef.train(it - 1) if it > self.first else self.start_policy

    def update(self, batch: IterationBatch) -> IterationStats:
        """One policy update on `batch`: grpo.epochs passes of clipped-ratio steps (grpo/update.py)."""
        # The learning rate this iteration's first step uses.
        metrics: dict[str, float] = {"train/lr": self.optimizer.param_groups[0]["lr"], **batch.metrics}
        if batch.rae_baselines is not None:  # what this iteration's checkpoint saves and the next one goes on from
            self.rae_baselines = batch.rae_baselines
        if batch.sequences:
            it = batch.iteration
            torch.manual_seed(derive_seed(self.ctx.recipe.run.seed, "dropout", it))  # dropout, if any, replays exactly
            self.model.train()
            metrics.update(
                update_policy(
                    self.ctx, self.model, self.optimizer, self.scheduler, batch.sequences, it, batch.entropy_coef
                )
            )
        else:  # every group had equal rewards, or every episode was masked: nothing to learn from
            metrics["train/skipped"] = 1.0
        return IterationStats(batch.reward_mean, batch.reward_std, metrics, batch.replayed, batch.trained_groups)

    def save(self, it: int) -> None:
        """Iteration it's checkpoint: weights, optimizer, scheduler, schedule and KL anchor, written to a
        temporary folder, fsynced and renamed into place, so that a crash leaves either the old folder or
        the complete new one. Its row is written when the iteration commits."""
        final = checkpoint_folder(self.ctx, it)
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(self.model, self.tokenizer, tmp)
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "schedule": asdict(self.schedule),
                "iteration": it,
                "reference": self.reference.id if self.reference is not None else None,  # the KL anchor a resume keeps
                "rae_baselines": dict(self.rae_baselines),  # grpo.advantage rae's baselines after this iteration
            },
            tmp / TRAINER_STATE,
        )
        fsync_folder(tmp)
        replace_folder(tmp, final)

    def commit(self, it: int, stats: IterationStats, metrics: dict[str, Any]) -> None:
        """train/it's closing writes, made in the transaction that marks it done once its checkpoint
        folder is durable: the replays it trained on, its checkpoint's row and its metrics."""
        ctx = self.ctx
        record_replays(ctx.store, it, stats.replayed or [])
        if saves_checkpoint(self.cfg, it):
            kind = "lora" if ctx.recipe.lora is not None else "full"
            add_checkpoint(ctx.store, train_stage(it), it, checkpoint_folder(ctx, it), kind)
        ctx.store.log_metrics(METRICS_STAGE, it, metrics)
