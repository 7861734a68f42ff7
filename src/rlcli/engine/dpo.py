"""`rlcli train dpo`: DPO on preference pairs mined from the run's stored, labelled groups.

The stage reads top to bottom: the starting policy (the run's newest checkpoint from before this
stage, else the base model), the pairs (mined once by engine/pairs.py and recorded in `dpo_pairs`,
so a resumed stage trains on exactly the same ones even if more episodes were stored meanwhile),
TRL's DPOTrainer on the stored token ids, and the trained policy saved as the stage's checkpoint,
which `eval -c latest` then names.

The reference is the starting policy: with LoRA, TRL keeps a frozen copy of the starting adapter
beside the trained one (a fresh adapter starts as the base model, so then it is the base); without
LoRA, a second copy of the starting model. With quantization: 4bit the base weights stay 4-bit.

Resuming: the Trainer checkpoints into <run>/<stage>/checkpoint-N every dpo.save_steps steps; a
killed stage restarts from the newest complete one, as `rlcli sft` does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trl import DPOTrainer
from trl.trainer.dpo_trainer import DataCollatorForPreference

from rlcli.engine.context import RunContext
from rlcli.engine.hf_trainer import (
    RecipeLearningRate,
    StageProgress,
    quiet_datasets,
    save_trained,
    train_resuming,
    trainer_args,
    without_log_printer,
)
from rlcli.engine.memory import frees_on_failure
from rlcli.engine.pairs import PreferenceExample, mine_pairs, preference_example, source_stages
from rlcli.engine.trackers import stage_tracker
from rlcli.errors import UsageError
from rlcli.store.checkpoints import checkpoints, require_folder
from rlcli.store.names import BASE, DPO_STAGE, PolicyRef
from rlcli.store.pairs import PairRecord, episodes_with_turns, record_pairs, stage_pairs
from rlcli.store.records import Checkpoint
from rlcli.store.stages import stage_done

if TYPE_CHECKING:
    from datasets import Dataset, IterableDataset
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, ProcessorMixin, TrainerCallback
    from trl import DPOConfig

    from rlcli.models.loading import PolicyModel
    from rlcli.recipe import Recipe

# Trainer log keys -> metric keys in the run database (metrics stage: the DPO stage's name).
LOGGED = {
    "loss": "dpo/loss",
    "rewards/margins": "dpo/reward_margin",
    "rewards/accuracies": "dpo/reward_accuracy",
    "learning_rate": "dpo/lr",
    "grad_norm": "dpo/grad_norm",
}


@dataclass(frozen=True)
class DpoSummary:
    """What a DPO stage did; stored as the stage's result."""

    stage: str
    start: str  # base, or the id of the checkpoint it started from
    pairs: int
    steps: int
    resumed_from_step: int
    train_loss: float | None  # mean over every step
    final_loss: float | None
    final_reward_margin: float | None  # beta * (chosen - rejected log-ratio), at the last logged step
    checkpoint_id: int | None  # None: there were no pairs, and the policy is unchanged
    path: str | None


def check_text_model(recipe: Recipe) -> None:
    """DPO trains text models only: the pairs' prompt ids of a vision-language model hold image
    tokens, and TRL's DPO forward would read them as plain tokens, never seeing the pixels."""
    from rlcli.models.cache import resolve_model
    from rlcli.models.vision import vision_model_type

    model_type = vision_model_type(resolve_model(recipe.model.name))
    if model_type is not None:
        raise UsageError(
            f"dpo: model.name {recipe.model.name} is a {model_type} vision-language model, and rlcli's DPO "
            "trains text models only (it would train on the image tokens without their pixels); drop dpo "
            "from run.stages."
        )


def run_dpo(ctx: RunContext, stage: str = DPO_STAGE) -> DpoSummary:
    """`rlcli train dpo`: mine pairs (once), train on them, record the result as a checkpoint."""
    check_text_model(ctx.recipe)
    cfg = ctx.recipe.dpo
    if cfg.batch_size % cfg.micro_batch_size:
        raise UsageError(
            f"dpo.batch_size ({cfg.batch_size}) must be a multiple of dpo.micro_batch_size ({cfg.micro_batch_size})."
        )
    if not stage_done(ctx.store, stage) and not stage_pairs(ctx.store, stage):
        # Nothing to mine (no stage of dpo.source has episodes) is the user's to fix: said before the
        # stage starts, so that a command refused here leaves the run and its status as they were.
        source_stages(ctx.store, cfg.source)
    start = starting_checkpoint(ctx, stage)
    # What the pairs are and where training starts define the stage; optimiser settings do not.
    identity = {
        "start": "base" if start is None else start.id,
        **{k: getattr(cfg, k) for k in ("source", "label_set", "margin", "max_pairs")},
    }
    return DpoSummary(
        **ctx.stage(
            stage,
            lambda: asdict(train_dpo(ctx, stage, start)),
            cfg.model_dump(mode="json"),
            identity=identity,
            new_stage_hint="run `rlcli train dpo --stage dpo/2` (any new name) to train on new pairs or a new start",
        )
    )


def starting_checkpoint(ctx: RunContext, stage: str) -> Checkpoint | None:
    """The checkpoint the stage recorded as its start when it first ran, else the run's newest one that
    this stage did not write (a kill between writing its own row and marking the stage done must not
    make a resumed stage start from itself). The recorded start keeps a rerun of `rlcli run` in a
    grpo -> dpo -> grpo loop from asking the done DPO stage for the later GRPO phase's checkpoint."""
    known = checkpoints(ctx.store)
    row = ctx.store.stage(stage)
    recorded = row.params.get("start") if row is not None else None
    if recorded == str(BASE):
        return None
    if recorded is not None and (found := next((c for c in known if c.id == recorded), None)) is not None:
        return found
    earlier = [c for c in known if c.stage != stage]
    return earlier[-1] if earlier else None


@frees_on_failure  # a failed stage's traceback keeps no model, reference, trainer or optimizer alive
def train_dpo(ctx: RunContext, stage: str, start: Checkpoint | None) -> DpoSummary:
    from transformers import set_seed

    from rlcli.models.loading import load_policy

    recipe = ctx.recipe
    pairs = stored_or_mined_pairs(ctx, stage)
    if not pairs:
        # Like a GRPO iteration whose groups all have equal rewards: nothing to learn, not an error,
        # so that a recipe's sft -> grpo -> dpo -> eval goes on.
        return DpoSummary(stage, str(PolicyRef.of_checkpoint(start)), 0, 0, 0, None, None, None, None, None)
    examples = pair_examples(ctx, pairs)
    where = "the base model" if start is None else f"checkpoint {start.id} ({start.stage})"
    ctx.console.print(f"{stage}: training on {len(pairs)} preference pairs, starting from {where}")

    set_seed(recipe.run.seed)  # a fresh LoRA adapter's random init
    adapter = require_folder(start) if start is not None else None
    model, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization, adapter=adapter, trainable=True)
    reference = None
    if recipe.lora is None:  # TRL would load the reference from the base's path, not from this start
        reference, _ = load_policy(recipe.model, None, recipe.quantization, adapter=adapter, trainable=False)

    output_dir = ctx.run_dir / stage.replace("/", "-")
    with stage_tracker(ctx, stage) as tracker:  # run.trackers: each logging step mirrored there
        progress = DpoProgress(ctx, stage, tracker)
        trainer = build_trainer(
            ctx, model, reference, tokenizer, examples, output_dir, [progress, RecipeLearningRate()]
        )
        resumed_from_step = train_resuming(ctx, trainer, progress)

    folder = ctx.run_dir / "checkpoints" / stage.replace("/", "-")
    path, checkpoint_id = save_trained(ctx, trainer, tokenizer, stage, folder)
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    margins = [h["rewards/margins"] for h in history if "rewards/margins" in h]
    return DpoSummary(
        stage=stage,
        start=str(PolicyRef.of_checkpoint(start)),
        pairs=len(pairs),
        steps=trainer.state.global_step,
        resumed_from_step=resumed_from_step,
        train_loss=sum(losses) / len(losses) if losses else None,
        final_loss=losses[-1] if losses else None,
        final_reward_margin=margins[-1] if margins else None,
        checkpoint_id=checkpoint_id,
        path=str(path),
    )


def build_trainer(
    ctx: RunContext,
    model: PolicyModel,
    reference: PreTrainedModel | None,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[PreferenceExample],
    output_dir: Path,
    callbacks: list[TrainerCallback],
) -> TokenDPOTrainer:
    """TRL's DPOTrainer on the pairs' token ids. reference: a frozen copy of the starting model
    (without LoRA); None with LoRA, where TRL keeps a frozen copy of the starting adapter."""
    import datasets

    args = dpo_args(ctx, output_dir)
    collator = MaskedPreferenceCollator(pad_token_id=tokenizer.pad_token_id, max_length=ctx.recipe.model.max_length)
    with quiet_datasets():
        dataset = datasets.Dataset.from_list([asdict(e) for e in examples])
    trainer = TokenDPOTrainer(
        model=model,
        ref_model=reference,
        args=args,
        data_collator=collator,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=callbacks,
    )
    return without_log_printer(trainer)


def stored_or_mined_pairs(ctx: RunContext, stage: str) -> list[PairRecord]:
    """The pairs the stage recorded when it first ran, else mined now and recorded."""
    cfg = ctx.recipe.dpo
    pairs = stage_pairs(ctx.store, stage)
    if pairs:  # a resumed stage: the same pairs, whatever was stored since
        return pairs
    stages = source_stages(ctx.store, cfg.source)
    report = mine_pairs(ctx.store, stages, cfg.label_set, cfg.margin, cfg.max_pairs)
    record_pairs(ctx.store, stage, report.pairs)
    ctx.console.print(
        f"{stage}: mined {len(report.pairs)} pairs from {report.groups} labelled groups in {', '.join(stages)} "
        f"(label set {cfg.label_set!r}; {report.below_margin} with best and worst rewards closer than dpo.margin "
        f"{cfg.margin:g}, {report.no_shared_prompt} that never act differently on a shared prompt)"
    )
    if not report.pairs:
        ctx.console.print(
            f"{stage}: no preference pairs, so the policy stays as it is; lower dpo.margin or roll out more groups, "
            f"then run `rlcli train dpo --stage dpo/2`."
        )
    return report.pairs


def pair_examples(ctx: RunContext, pairs: list[PairRecord]) -> list[PreferenceExample]:
    """The recorded pairs' training examples, rebuilt from their episodes' stored tokens."""
    episodes = episodes_with_turns(ctx.rundb, [i for p in pairs for i in (p.chosen_episode_id, p.rejected_episode_id)])
    return [
        preference_example(episodes[p.chosen_episode_id], episodes[p.rejected_episode_id], p.turn_index) for p in pairs
    ]


# --- TRL, fed token ids ---------------------------------------------------------------------------


class TokenDPOTrainer(DPOTrainer):
    """DPOTrainer on examples that are token ids already: TRL's preparation would render and
    tokenise text, and rlcli trains on the tokens that were sampled, never on re-tokenised text."""

    def _prepare_dataset(
        self,
        dataset: Dataset | IterableDataset,
        processing_class: PreTrainedTokenizerBase | ProcessorMixin,
        args: DPOConfig,
        dataset_name: str,
    ) -> Dataset | IterableDataset:
        return dataset


class MaskedPreferenceCollator(DataCollatorForPreference):
    """TRL's preference batches, with the loss mask of each continuation: the env's and the chat
    template's tokens between the policy's turns are context, not scored (TRL scores all of them)."""

    def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
        import torch

        batch = super().torch_call(examples)
        width = batch["input_ids"].shape[1]
        masks = [[0] * len(e["prompt_ids"]) + e["chosen_mask"] for e in examples]
        masks += [[0] * len(e["prompt_ids"]) + e["rejected_mask"] for e in examples]
        if self.max_length is not None:
            masks = [m[: self.max_length] for m in masks]
        batch["completion_mask"] = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.long)
        return batch


def dpo_args(ctx: RunContext, output_dir: Path) -> DPOConfig:
    from trl import DPOConfig

    cfg = ctx.recipe.dpo
    return trainer_args(
        DPOConfig,
        ctx,
        cfg,
        output_dir,
        beta=cfg.beta,
        remove_unused_columns=False,  # the collator needs the loss masks
    )


class DpoProgress(StageProgress):
    """A DPO stage's progress bar and metrics: the loss and the reward margin beside the bar."""

    section = "dpo"
    logged = LOGGED
    shown = {"loss": "dpo/loss", "margin": "dpo/reward_margin"}
