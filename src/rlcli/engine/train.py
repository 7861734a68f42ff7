"""`rlcli train grpo`: online GRPO over multi-turn episodes, resumable exactly.

Per iteration i, three stages of the run:
  rollout/i  tasks x group_size episodes with the current policy (stored token by token)
  label/i    the recipe's reward functions applied to them (label set "grpo")
  train/i    advantages -> K epochs of clipped-ratio updates -> checkpoint -> metrics

Exact resume: the tasks of iteration i are fixed by i (the data cursor), every episode's sampling
seed is derived from (run seed, stage, task, sample), the shuffling and dropout seeds from
(run seed, iteration), and a checkpoint holds the adapter, the optimizer and the learning-rate
schedule. A resumed run reloads the newest readable checkpoint and redoes any later `train/i` from
stored rollouts, so it ends with the same weights and metrics as a run that was never interrupted.
An iteration's checkpoint row, metrics and `done` mark are committed together, once its checkpoint
folder is on disk (fsynced).

With rollout.engine vllm, the engine gets the policy's weights (LoRA merged in) before every
iteration's rollout, perf/time_sync_s. train/engine_logprob_gap is the mean |rollout logprob -
the trainer's logprob| over the trainable tokens, the mismatch that grpo.tis_cap corrects for.

What a resume may change (docs/database.md): grpo.lr and grpo.weight_decay take effect from the
next optimizer step, at the schedule's current position; a new number of optimizer steps (most
often grpo.iterations) spreads what is left of the schedule over the steps now left, so the
learning rate never jumps.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

# Heavy (torch), but this module is only imported by the commands that train.
from rlcli.engine import grpo
from rlcli.engine.context import RunContext
from rlcli.engine.labelling import GRPO_LABEL_SET
from rlcli.engine.rollout import (
    collect,
    derive_seed,
    generation_engine,
    make_sampler,
    reopen_for_retries,
    sampling_config,
)
from rlcli.errors import RlcliError
from rlcli.models.loading import fsync_folder
from rlcli.store.checkpoints import add_checkpoint, checkpoints, require_folder, train_checkpoints
from rlcli.store.episodes import episodes_for_training
from rlcli.store.records import Checkpoint, LabelledEpisode, Turn
from rlcli.store.stages import stage_done

LABEL_SET = GRPO_LABEL_SET
METRICS_STAGE = "grpo"
TRAINER_STATE = "trainer_state.pt"


@dataclass
class TrainSequence:
    """One training sequence: token ids, which of them are trainable, and their rollout logprobs."""

    episode_id: int
    group: int
    ids: list[int]
    mask: list[float]
    rollout_logprobs: list[float]
    turn_of_token: list[int]
    advantage: list[float] = field(default_factory=list)  # per token
    truncated: bool = False


# --- building sequences from stored episodes ----------------------------------------------


def episode_sequences(episode_id: int, group: int, turns: list[Turn]) -> list[TrainSequence]:
    """One sequence per episode when every turn's prompt extends the previous turn's tokens,
    else one per turn; either way exactly the tokens that were seen and sampled."""
    last = turns[-1]
    full = last.prompt_ids + last.completion_ids
    consistent = all(
        full[: len(t.prompt_ids)] == t.prompt_ids
        and full[len(t.prompt_ids) : len(t.prompt_ids) + len(t.completion_ids)] == t.completion_ids
        for t in turns
    )
    groups = [turns] if consistent else [[t] for t in turns]
    out = []
    for part in groups:
        ids = part[-1].prompt_ids + part[-1].completion_ids
        mask, logps, turn_of = [0.0] * len(ids), [0.0] * len(ids), [0] * len(ids)
        for t in part:
            start = len(t.prompt_ids)
            for j, lp in enumerate(t.logprobs):
                mask[start + j], logps[start + j], turn_of[start + j] = 1.0, lp, t.turn_index
        out.append(TrainSequence(episode_id, group, ids, mask, logps, turn_of))
    return out


# --- the loop ---------------------------------------------------------------------------------


def run_grpo(ctx: RunContext) -> None:
    import torch

    from rlcli.engine.labelling import label_stage_episodes
    from rlcli.engine.trackers import open_trackers
    from rlcli.models.loading import check_reference_possible, load_policy
    from rlcli.rewards.scoring import build_reward_fns

    recipe, cfg = ctx.recipe, ctx.recipe.grpo
    check_reference_possible(recipe.lora, cfg.beta)
    uses_vllm = generation_engine(recipe) == "vllm"
    reward_fns = build_reward_fns(recipe.rewards, device=recipe.model.device)

    resume, state = resume_point(ctx)
    start_iter = resume.iteration + 1 if resume else 0
    if start_iter >= cfg.iterations:
        ctx.console.print(f"train grpo: all {cfg.iterations} iterations are done.")
        return
    if resume:
        adapter = resume.path
    else:
        sft = [c for c in checkpoints(ctx.rundb, ctx.run) if c.stage == "sft"]
        adapter = sft[-1].path if sft else None
    torch.manual_seed(derive_seed(recipe.run.seed, "init"))  # a fresh LoRA adapter's random init
    model, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization, adapter=adapter, trainable=True)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = planned_schedule(cfg, cfg.epochs * _minibatches_per_epoch(recipe) * cfg.iterations, state)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _apply_recipe_hyperparameters(optimizer, scheduler, cfg, schedule)
    # Stages after the checkpoint were done with weights that were not saved: redo them.
    for it in range(start_iter, cfg.iterations):
        if stage_done(ctx.rundb, ctx.run, f"train/{it}"):
            ctx.rundb.mark_stage(ctx.run, f"train/{it}", "pending")
    sampling = sampling_config(recipe.rollout)
    sampler = make_sampler(recipe, model, tokenizer, sampling, base=True)
    view = MetricsView(ctx.console)
    start_label = f"checkpoint {resume.id}" if resume else ("sft" if adapter else "base")
    ctx.console.print(f"train grpo: iterations {start_iter}..{cfg.iterations - 1}, starting from {start_label}")
    with open_trackers(recipe.run.trackers, ctx.run, recipe.to_dict(), log_dir=ctx.run_dir) as tracker:
        for it in range(start_iter, cfg.iterations):
            timings: dict[str, float] = {}
            tasks = list(range(it * recipe.rollout.tasks, (it + 1) * recipe.rollout.tasks))
            fresh_rollout = not stage_done(ctx.rundb, ctx.run, f"rollout/{it}")
            # Episodes that timed out are played again, and labelled, before this iteration trains.
            if reopen_for_retries(ctx, f"rollout/{it}"):
                ctx.rundb.mark_stage(ctx.run, f"label/{it}", "pending")

            sync_s = None
            if uses_vllm:
                # The engine serves the weights of the last update (or, first, of the loaded checkpoint).
                from rlcli.engine.vllm_engine import sync_weights

                t0 = time.perf_counter()
                sync_weights(sampler.engine, model)
                sync_s = time.perf_counter() - t0

            t0 = time.perf_counter()
            rollout_summary = ctx.stage(
                f"rollout/{it}",
                lambda: collect(
                    ctx,
                    stage=f"rollout/{it}",
                    policy_label=f"train/{it - 1}" if it > 0 else start_label,
                    sampler=sampler,
                    tokenizer=tokenizer,
                    task_indices=tasks,
                    group_size=recipe.rollout.group_size,
                    split="train",
                    iteration=it,
                    progress_label=f"rollout {it}",
                ),
                params={"iteration": it, "tasks": [tasks[0], tasks[-1]]},
            )
            timings["perf/time_rollout_s"] = time.perf_counter() - t0

            t0 = time.perf_counter()
            ctx.stage(f"label/{it}", lambda: label_stage_episodes(ctx, f"rollout/{it}", LABEL_SET, reward_fns))
            timings["perf/time_label_s"] = time.perf_counter() - t0

            if fresh_rollout:
                timings["perf/tokens_per_s"] = rollout_summary.get("tokens", 0) / max(
                    timings["perf/time_rollout_s"], 1e-9
                )
            else:  # timings of a resumed iteration would describe the resume, not the work
                timings = {}
            if sync_s is not None:
                timings["perf/time_sync_s"] = sync_s
            t0 = time.perf_counter()

            def commit(result: dict[str, Any]) -> None:
                # In the transaction that marks train/{it} done, once its checkpoint folder is durable.
                if fresh_rollout:
                    timings["perf/time_train_s"] = time.perf_counter() - t0
                if saves_checkpoint(cfg, it):
                    kind = "lora" if recipe.lora is not None else "full"
                    add_checkpoint(ctx.rundb, ctx.run, f"train/{it}", it, checkpoint_folder(ctx, it), kind)
                ctx.rundb.log_metrics(
                    ctx.run, METRICS_STAGE, it, {**iteration_metrics(rollout_summary, result), **timings}
                )

            result = ctx.stage(
                f"train/{it}",
                lambda: train_iteration(ctx, model, tokenizer, optimizer, scheduler, schedule, it),
                params={"iteration": it},
                commit=commit,
            )
            metrics = {**iteration_metrics(rollout_summary, result), **timings}
            tracker.log(metrics, step=it)
            view.show(it, metrics)


def iteration_metrics(rollout_summary: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """An iteration's metrics, from its rollout stage's summary and its train stage's result."""
    return {
        "rollout/reward_mean": result.get("reward_mean"),
        "rollout/reward_std": result.get("reward_std"),
        "rollout/success_rate": rollout_summary.get("success_rate"),
        "rollout/return_mean": rollout_summary.get("return_mean"),
        "rollout/turns_mean": rollout_summary.get("turns_mean"),
        "rollout/failed": rollout_summary.get("failed"),
        **{k: v for k, v in result.items() if k.startswith("train/")},
    }


def train_iteration(
    ctx: RunContext, model, tokenizer, optimizer, scheduler, schedule: LrSchedule, it: int
) -> dict[str, Any]:
    """Advantages and K epochs of updates on iteration `it`'s stored rollouts; save a checkpoint."""
    import torch

    recipe, cfg = ctx.recipe, ctx.recipe.grpo
    episodes = episodes_for_training(ctx.rundb, ctx.run, f"rollout/{it}", LABEL_SET)
    if not episodes:
        raise RlcliError(
            f"Iteration {it} has no successfully finished, labelled episodes to train on "
            f"(see `rlcli runs show {ctx.run}` for failed episodes)."
        )
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
    groups = torch.tensor([e.episode.task_index for e in episodes])
    grpo.check_finite("the rewards", rewards)
    zero_var = grpo.zero_variance_groups(rewards, groups)
    stats: dict[str, Any] = {
        "train/lr": optimizer.param_groups[0]["lr"],  # what this iteration's first update uses
        "reward_mean": float(rewards.mean()),
        "reward_std": float(rewards.std(unbiased=False)),
        "train/zero_var_groups": int(len(set(groups[zero_var].tolist()))),
        "train/groups": int(len(set(groups.tolist()))),
    }

    if cfg.gamma is not None:
        turn_returns = [grpo.discounted_turn_returns(_turn_rewards(e), cfg.gamma) for e in episodes]
        turn_adv = grpo.turn_advantages(turn_returns, groups, cfg.advantage)
    else:
        adv = grpo.compute_advantages(rewards, groups, cfg.advantage)
        turn_adv = [[float(adv[i])] * len(e.episode.turns) for i, e in enumerate(episodes)]

    sequences: list[TrainSequence] = []
    for i, labelled in enumerate(episodes):
        ep = labelled.episode
        if cfg.drop_zero_var_groups and bool(zero_var[i]):
            continue
        if cfg.mask_truncated and ep.hit_a_cap:
            continue
        for seq in episode_sequences(ep.id, ep.task_index, ep.turns):
            seq.advantage = [turn_adv[i][t] for t in seq.turn_of_token]
            seq.truncated = ep.hit_a_cap
            sequences.append(seq)
    stats["train/sequences"] = len(sequences)

    if sequences:
        torch.manual_seed(derive_seed(recipe.run.seed, "dropout", it))  # dropout, if any, replays exactly
        model.train()
        update_stats = _update(ctx, model, optimizer, scheduler, sequences, it)
        stats.update(update_stats)
    else:  # every group had equal rewards, or every episode was masked: nothing to learn from
        stats["train/skipped"] = 1.0

    if saves_checkpoint(cfg, it):
        save_train_checkpoint(ctx, model, tokenizer, optimizer, scheduler, schedule, it)
    return stats


def _turn_rewards(labelled: LabelledEpisode) -> list[float]:
    """The env's per-step rewards, with whatever the labelled total adds beyond them (judges,
    penalties, weights) credited to the last turn, so the turn rewards sum to the total."""
    rewards = [t.reward or 0.0 for t in labelled.episode.turns]
    rewards[-1] += labelled.reward - sum(rewards)
    return rewards


def _update(ctx: RunContext, model, optimizer, scheduler, sequences: list[TrainSequence], it: int) -> dict[str, float]:
    import torch

    recipe, cfg = ctx.recipe, ctx.recipe.grpo
    temperature = sampling_config(recipe.rollout).logprob_temperature
    n_mb = _minibatches_per_epoch(recipe)
    needs_old = cfg.epochs > 1 or n_mb > 1
    old_logprobs = (
        _old_logprobs(model, sequences, cfg.micro_batch_size, temperature, not cfg.gradient_checkpointing)
        if needs_old
        else None
    )
    max_len_norm = recipe.rollout.max_new_tokens * recipe.env.max_turns
    totals: dict[str, float] = {}
    weight_sum = 0.0
    gap_sum = 0.0  # |rollout logprob - the trainer's|, over the first epoch's trainable tokens
    grad_norms = []
    for epoch in range(cfg.epochs):
        gen = torch.Generator().manual_seed(derive_seed(recipe.run.seed, "shuffle", it, epoch))
        order = torch.randperm(len(sequences), generator=gen).tolist()
        size = math.ceil(len(order) / n_mb)
        for mb_start in range(0, len(order), size):
            mb = order[mb_start : mb_start + size]
            mb_tokens = sum(sum(sequences[i].mask) for i in mb)
            mb_seqs = sum(1 for i in mb if any(sequences[i].mask))
            optimizer.zero_grad(set_to_none=True)
            for mc_start in range(0, len(mb), cfg.micro_batch_size):
                micro_idx = mb[mc_start : mc_start + cfg.micro_batch_size]
                micro = [sequences[i] for i in micro_idx]
                batch = _collate(micro, model, share_prefix=not cfg.gradient_checkpointing)
                logits = _forward(model, batch)
                logprobs = grpo.selective_log_softmax(logits / temperature, batch["targets"])
                with torch.no_grad():
                    entropy = grpo.entropy_from_logits(logits.detach() / temperature)
                old = (
                    _collate_values([old_logprobs[i] for i in micro_idx], batch)
                    if old_logprobs is not None
                    else logprobs.detach()
                )
                if epoch == 0:  # `old` is the trainer's logprob under the weights that sampled the rollout
                    gap_sum += float(((old - batch["rollout_logprobs"]).abs() * batch["mask"]).sum())
                ref = None
                if cfg.beta > 0:
                    from rlcli.models.loading import reference_context

                    with torch.no_grad(), reference_context(model):
                        ref = grpo.selective_log_softmax(_forward(model, batch) / temperature, batch["targets"])
                loss, st = grpo.policy_loss(
                    logprobs,
                    old,
                    batch["advantages"],
                    batch["mask"],
                    clip_low=cfg.clip_low,
                    clip_high=cfg.clip_high,
                    importance=cfg.importance,
                    aggregation=cfg.aggregation,
                    ref_logprobs=ref,
                    beta=cfg.beta,
                    rollout_logprobs=batch["rollout_logprobs"],
                    tis_cap=cfg.tis_cap,
                    entropy=entropy,
                    entropy_top_frac=cfg.entropy_top_frac,
                    max_len_norm=max_len_norm,
                )
                grpo.check_finite("the loss", loss)
                # Scale so that accumulated micro-batch gradients equal the minibatch's gradient.
                if cfg.aggregation == "token_mean":
                    share = float(batch["mask"].sum()) / max(mb_tokens, 1.0)
                else:
                    share = sum(1 for s in micro if any(s.mask)) / max(mb_seqs, 1)
                (loss * share).backward()
                w = float(batch["mask"].sum())
                weight_sum += w
                for k, v in st.items():
                    totals[k] = totals.get(k, 0.0) + float(v) * w
            grad_norm = torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], cfg.max_grad_norm
            )
            if not torch.isfinite(grad_norm):
                optimizer.zero_grad(set_to_none=True)
                raise RlcliError(
                    f"Iteration {it}: the gradient norm is {float(grad_norm)}; the update was stopped before the "
                    "optimizer step (try a lower grpo.lr or float32)."
                )
            grad_norms.append(float(grad_norm))
            optimizer.step()
            scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    out = {f"train/{k}": v / max(weight_sum, 1.0) for k, v in totals.items() if k != "tokens"}
    out["train/tokens"] = sum(sum(s.mask) for s in sequences)
    out["train/engine_logprob_gap"] = gap_sum / max(out["train/tokens"], 1)
    out["train/grad_norm"] = sum(grad_norms) / len(grad_norms)
    return out


def _collate(micro: list[TrainSequence], model, share_prefix: bool = True) -> dict[str, Any]:
    """A micro-batch as one shared prefix (forwarded once) plus left-padded suffixes; only the
    positions that end in trainable tokens are kept. share_prefix=False (gradient checkpointing,
    which cannot return a KV cache) forwards every row whole."""
    import torch

    device = next(model.parameters()).device
    prefix = _shared_prefix(micro) if share_prefix else 0
    width = max(len(s.ids) for s in micro) - prefix
    # The first trainable token over the batch, measured from the right: logits before it are not needed.
    keep = (
        max(len(s.ids) - next(i for i, m in enumerate(s.mask) if m) for s in micro if any(s.mask))
        if any(any(s.mask) for s in micro)
        else 1
    )
    B = len(micro)
    ids = torch.zeros((B, width), dtype=torch.long)
    attn = torch.zeros((B, width), dtype=torch.long)
    mask = torch.zeros((B, keep))
    adv = torch.zeros((B, keep))
    roll = torch.zeros((B, keep))
    for b, s in enumerate(micro):
        n = len(s.ids) - prefix
        ids[b, width - n :] = torch.tensor(s.ids[prefix:])
        attn[b, width - n :] = 1
        tail = slice(max(len(s.ids) - keep, 0), len(s.ids))
        k = tail.stop - tail.start
        mask[b, keep - k :] = torch.tensor(s.mask[tail])
        adv[b, keep - k :] = torch.tensor(s.advantage[tail])
        roll[b, keep - k :] = torch.tensor(s.rollout_logprobs[tail])
    # Padding sits between the prefix and each suffix; the mask hides it and positions skip it.
    pos = prefix + (attn.cumsum(-1) - 1).clamp(min=0)
    attn = torch.cat([torch.ones((B, prefix), dtype=torch.long), attn], dim=-1)
    return {
        "prefix_ids": torch.tensor([micro[0].ids[:prefix]], device=device) if prefix else None,
        "input_ids": ids.to(device),
        "attention_mask": attn.to(device),
        "position_ids": pos.to(device),
        "keep": keep,
        "targets": ids[:, width - keep :].to(device),
        "mask": mask.to(device),
        "advantages": adv.to(device),
        "rollout_logprobs": roll.to(device),
    }


def _shared_prefix(micro: list[TrainSequence], minimum: int = 16) -> int:
    """How many leading tokens every sequence shares (the group's prompt, often the system prompt
    of every task), stopping two tokens before the first trainable one so that every logit the
    loss needs comes from the per-row forward. 0 when sharing is not worth a separate forward."""
    if len(micro) < 2:
        return 0
    limit = min(next((i for i, m in enumerate(s.mask) if m), len(s.ids)) for s in micro) - 1
    first = micro[0].ids
    n = 0
    while n < limit and all(len(s.ids) > n and s.ids[n] == first[n] for s in micro):
        n += 1
    return n if n >= minimum else 0


def _collate_values(values: list, batch: dict[str, Any]):
    import torch

    keep = batch["keep"]
    out = torch.zeros((len(values), keep), device=batch["mask"].device)
    for b, v in enumerate(values):
        tail = v[-keep:]
        out[b, keep - len(tail) :] = tail
    return out


def _forward(model, batch: dict[str, Any]):
    """Logits predicting the last `keep` tokens of each row ([B, keep, V]). A shared prefix is
    forwarded once and its KV cache repeated for every row; gradients flow through it to all rows."""
    cache = None
    if batch["prefix_ids"] is not None:
        cache = model(input_ids=batch["prefix_ids"], use_cache=True, logits_to_keep=1).past_key_values
        cache.batch_repeat_interleave(batch["input_ids"].shape[0])
    out = model(
        input_ids=batch["input_ids"],
        attention_mask=batch["attention_mask"],
        position_ids=batch["position_ids"],
        past_key_values=cache,
        logits_to_keep=batch["keep"] + 1,
        use_cache=cache is not None,
    )
    return out.logits[:, :-1, :].float()


def _old_logprobs(
    model, sequences: list[TrainSequence], micro_batch_size: int, temperature: float, share_prefix: bool
) -> list:
    """Logprobs of every sequence under the weights at the start of the iteration (PPO's pi_old)."""
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, len(sequences), micro_batch_size):
            micro = sequences[start : start + micro_batch_size]
            batch = _collate(micro, model, share_prefix)
            lp = grpo.selective_log_softmax(_forward(model, batch) / temperature, batch["targets"])
            for b, s in enumerate(micro):
                n = min(len(s.ids), batch["keep"])
                out.append(lp[b, batch["keep"] - n :].cpu())
    return out


# --- schedule, checkpoints ------------------------------------------------------------


def _minibatches_per_epoch(recipe) -> int:
    episodes = recipe.rollout.tasks * recipe.rollout.group_size
    size = recipe.grpo.minibatch_size or episodes
    return max(1, math.ceil(episodes / size))


def saves_checkpoint(cfg, it: int) -> bool:
    return (it + 1) % cfg.checkpoint_every == 0 or it + 1 == cfg.iterations


def checkpoint_folder(ctx: RunContext, it: int) -> Path:
    return ctx.run_dir / "checkpoints" / f"iter-{it:04d}"


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


def planned_schedule(cfg, total_steps: int, state: dict[str, Any] | None) -> LrSchedule:
    """The recipe's schedule over `total_steps`; on resume, the checkpoint's, stretched over a new total."""
    total_steps = max(total_steps, 1)
    fresh = LrSchedule(cfg.schedule, cfg.warmup_steps, total_steps, total_steps)
    if state is None or "schedule" not in state:  # a fresh start, or a checkpoint from before rlcli stored it
        return fresh
    saved = replace(LrSchedule(**state["schedule"]), kind=cfg.schedule, warmup=cfg.warmup_steps)
    step = state["scheduler"]["last_epoch"]
    return saved if saved.end == total_steps or total_steps <= step else saved.stretched(step, total_steps)


def _apply_recipe_hyperparameters(optimizer, scheduler, cfg, schedule: LrSchedule) -> None:
    """The recipe's lr and weight decay rather than the checkpoint's, from the next step on, at the
    schedule's current position (loading the optimizer and scheduler state brought back the old ones)."""
    scheduler.base_lrs = [cfg.lr] * len(optimizer.param_groups)
    for group in optimizer.param_groups:
        group.update(
            initial_lr=cfg.lr, lr=cfg.lr * schedule.factor(scheduler.last_epoch), weight_decay=cfg.weight_decay
        )


def resume_point(ctx: RunContext) -> tuple[Checkpoint | None, dict[str, Any] | None]:
    """The newest GRPO checkpoint whose trainer state reads back, with that state; (None, None) to
    start afresh. One that a crash left unreadable is passed over, saying so: its iterations are redone."""
    import torch

    for checkpoint in reversed(train_checkpoints(ctx.rundb, ctx.run)):
        state_file = require_folder(checkpoint) / TRAINER_STATE
        try:
            return checkpoint, torch.load(state_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a cut-off or corrupt file: EOFError, RuntimeError, UnpicklingError, ...
            ctx.console.print(
                f"train grpo: checkpoint {checkpoint.id} ({state_file}) is unreadable "
                f"({type(exc).__name__}: {exc}); falling back to the one before it."
            )
    return None, None


def save_train_checkpoint(
    ctx: RunContext, model, tokenizer, optimizer, scheduler, schedule: LrSchedule, it: int
) -> None:
    """Write to a temporary folder, fsync it, rename it into place: a crash leaves either the old
    folder or the complete new one. Its row is written when the iteration commits."""
    import torch

    from rlcli.models.loading import save_checkpoint

    final = checkpoint_folder(ctx, it)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tokenizer, tmp)
    torch.save(
        {
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "schedule": asdict(schedule),
            "iteration": it,
        },
        tmp / TRAINER_STATE,
    )
    fsync_folder(tmp)
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)
    fsync_folder(final.parent, files=False)


# --- live view -----------------------------------------------------------------------


class MetricsView:
    """One line per iteration with the numbers a researcher watches."""

    COLUMNS = (
        ("iter", None),
        ("reward", "rollout/reward_mean"),
        ("success", "rollout/success_rate"),
        ("loss", "train/loss"),
        ("kl", "train/kl"),
        ("entropy", "train/entropy"),
        ("clip", "train/clip_frac_high"),
        ("|g|", "train/grad_norm"),
        ("0-var", "train/zero_var_groups"),
        ("tok/s", "perf/tokens_per_s"),
        ("t_roll", "perf/time_rollout_s"),
        ("t_train", "perf/time_train_s"),
    )

    def __init__(self, console):
        self.console = console
        self.header_shown = False

    def show(self, it: int, metrics: dict[str, Any]) -> None:
        if not self.header_shown:
            self.console.print(" ".join(f"{name:>8}" for name, _ in self.COLUMNS), style="bold")
            self.header_shown = True
        cells = [f"{it:>8}"]
        for _, key in self.COLUMNS[1:]:
            value = metrics.get(key)
            cells.append(f"{value:>8.3g}" if isinstance(value, (int, float)) else f"{'–':>8}")
        self.console.print(" ".join(cells), highlight=False)
