"""`rlcli sft`: supervised warm-start of the policy, before GRPO.

The stage reads top to bottom: data (conversations from a file, the env's expert, or a run's good
episodes), setup (the policy as the recipe loads it), tokenisation with an assistant-only loss mask,
training with TRL's SFTTrainer, and saving the adapter as the run's `sft` checkpoint, which
`train grpo` and `eval --checkpoint sft` start from.

Resuming: the Trainer checkpoints into <run>/sft/checkpoint-N every sft.save_steps optimizer steps
(weights, optimizer, scheduler, RNG, log history); a killed stage restarts from the newest complete
one. A resume with another sft.lr (--force) trains from there with the new peak learning rate, at
the schedule's current position (the checkpoint's optimizer state would bring back the old one). Expert demonstrations are their own stage (sft/demos), committed in chunks, so a resumed run
never rolls them out twice.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

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
from rlcli.engine.sft_data import Conversation
from rlcli.engine.sft_sources import data_identity, read_data_source
from rlcli.engine.sft_tokens import encode_conversations, encode_image_conversations, split_examples, with_images
from rlcli.engine.trackers import stage_tracker
from rlcli.errors import UsageError
from rlcli.models import vision
from rlcli.store.episodes import episodes_for_sft, stage_episodes
from rlcli.store.names import EXPERT, SFT_DEMOS_STAGE, SFT_STAGE
from rlcli.store.run_store import RunStore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, ProcessorMixin, TrainerControl, TrainerState, TrainingArguments
    from trl import SFTConfig, SFTTrainer

    from rlcli.models.loading import PolicyModel
    from rlcli.recipe import EnvSection

METRICS_STAGE = SFT_STAGE
# Trainer log keys -> metric keys in the run database.
LOGGED = {
    "loss": "sft/loss",
    "eval_loss": "sft/eval_loss",
    "learning_rate": "sft/lr",
    "grad_norm": "sft/grad_norm",
    # TRL's mean token entropy (nats) over the reply tokens: of the batches trained on, and of the held-out ones.
    "entropy": "sft/entropy",
    "eval_entropy": "sft/eval_entropy",
}


# --- the stage ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SftSummary:
    """What the sft stage did; stored as the stage's result."""

    source: str
    examples: int
    train_examples: int
    eval_examples: int
    truncated: int  # conversations cut at model.max_length
    steps: int
    resumed_from_step: int
    train_loss: float | None  # mean over every step
    final_loss: float | None
    eval_loss: float | None
    checkpoint_id: int
    path: str
    # The policy's mean token entropy over the held-out replies before SFT and at its end (None without a
    # held-out share), and whether sft.min_entropy stopped it; defaults for results stored before them.
    eval_entropy_before: float | None = None
    eval_entropy: float | None = None
    stopped_at_min_entropy: bool = False


def run_sft(ctx: RunContext) -> SftSummary:
    """`rlcli sft`: train the policy on conversations, record the result as checkpoint `sft`."""
    cfg = ctx.recipe.sft
    if cfg.source == "none":
        raise UsageError(
            "sft.source is none: set it to expert, episodes, hub:ORG/NAME, or a data file or folder to run SFT."
        )
    if cfg.batch_size % cfg.micro_batch_size:
        raise UsageError(
            f"sft.batch_size ({cfg.batch_size}) must be a multiple of sft.micro_batch_size ({cfg.micro_batch_size})."
        )
    # What SFT trains on defines the stage; optimiser settings are resume-safe and may change. A data
    # file, folder or hub dataset counts by its content too: a resume on other rows would train on both.
    data = data_identity(cfg)
    return SftSummary(
        **ctx.stage(
            SFT_STAGE,
            lambda: asdict(train_sft(ctx)),
            cfg.model_dump(mode="json"),
            identity=data,
            new_stage_hint="use another --run to train on other data",
        )
    )


@frees_on_failure  # a failed stage's traceback keeps no model, trainer or optimizer alive
def train_sft(ctx: RunContext) -> SftSummary:
    """The stage's work: data, policy, tokens, training, the saved checkpoint; returns its summary."""
    from transformers import set_seed

    from rlcli.generation.hf_sampler import _eos_ids
    from rlcli.models.loading import load_policy

    recipe = ctx.recipe
    # Data first: a malformed file fails in a second, before any model loads.
    conversations = load_conversations(ctx)

    # The LoRA matrices are initialised from the global RNG: seed it so a run is reproducible.
    set_seed(recipe.run.seed)
    model, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization, trainable=True)
    processor = vision.processor_of(tokenizer)  # a vision-language model's; None for a text model
    pictures: dict[str, Any] = {}
    if processor is None:  # image parts reach a text model's template as its rollouts do: unseen
        examples, truncated = encode_conversations(
            tokenizer, conversations, recipe.model.max_length, _eos_ids(model, tokenizer)
        )
    else:
        keep = None if recipe.env.keep_images == "all" else recipe.env.keep_images
        conversations, pictures = with_images(ctx.rundb, conversations)
        examples, truncated = encode_image_conversations(
            processor, conversations, recipe.model.max_length, _eos_ids(model, tokenizer), keep
        )
    train_rows, eval_rows = split_examples(examples, recipe.sft.eval_fraction, recipe.run.seed)
    if truncated:
        ctx.console.print(
            f"sft: {truncated} conversations were cut at model.max_length={recipe.model.max_length} tokens."
        )

    with stage_tracker(ctx, METRICS_STAGE) as tracker:  # run.trackers: each logging step mirrored there
        progress = RichProgress(ctx, METRICS_STAGE, tracker)
        floor = recipe.sft.min_entropy
        callbacks = [progress, RecipeLearningRate(), *([EntropyFloor(floor)] if floor is not None else [])]
        if processor is None:
            trainer = build_trainer(ctx, model, tokenizer, train_rows, eval_rows, callbacks)
        else:
            trainer = build_image_trainer(ctx, model, processor, pictures, train_rows, eval_rows, callbacks)
        ended = (lambda state: EntropyFloor.stopped_at(state, floor)) if floor is not None else None
        resumed_from_step = train_resuming(ctx, trainer, progress, ended)

    path, checkpoint_id = save_trained(ctx, trainer, tokenizer, SFT_STAGE, ctx.run_dir / "checkpoints" / "sft")
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    eval_losses = [h["eval_loss"] for h in history if "eval_loss" in h]
    entropies = [(h["step"], h["eval_entropy"]) for h in history if "eval_entropy" in h]
    return SftSummary(
        source=recipe.sft.source,
        examples=len(examples),
        train_examples=len(train_rows),
        eval_examples=len(eval_rows),
        truncated=truncated,
        steps=trainer.state.global_step,
        resumed_from_step=resumed_from_step,
        # Mean over every step, like the Trainer's train_loss, but from the log history that a
        # checkpoint carries, so a resumed run reports the whole run rather than its last part.
        train_loss=sum(losses) / len(losses) if losses else None,
        final_loss=losses[-1] if losses else None,
        eval_loss=eval_losses[-1] if eval_losses else None,
        eval_entropy_before=entropies[0][1] if entropies and entropies[0][0] == 0 else None,
        eval_entropy=entropies[-1][1] if entropies else None,
        stopped_at_min_entropy=floor is not None and EntropyFloor.stopped_at(trainer.state, floor),
        checkpoint_id=checkpoint_id,
        path=str(path),
    )


# --- data: where conversations come from --------------------------------------------------------


def load_conversations(ctx: RunContext) -> list[Conversation]:
    """The conversations sft.source names; a UsageError when there are none."""
    source = ctx.recipe.sft.source
    if source == "expert":
        conversations = expert_conversations(ctx)
    elif source == "episodes":
        conversations = episode_conversations(ctx)
    else:
        conversations = read_data_source(ctx.recipe.sft)
    if not conversations:
        raise UsageError(f"sft.source {source}: no conversations to train on.")
    return conversations


def expert_conversations(ctx: RunContext) -> list[Conversation]:
    """sft.demos episodes played by the env's expert (stage sft/demos), read back from the database."""
    from rlcli.engine.games import recipe_opponent
    from rlcli.engine.rollout import collect

    demos = ctx.recipe.sft.demos
    ctx.stage(
        SFT_DEMOS_STAGE,
        lambda: collect(
            ctx,
            stage=SFT_DEMOS_STAGE,
            policy=EXPERT,
            task_indices=list(range(demos)),
            group_size=1,
            split="train",
            progress_label="expert demos",
            opponent=recipe_opponent(ctx, None, stage=SFT_DEMOS_STAGE),
        ),
        {"demos": demos},
    )
    episodes = stage_episodes(ctx.store, SFT_DEMOS_STAGE)
    ok = [e for e in episodes if e.status == "ok"]
    if not ok:
        first_error = next((e.error for e in episodes if e.error), "no episodes")
        raise UsageError(
            f"env {ctx.recipe.env.name}: none of the {len(episodes)} expert demonstrations finished ({first_error}); "
            "does the env offer expert_action()?"
        )
    tools = _env_tools(ctx.recipe.env)
    return [Conversation(e.messages, f"episode {e.id}", tools) for e in ok]


def episode_conversations(ctx: RunContext) -> list[Conversation]:
    """Good training episodes of this run (or sft.from_run): finished, total reward >= sft.min_reward.

    The reward is the `total` of the newest label set that covers the episode, else its env return.
    Eval episodes are held-out tasks and never become training data. Identical transcripts (a
    group's samples that answered the same task the same way) are kept once.
    """
    cfg = ctx.recipe.sft
    source = RunStore(ctx.rundb, cfg.from_run) if cfg.from_run else ctx.store  # sft.from_run: another run's
    source.require_run()
    seen: set[str] = set()
    conversations = []
    tools = _env_tools(source.recipe().env)
    for labelled in episodes_for_sft(source):
        episode, transcript = labelled.episode, json.dumps(labelled.episode.messages)
        assert labelled.reward is not None  # episodes_for_sft falls back to the env return, then 0
        if labelled.reward < cfg.min_reward or transcript in seen:
            continue
        seen.add(transcript)
        conversations.append(Conversation(episode.messages, f"episode {episode.id} of run {source.run}", tools))
    if not conversations:
        raise UsageError(
            f"sft.source episodes: run {source.run!r} has no finished training episode with total reward >= "
            f"sft.min_reward ({cfg.min_reward}); roll some out, or lower sft.min_reward."
        )
    return conversations


def _env_tools(env_cfg: EnvSection) -> list[dict] | None:
    """The tool schemas the env shows the policy, so SFT renders prompts exactly as rollouts did."""
    from rlcli.envs.loading import load_env
    from rlcli.envs.tool_use import tool_use_spec
    from rlcli.envs.tools import close_toolboxes

    try:
        env = load_env(env_cfg.name, env_cfg.factory_kwargs(), tools=tool_use_spec(env_cfg, Path.cwd()))()
        return getattr(env, "tools", None) or None
    finally:
        close_toolboxes()  # the recipe's MCP servers, started to list their tools


# --- tokenisation: the assistant-only loss mask ----------------------------------------------------


# --- tokenisation with images: a vision-language model's conversations ------------------------------


# --- training -------------------------------------------------------------------------------------


def build_trainer(
    ctx: RunContext,
    model: PolicyModel,
    tokenizer: PreTrainedTokenizerBase,
    train_rows: list[dict],
    eval_rows: list[dict],
    callbacks: list[TrainerCallback],
) -> SFTTrainer:
    """TRL's SFTTrainer on pre-tokenised rows: it turns `assistant_masks` into labels (-100 elsewhere)."""
    import datasets
    from trl import SFTTrainer

    with quiet_datasets():  # the SFTTrainer builds the labels from them too
        trainer = SFTTrainer(
            model=model,  # already peft-wrapped by load_policy: no peft_config here
            args=sft_args(ctx, has_eval=bool(eval_rows)),
            train_dataset=datasets.Dataset.from_list(train_rows),
            eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    return without_log_printer(trainer)


def build_image_trainer(
    ctx: RunContext,
    model: PolicyModel,
    processor: ProcessorMixin,
    pictures: dict[str, Any],
    train_rows: list[dict],
    eval_rows: list[dict],
    callbacks: list[TrainerCallback],
) -> SFTTrainer:
    """SFTTrainer for a vision-language model, on rows pre-tokenised with their images and ImageBatches.

    Not TRL's own VLM collation (DataCollatorForVisionLanguageModeling): it renders and tokenises each
    whole conversation in the collator, where the rollout tokenises turn by turn (token boundaries
    at the joins may differ from what the policy sees when it acts), and its assistant-only loss
    needs `{% generation %}` markers in the chat template, which SmolVLM's and tiny-random-vlm's lack.
    The Trainer still does everything else: optimiser, schedule, checkpoints, resume, eval loss.
    """
    import datasets
    from trl import SFTTrainer

    args = sft_args(ctx, has_eval=bool(eval_rows))
    # The rows are ready: TRL is not to tokenise them again, nor drop the column naming their images.
    args.dataset_kwargs = {"skip_prepare_dataset": True}
    args.remove_unused_columns = False
    # ImageBatches puts the pixels on the model's device already; only CPU tensors can be pinned.
    args.dataloader_pin_memory = False
    features = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int64")),
            "assistant_masks": datasets.List(datasets.Value("int8")),
            "image_hashes": datasets.List(datasets.Value("string")),
        }
    )
    trainer = SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(train_rows, features=features),
        eval_dataset=datasets.Dataset.from_list(eval_rows, features=features) if eval_rows else None,
        processing_class=processor,  # checkpoints then hold the image processor too
        data_collator=ImageBatches(processor, pictures, model),
        callbacks=callbacks,
    )
    return without_log_printer(trainer)


@dataclass
class ImageBatches:
    """Pads pre-tokenised rows on the right, makes labels of their assistant tokens (-100 elsewhere)
    and adds the pixels of their images, in the order their tokens appear, row after row."""

    processor: ProcessorMixin
    pictures: dict[str, Any]  # sha256 -> PIL image
    model: PolicyModel

    def __call__(self, rows: list[dict]) -> dict[str, Any]:
        import torch

        longest = max(len(row["input_ids"]) for row in rows)
        pad = self.processor.tokenizer.pad_token_id
        ids = torch.full((len(rows), longest), pad, dtype=torch.long)
        attention = torch.zeros((len(rows), longest), dtype=torch.long)
        labels = torch.full((len(rows), longest), -100, dtype=torch.long)
        for i, row in enumerate(rows):
            row_ids = torch.tensor(row["input_ids"], dtype=torch.long)
            n = len(row_ids)
            ids[i, :n], attention[i, :n] = row_ids, 1
            labels[i, :n] = torch.where(torch.tensor(row["assistant_masks"]) > 0, row_ids, -100)
        images = [self.pictures[sha] for row in rows for sha in row["image_hashes"]]
        # With the ids, an M-RoPE model (Qwen2-VL) also gets what its forward needs for its 3-D positions.
        pixels = vision.pixel_inputs(self.processor, images, self.model, input_ids=ids)
        return {"input_ids": ids, "attention_mask": attention, "labels": labels, **pixels}


def sft_args(ctx: RunContext, *, has_eval: bool) -> SFTConfig:
    from trl import SFTConfig

    cfg = ctx.recipe.sft
    return trainer_args(
        SFTConfig,
        ctx,
        cfg,
        ctx.run_dir / "sft",
        per_device_eval_batch_size=cfg.micro_batch_size,
        # Evaluating at every checkpoint (and at the end) puts eval_loss into the state a resume restores;
        # evaluating before the first step too gives the held-out entropy SFT started from.
        eval_strategy="steps" if has_eval else "no",
        eval_steps=cfg.save_steps,
        eval_on_start=has_eval,
    )


class EntropyFloor(TrainerCallback):
    """sft.min_entropy: stops training at the first evaluation whose held-out entropy is below the floor.
    Evaluations fall on checkpoint steps, and the Trainer saves after it evaluates, so that step's
    checkpoint holds the weights SFT ends with and, in its log history, the evaluation that stopped it."""

    def __init__(self, floor: float) -> None:
        self.floor = floor

    @staticmethod
    def stopped_at(state: TrainerState, floor: float) -> bool:
        """Whether the evaluation at `state`'s own step (a checkpoint's, or the end's) was below the floor."""
        return any(
            h.get("step") == state.global_step and h["eval_entropy"] < floor
            for h in state.log_history
            if "eval_entropy" in h and h.get("step", 0) > 0
        )

    def on_evaluate(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if state.global_step > 0 and self.stopped_at(state, self.floor):
            control.should_training_stop = True


class RichProgress(StageProgress):
    """The sft stage's progress bar and metrics: the loss, and the eval loss on the held-out share."""

    section = "sft"
    logged = LOGGED
    shown = {"loss": "sft/loss", "eval": "sft/eval_loss"}
