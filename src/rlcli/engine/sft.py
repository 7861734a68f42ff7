"""`rlcli sft`: supervised warm-start of the policy, before GRPO.

The stage reads top to bottom: data (conversations from a file, the env's expert, or a run's good
episodes), setup (the policy as the recipe loads it), tokenisation with an assistant-only loss mask,
training with TRL's SFTTrainer, and saving the adapter as the run's `sft` checkpoint, which
`train grpo` and `eval --checkpoint sft` start from.

Resuming: the Trainer checkpoints into <run>/sft/checkpoint-N every sft.save_steps optimizer steps
(weights, optimizer, scheduler, RNG, log history); a killed stage restarts from the newest complete
one. Expert demonstrations are their own stage (sft/demos), committed in chunks, so a resumed run
never rolls them out twice.
"""

from __future__ import annotations

import json
import math
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Heavy (torch), but this module is only imported by the commands that train.
from transformers import TrainerCallback

from rlcli.errors import RlcliError, UsageError

DEMOS_STAGE = "sft/demos"
METRICS_STAGE = "sft"
ROLES = ("system", "user", "assistant", "tool")
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
# Trainer log keys -> metric keys in the run database.
LOGGED = {"loss": "sft/loss", "eval_loss": "sft/eval_loss", "learning_rate": "sft/lr", "grad_norm": "sft/grad_norm"}


@dataclass
class Conversation:
    """One SFT example: a chat transcript and which of its assistant replies are trained on."""

    messages: list[dict[str, Any]]
    origin: str  # where it came from, for error messages: "data.jsonl row 3", "episode 17"
    tools: list[dict[str, Any]] | None = None
    first_trained: int = 0  # assistant replies before this message index are context (a prompt's few-shot turns)


# --- the stage ------------------------------------------------------------------------------


def run_sft(ctx) -> dict[str, Any]:
    """`rlcli sft`: train the policy on conversations, record the result as checkpoint `sft`."""
    cfg = ctx.recipe.sft
    if cfg.source == "none":
        raise UsageError("sft.source is none: set it to expert, episodes, or a data file or folder to run SFT.")
    if cfg.batch_size % cfg.micro_batch_size:
        raise UsageError(
            f"sft.batch_size ({cfg.batch_size}) must be a multiple of sft.micro_batch_size ({cfg.micro_batch_size})."
        )
    summary = ctx.stage("sft", lambda: train_sft(ctx), cfg.model_dump(mode="json"))
    print_summary(ctx, summary)
    return summary


def train_sft(ctx) -> dict[str, Any]:
    """The stage's work: data, policy, tokens, training, the saved checkpoint; returns its summary."""
    from transformers import set_seed

    from rlcli.models.loading import load_policy, save_checkpoint
    from rlcli.engine.sampling import _eos_ids

    recipe = ctx.recipe
    # Data first: a malformed file fails in a second, before any model loads.
    conversations = load_conversations(ctx)

    # The LoRA matrices are initialised from the global RNG: seed it so a run is reproducible.
    set_seed(recipe.run.seed)
    model, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization, trainable=True)
    examples, truncated = encode_conversations(
        tokenizer, conversations, recipe.model.max_length, _eos_ids(model, tokenizer)
    )
    train_rows, eval_rows = split_examples(examples, recipe.sft.eval_fraction, recipe.run.seed)
    if truncated:
        ctx.console.print(f"sft: {truncated} conversations were cut at model.max_length={recipe.model.max_length} tokens.")

    progress = RichProgress(ctx)
    trainer = build_trainer(ctx, model, tokenizer, train_rows, eval_rows, [progress])
    resume = resume_point(Path(trainer.args.output_dir))
    if resume is not None:
        ctx.console.print(f"sft: resuming from {resume}")
    try:
        trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    finally:
        progress.close()

    path = save_checkpoint(trainer.model, tokenizer, ctx.run_dir / "checkpoints" / "sft")
    history = trainer.state.log_history
    losses = [h["loss"] for h in history if "loss" in h]
    eval_losses = [h["eval_loss"] for h in history if "eval_loss" in h]
    return {
        "source": recipe.sft.source,
        "examples": len(examples),
        "train_examples": len(train_rows),
        "eval_examples": len(eval_rows),
        "truncated": truncated,
        "steps": trainer.state.global_step,
        "resumed_from_step": int(resume.name.removeprefix("checkpoint-")) if resume else 0,
        # Mean over every step, like the Trainer's train_loss, but from the log history that a
        # checkpoint carries, so a resumed run reports the whole run rather than its last part.
        "train_loss": sum(losses) / len(losses) if losses else None,
        "final_loss": losses[-1] if losses else None,
        "eval_loss": eval_losses[-1] if eval_losses else None,
        "checkpoint_id": record_checkpoint(ctx, path, "lora" if recipe.lora is not None else "full"),
        "path": str(path),
    }


def record_checkpoint(ctx, path: Path, kind: str) -> int:
    # A crash between this row and the stage's "done" mark re-runs the stage: reuse the row.
    for row in ctx.rundb.checkpoints(ctx.run):
        if row["stage"] == "sft" and row["path"] == str(path):
            return row["id"]
    return ctx.rundb.add_checkpoint(ctx.run, "sft", 0, path, kind)


# --- data: where conversations come from --------------------------------------------------------


def load_conversations(ctx) -> list[Conversation]:
    """The conversations sft.source names; a UsageError when there are none."""
    source = ctx.recipe.sft.source
    if source == "expert":
        conversations = expert_conversations(ctx)
    elif source == "episodes":
        conversations = episode_conversations(ctx)
    else:
        conversations = read_conversations(Path(source).expanduser())
    if not conversations:
        raise UsageError(f"sft.source {source}: no conversations to train on.")
    return conversations


def expert_conversations(ctx) -> list[Conversation]:
    """sft.demos episodes played by the env's expert (stage sft/demos), read back from the database."""
    from rlcli.engine.rollout import EXPERT, collect

    demos = ctx.recipe.sft.demos
    ctx.stage(
        DEMOS_STAGE,
        lambda: collect(ctx, stage=DEMOS_STAGE, policy_label=EXPERT, task_indices=list(range(demos)),
                        group_size=1, split="train", progress_label="expert demos"),
        {"demos": demos},
    )
    rows = list(ctx.rundb.db.query(
        "select id, status, messages, error from episodes where run = ? and stage = ? order by id",
        [ctx.run, DEMOS_STAGE],
    ))
    ok = [r for r in rows if r["status"] == "ok"]
    if not ok:
        first_error = next((r["error"] for r in rows if r["error"]), "no episodes")
        raise UsageError(
            f"env {ctx.recipe.env.name}: none of the {len(rows)} expert demonstrations finished ({first_error}); "
            "does the env offer expert_action()?"
        )
    tools = _env_tools(ctx.recipe.env)
    return [Conversation(json.loads(r["messages"]), f"episode {r['id']}", tools) for r in ok]


def episode_conversations(ctx) -> list[Conversation]:
    """Good training episodes of this run (or sft.from_run): finished, total reward >= sft.min_reward.

    The reward is the `total` of the newest label set that covers the episode, else its env return.
    Eval episodes are held-out tasks and never become training data. Identical transcripts (a
    group's samples that answered the same task the same way) are kept once.
    """
    cfg = ctx.recipe.sft
    run = cfg.from_run or ctx.run
    ctx.rundb.require_run(run)
    rows = ctx.rundb.db.query(
        """select e.id, e.messages, coalesce(
               (select r.value from rewards r where r.episode_id = e.id and r.component = 'total'
                order by r.id desc limit 1),
               e.env_return, 0) as reward
           from episodes e where e.run = ? and e.status = 'ok' and e.split = 'train' order by e.id""",
        [run],
    )
    seen: set[str] = set()
    conversations = []
    tools = _env_tools(ctx.rundb.run_recipe(run).env)
    for row in rows:
        if row["reward"] < cfg.min_reward or row["messages"] in seen:
            continue
        seen.add(row["messages"])
        conversations.append(Conversation(json.loads(row["messages"]), f"episode {row['id']} of run {run}", tools))
    if not conversations:
        raise UsageError(
            f"sft.source episodes: run {run!r} has no finished training episode with total reward >= "
            f"sft.min_reward ({cfg.min_reward}); roll some out, or lower sft.min_reward."
        )
    return conversations


def _env_tools(env_cfg) -> list[dict] | None:
    """The tool schemas the env shows the policy, so SFT renders prompts exactly as rollouts did."""
    from rlcli.envs.base import load_env

    return getattr(load_env(env_cfg.name, env_cfg.kwargs)(), "tools", None) or None


def read_conversations(path: Path) -> list[Conversation]:
    """Rows of a JSONL / JSON / parquet file or a `datasets` folder, checked and made conversations.

    A row holds `messages` (a chat), or `prompt` and `completion` (two strings, or two lists of
    messages), and optionally `tools`. Row numbers in errors are line numbers for JSONL and
    1-based positions otherwise.
    """
    return [conversation_from_row(row, f"{path}: row {number}") for number, row in read_rows(path)]


def read_rows(path: Path) -> list[tuple[int, Any]]:
    if path.is_dir():
        return list(enumerate(_dataset_rows(path), 1))
    if not path.is_file():
        raise UsageError(
            f"sft.source: {path} is not none, expert, episodes, or an existing data file or folder."
        )
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _jsonl_rows(path, path.read_text())
    if suffix == ".json":
        text = path.read_text()
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            # datasets' to_json writes one object per line, even into a .json file.
            return _jsonl_rows(path, text)
        return list(enumerate(data if isinstance(data, list) else [data], 1))
    if suffix == ".parquet":
        import pyarrow
        import pyarrow.parquet

        try:
            return list(enumerate(pyarrow.parquet.read_table(path).to_pylist(), 1))
        except pyarrow.ArrowException as exc:
            raise UsageError(f"{path}: not a readable parquet file ({exc}).") from None
    raise UsageError(
        f"sft.source: {path} has an unknown suffix; expected {', '.join(FILE_SUFFIXES)}, "
        "or a folder written by datasets' save_to_disk."
    )


def _jsonl_rows(path: Path, text: str) -> list[tuple[int, Any]]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rows.append((number, json.loads(line)))
        except json.JSONDecodeError as exc:
            raise UsageError(f"{path}: row {number}: expected one JSON object per line ({exc.msg}).") from None
    return rows


def _dataset_rows(path: Path) -> list[dict]:
    from datasets import DatasetDict, load_from_disk

    try:
        data = load_from_disk(str(path))
    except FileNotFoundError:
        raise UsageError(f"sft.source: {path} is not a folder written by datasets' save_to_disk.") from None
    if isinstance(data, DatasetDict):
        if "train" not in data:
            raise UsageError(f"sft.source: {path} is a DatasetDict without a train split (it has {', '.join(data)}).")
        data = data["train"]
    return list(data)


def conversation_from_row(row: Any, where: str) -> Conversation:
    if not isinstance(row, dict):
        raise UsageError(f"{where}: expected an object with `messages`, or `prompt` and `completion`; got {_kind(row)}.")
    if row.get("messages") is not None:
        messages, first_trained = _check_messages(row["messages"], where, "messages"), 0
    elif row.get("prompt") is not None and row.get("completion") is not None:
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            # rlcli trains chat policies: a plain pair is one user turn and the reply to it.
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            first_trained = 1
        elif isinstance(prompt, list) and isinstance(completion, list):
            prompt_messages = _check_messages(prompt, where, "prompt")
            messages = prompt_messages + _check_messages(completion, where, "completion")
            first_trained = len(prompt_messages)
        else:
            raise UsageError(
                f"{where}: expected `prompt` and `completion` to be both strings or both lists of messages; "
                f"got {_kind(prompt)} and {_kind(completion)}."
            )
    else:
        raise UsageError(f"{where}: expected `messages`, or `prompt` and `completion`; found {', '.join(sorted(row)) or 'no keys'}.")
    if messages[0]["role"] == "assistant":
        raise UsageError(f"{where}: expected the conversation to open with a system or user message, not an assistant reply.")
    if not any(m["role"] == "assistant" for m in messages[first_trained:]):
        part = "the completion" if first_trained else "the messages"
        raise UsageError(f"{where}: expected an assistant message in {part} to train on.")
    return Conversation(messages, where, _check_tools(row.get("tools"), where), first_trained)


def _check_messages(messages: Any, where: str, field: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise UsageError(f"{where}: expected `{field}` to be a non-empty list of messages; got {_kind(messages)}.")
    checked = []
    for number, message in enumerate(messages, 1):
        at = f"{where}: {field} message {number}"
        if not isinstance(message, dict):
            raise UsageError(f"{at}: expected an object with role and content; got {_kind(message)}.")
        # parquet and datasets fill keys that other rows have with None: they mean absent.
        message = {k: v for k, v in message.items() if v is not None}
        if message.get("role") not in ROLES:
            raise UsageError(f"{at}: expected role {', '.join(ROLES[:-1])} or {ROLES[-1]}; got {message.get('role')!r}.")
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            raise UsageError(f"{at}: expected `content` to be a string; got {_kind(content)}.")
        checked.append(message)
    return checked


def _check_tools(tools: Any, where: str) -> list[dict] | None:
    if isinstance(tools, str):  # TRL's convention: tools as a JSON string, which parquet stores easily
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{where}: `tools` is a string but not JSON ({exc.msg}).") from None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise UsageError(f"{where}: expected `tools` to be a list of tool schemas; got {_kind(tools)}.")
    return tools or None


def _kind(value: Any) -> str:
    names = {dict: "an object", list: "a list", str: "a string", type(None): "null", bool: "a boolean",
             int: "a number", float: "a number"}
    if isinstance(value, list) and not value:
        return "an empty list"
    return names.get(type(value), f"a {type(value).__name__}")


# --- tokenisation: the assistant-only loss mask ----------------------------------------------------


def tokenize_conversation(tokenizer, conversation: Conversation, end_ids: set[int]) -> tuple[list[int], list[int]]:
    """Token ids and a 0/1 loss mask that is 1 only on trained assistant replies.

    The conversation is rendered incrementally through the chat template: the messages before each
    trained reply with the generation prompt (context), then the messages through that reply (the
    reply). Each new piece of text is tokenised on its own and appended, which is how the rollout
    engine builds prompts, so SFT sees the token boundaries the policy sees when it acts. A reply
    is trained through its end-of-turn token (learning to stop); what the template adds after it
    (ChatML's newline) is context, as it is at rollout time.
    """
    messages = conversation.messages
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant" or index < conversation.first_trained:
            continue
        prompt = _render(tokenizer, messages[:index], conversation.tools, add_generation_prompt=True)
        turn = _render(tokenizer, messages[: index + 1], conversation.tools, add_generation_prompt=False)
        if not prompt.startswith(rendered) or not turn.startswith(prompt):
            raise UsageError(
                f"{conversation.origin}: the chat template renders earlier turns differently once later ones "
                "follow, so the assistant's tokens cannot be told apart; set model.chat_template to a template "
                "that renders each turn the same way whatever comes after it."
            )
        context = _encode(tokenizer, prompt[len(rendered):])
        reply = _encode(tokenizer, turn[len(prompt):])
        trained = next((i + 1 for i, tok in enumerate(reply) if tok in end_ids), len(reply))
        ids += context + reply
        mask += [0] * len(context) + [1] * trained + [0] * (len(reply) - trained)
        rendered = turn
    return ids, mask


def _render(tokenizer, messages: list[dict], tools: list[dict] | None, *, add_generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )


def _encode(tokenizer, text: str) -> list[int]:
    # The rendered text already holds every special token the template wants (as the rollout sees it).
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_conversations(
    tokenizer, conversations: list[Conversation], max_length: int, end_ids: set[int]
) -> tuple[list[dict[str, list[int]]], int]:
    """Pre-tokenised rows (`input_ids`, `assistant_masks`) cut at max_length, and how many were cut.

    A conversation whose first trained token lies beyond max_length has nothing left to learn
    from and is dropped; if that leaves nothing, the error says so.
    """
    rows, truncated = [], 0
    for conversation in conversations:
        ids, mask = tokenize_conversation(tokenizer, conversation, end_ids)
        if len(ids) > max_length:
            truncated += 1
            ids, mask = ids[:max_length], mask[:max_length]
        if 1 in mask:
            rows.append({"input_ids": ids, "assistant_masks": mask})
    if not rows:
        raise UsageError(
            f"Every SFT conversation's first assistant reply starts after model.max_length={max_length} tokens; "
            "raise model.max_length."
        )
    return rows, truncated


def split_examples(rows: list[dict], eval_fraction: float, seed: int) -> tuple[list[dict], list[dict]]:
    """A seeded held-out share for eval loss: at least one example when asked for, never all of them."""
    if eval_fraction == 0 or len(rows) < 2:
        return rows, []
    from rlcli.engine.rollout import derive_seed

    order = list(range(len(rows)))
    random.Random(derive_seed(seed, "sft/split")).shuffle(order)
    n_eval = min(max(1, round(len(rows) * eval_fraction)), len(rows) - 1)
    held = set(order[:n_eval])
    return [r for i, r in enumerate(rows) if i not in held], [rows[i] for i in sorted(held)]


# --- training -------------------------------------------------------------------------------------


def build_trainer(ctx, model, tokenizer, train_rows: list[dict], eval_rows: list[dict], callbacks: list):
    """TRL's SFTTrainer on pre-tokenised rows: it turns `assistant_masks` into labels (-100 elsewhere)."""
    import datasets
    from transformers import PrinterCallback
    from trl import SFTTrainer

    # Building labels from in-memory rows takes milliseconds; its progress bars would only be noise.
    quiet = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        trainer = SFTTrainer(
            model=model,  # already peft-wrapped by load_policy: no peft_config here
            args=sft_args(ctx, has_eval=bool(eval_rows)),
            train_dataset=datasets.Dataset.from_list(train_rows),
            eval_dataset=datasets.Dataset.from_list(eval_rows) if eval_rows else None,
            processing_class=tokenizer,
            callbacks=callbacks,
        )
    finally:
        if not quiet:
            datasets.enable_progress_bars()
    # disable_tqdm makes the Trainer print raw log dicts instead; the rich bar replaces both.
    trainer.remove_callback(PrinterCallback)
    return trainer


def sft_args(ctx, *, has_eval: bool) -> Any:
    import torch
    from trl import SFTConfig

    from rlcli.models.loading import resolve_device

    recipe, cfg = ctx.recipe, ctx.recipe.sft
    device = resolve_device(recipe.model.device)
    dtype = _training_dtype(recipe, device)
    return SFTConfig(
        output_dir=str(ctx.run_dir / "sft"),
        learning_rate=cfg.lr,
        num_train_epochs=cfg.epochs,
        per_device_train_batch_size=cfg.micro_batch_size,
        per_device_eval_batch_size=cfg.micro_batch_size,
        gradient_accumulation_steps=cfg.batch_size // cfg.micro_batch_size,
        max_length=recipe.model.max_length,
        save_strategy="steps",
        save_steps=cfg.save_steps,
        save_total_limit=2,
        # Evaluating at every checkpoint (and at the end) puts eval_loss into the state a resume restores.
        eval_strategy="steps" if has_eval else "no",
        eval_steps=cfg.save_steps,
        logging_steps=1,
        logging_nan_inf_filter=False,  # a non-finite loss must reach RichProgress, which stops the run
        report_to="none",
        disable_tqdm=True,
        seed=recipe.run.seed,
        use_cpu=device == "cpu",
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        # TRL turns it on by default; at the sizes rlcli trains on one machine it costs more time
        # than the memory it saves is worth.
        activation_checkpointing=False,
    )


def _training_dtype(recipe, device: str) -> Any:
    """The dtype the matmuls run in, which mixed precision should follow."""
    import torch

    from rlcli.models.loading import resolve_dtype

    if recipe.quantization.mode == "4bit":
        return getattr(torch, recipe.quantization.compute_dtype)
    dtype = resolve_dtype(recipe.model.dtype, device)
    # float16 autocast needs a GPU; on a CPU float16 weights train without it.
    return None if dtype == torch.float16 and device == "cpu" else dtype


def resume_point(output_dir: Path) -> Path | None:
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
            json.loads((folder / "trainer_state.json").read_text())
        except (OSError, json.JSONDecodeError):
            shutil.rmtree(folder)
            continue
        complete.append((int(step), folder))
    return max(complete)[1] if complete else None


class RichProgress(TrainerCallback):
    """A rich progress bar over optimizer steps; every logging step also goes to the run database."""

    def __init__(self, ctx):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.ctx = ctx
        self.progress = Progress(
            TextColumn("[bold]sft"), BarColumn(), MofNCompleteColumn(), TextColumn("steps"),
            TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), console=ctx.console,
        )
        self.task = None

    def on_train_begin(self, args, state, control, **kwargs):
        # On resume the state is the checkpoint's: the bar starts where training left off.
        self.task = self.progress.add_task("sft", total=state.max_steps, completed=state.global_step, loss="")
        self.progress.start()

    def on_step_end(self, args, state, control, **kwargs):
        self.progress.update(self.task, completed=state.global_step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        values = {key: logs[name] for name, key in LOGGED.items() if logs and logs.get(name) is not None}
        if not values:
            return
        loss = values.get("sft/loss")
        if loss is not None and not math.isfinite(loss):
            # Raised before the checkpoint of this step is written: the last checkpoint stays good.
            raise RlcliError(
                f"sft: the loss is {loss} at step {state.global_step}; stopped before saving. "
                "Lower sft.lr (or use float32 weights) and run again with --force."
            )
        self.ctx.rundb.log_metrics(self.ctx.run, METRICS_STAGE, state.global_step, values)
        shown = [f"loss {values['sft/loss']:.4g}" if "sft/loss" in values else "",
                 f"eval {values['sft/eval_loss']:.4g}" if "sft/eval_loss" in values else ""]
        self.progress.update(self.task, loss=" ".join(s for s in shown if s))

    def close(self) -> None:
        self.progress.stop()


# --- the summary ---------------------------------------------------------------------------------------


def print_summary(ctx, summary: dict[str, Any]) -> None:
    from rich.table import Table

    table = Table(title="sft", show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    rows = [
        ("source", summary.get("source")),
        ("examples (train / eval)", f"{summary.get('train_examples')} / {summary.get('eval_examples')}"),
        ("cut at max_length", summary.get("truncated")),
        ("steps", summary.get("steps")),
        ("resumed from step", summary.get("resumed_from_step") or None),
        ("train loss (mean / final)", f"{_fmt(summary.get('train_loss'))} / {_fmt(summary.get('final_loss'))}"),
        ("eval loss", _fmt(summary.get("eval_loss"))),
        ("checkpoint", f"sft (id {summary.get('checkpoint_id')}): {summary.get('path')}"),
    ]
    for name, value in rows:
        if value is not None:
            table.add_row(name, str(value))
    ctx.console.print(table)


def _fmt(value: Any) -> str:
    return "–" if value is None else f"{value:.4g}"
