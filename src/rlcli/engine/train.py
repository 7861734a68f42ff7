"""`rlcli train grpo`: online GRPO over multi-turn episodes, resumable exactly.

Per iteration i, three stages of the run:
  rollout/i  tasks x group_size episodes with the current policy (stored token by token)
  label/i    the recipe's reward functions applied to them (label set "grpo")
  train/i    advantages -> K epochs of clipped-ratio updates -> checkpoint -> metrics

Exact resume: the tasks of iteration i are fixed by i (engine/curriculum.py) and recorded with rollout/i,
every episode's sampling seed is derived from (run seed, stage, task, sample), the shuffling and
dropout seeds from (run seed, iteration), and a checkpoint holds the adapter, the optimizer and the learning-rate
schedule. A resumed run reloads the newest readable checkpoint and redoes any later `train/i` from
stored rollouts, so it ends with the same weights and metrics as a run that was never interrupted.
An iteration's checkpoint row, metrics and `done` mark are committed together, once its checkpoint
folder is on disk (fsynced).

grpo.dynamic_sampling (DAPO) adds rounds rollout/i+r, label/i+r after label/i while fewer than
rollout.tasks groups have unequal rewards (_refill), each round's tasks recorded with its stage;
train/i trains on rollout.tasks of the groups, informative ones first (training_batch).

rollout.group_size_hard gives a task that the statistics of the iterations before rate as hard
rollout.group_size_hard samples instead of rollout.group_size (engine/curriculum.py, group_sizes),
recorded with the rollout stage. Groups are then unequal; the advantages are per group (its own mean,
std and size), and every episode counts once in the loss.

grpo.eval_every adds eval stages (engine/evaluate.py, TrainingEvals): the starting point's first,
then eval/ckpt-<id> after train/i for every n-th iteration's checkpoint and the last one, each
with the model in memory; eval/success_rate joins that iteration's metrics once it is done.

With rollout.engine vllm, the engine gets the policy's weights (LoRA merged in) before every
iteration's rollout, perf/time_sync_s. train/engine_logprob_gap is the mean |rollout logprob -
the trainer's logprob| over the trainable tokens, the mismatch that grpo.tis_cap corrects for.

Phases: a recipe's run.stages may list grpo more than once (sft -> grpo -> dpo -> grpo, VerIPO). With
N = grpo.iterations, phase k runs iterations k*N .. k*N+N-1: the numbering goes on from the phase
before, so every stage name (rollout/i, label/i, train/i), sampling seed, task draw, metric step and
checkpoint folder stays the run's own. Phase 0 is `rlcli train grpo`; phase k >= 1 runs inside stage
grpo/k, which records its iterations and its start: the weights of the run's newest checkpoint when
it began (the DPO stage's; the phase before's last when DPO mined no pairs), with a fresh optimizer
and learning-rate schedule. Its KL anchor stays what grpo.reference names (the SFT checkpoint or
the base model), never the DPO checkpoint. Once phase 1 has begun, grpo.iterations is fixed.

grpo.max_staleness k > 0 (engine/async_rollout.py): a rollout worker process plays rollout/i+1..i+k
while this process labels and trains iteration i, and gets the new weights after each update; the
update weighs stale episodes against their recorded logprobs (decoupled PPO). k = 0 is the loop
above, unchanged.

What a resume may change (docs/database.md): grpo.lr and grpo.weight_decay take effect from the
next optimizer step, at the schedule's current position; a new number of optimizer steps (most
often grpo.iterations) spreads what is left of the schedule over the steps now left, so the
learning rate never jumps.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

# Heavy (torch), but this module is only imported by the commands that train.
from rlcli.engine import grpo, guardrails
from rlcli.engine.async_rollout import push_folder, set_aside_stale, staleness
from rlcli.engine.context import RunContext
from rlcli.engine.curriculum import extra_tasks, group_sizes, iteration_tasks
from rlcli.engine.labelling import GRPO_LABEL_SET
from rlcli.engine.rollout import collect
from rlcli.engine.update import TrainSequence, minibatches_per_epoch, update
from rlcli.errors import RlcliError, UsageError
from rlcli.generation.engines import generation_engine, make_sampler
from rlcli.generation.sampler import sampling_config
from rlcli.generation.seeds import derive_seed
from rlcli.models.loading import fsync_folder, replace_folder
from rlcli.store.checkpoints import add_checkpoint, checkpoints, require_folder, train_checkpoints
from rlcli.store.episodes import episodes_for_training, set_aside_count
from rlcli.store.records import Checkpoint, LabelledEpisode, Turn
from rlcli.store.replays import record_replays, replay_candidates
from rlcli.store.stages import stage_done

LABEL_SET = GRPO_LABEL_SET
METRICS_STAGE = "grpo"
TRAINER_STATE = "trainer_state.pt"


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
        out.append(TrainSequence(episode_id, group, ids, mask, logps, turn_of, images=part[-1].images))
    return out


# --- the loop ---------------------------------------------------------------------------------


def run_grpo(ctx: RunContext, phase: int = 0) -> None:
    """GRPO phase `phase` (module docstring): 0 is `rlcli train grpo`; a later one (run.stages listing
    grpo again) runs as stage grpo/<phase>, so that once done it is skipped without loading a model."""
    check_phases(ctx)
    if phase == 0:
        _run_phase(ctx, 0, None)
        return
    n = ctx.recipe.grpo.iterations
    first, name = phase * n, f"grpo/{phase}"
    row = ctx.rundb.stage(ctx.run, name)
    if row is None and ctx.rundb.stage(ctx.run, f"rollout/{first}") is not None:
        raise UsageError(
            f"Run {ctx.run!r}: GRPO phase {phase} would start at iteration {first}, which an earlier phase has "
            "already run (grpo.iterations was larger then); set grpo.iterations back, or start a new run."
        )
    start = phase_start(ctx, row)
    ctx.stage(
        name,
        lambda: _run_phase(ctx, phase, start),
        params={"start": None if start is None else start.id},
        identity={"first_iteration": first, "last_iteration": first + n - 1},
    )


def check_phases(ctx: RunContext) -> None:
    """Refuse a grpo.iterations that would move the iterations of a GRPO phase already begun."""
    n = ctx.recipe.grpo.iterations
    for row in ctx.rundb.stages(ctx.run):
        phase = row.name.removeprefix("grpo/")
        if row.name.startswith("grpo/") and phase.isdigit() and "first_iteration" in row.params:
            first, last = row.params["first_iteration"], row.params["last_iteration"]
            if (first, last) != (int(phase) * n, int(phase) * n + n - 1):
                raise UsageError(
                    f"Run {ctx.run!r}: GRPO phase {phase} runs iterations {first}..{last}, and each phase runs "
                    f"grpo.iterations of them, numbered on from the phase before; set grpo.iterations back to "
                    f"{last - first + 1}, or start a new run."
                )


def phase_start(ctx: RunContext, row) -> Checkpoint | None:
    """The checkpoint a GRPO phase >= 1 starts from: the one its stage `row` recorded when it began,
    else the run's newest (None: the base model)."""
    known = checkpoints(ctx.rundb, ctx.run)
    if row is not None and "start" in row.params:
        if row.params["start"] is None:
            return None
        found = next((c for c in known if c.id == row.params["start"]), None)
        if found is None:
            raise UsageError(
                f"Run {ctx.run!r}: {row.name} started from checkpoint {row.params['start']}, which is no longer "
                "recorded; restore it, or start a new run."
            )
        return found
    return known[-1] if known else None


def _run_phase(ctx: RunContext, phase: int, start: Checkpoint | None) -> dict[str, Any]:
    """Iterations phase*N .. phase*N+N-1 (N = grpo.iterations), resumed where they stopped; phase 0
    starts from the SFT checkpoint (else the base model), a later one from `start`."""
    import torch

    from rlcli.engine.labelling import label_stage_episodes
    from rlcli.engine.trackers import open_trackers
    from rlcli.models.loading import attach_reference, check_reference_possible, load_policy
    from rlcli.rewards.scoring import build_reward_fns

    recipe, cfg = ctx.recipe, ctx.recipe.grpo
    check_reference_possible(recipe.lora, cfg.beta)
    uses_vllm = generation_engine(recipe) == "vllm"
    reward_fns = build_reward_fns(recipe.rewards, device=recipe.model.device)

    first, end = phase * cfg.iterations, (phase + 1) * cfg.iterations
    summary = {"first_iteration": first, "last_iteration": end - 1, "start": None if start is None else start.id}
    title = f"train grpo phase {phase}" if phase else "train grpo"
    resume, state = resume_point(ctx, first)
    start_iter = resume.iteration + 1 if resume else first
    if start_iter >= end:
        ctx.console.print(f"{title}: all {cfg.iterations} iterations are done.")
        if cfg.eval_every:  # a kill may have cut off the last eval: it loads its checkpoint from disk
            from rlcli.engine.evaluate import TrainingEvals

            evals_before(ctx, TrainingEvals(ctx, None, None, METRICS_STAGE), first, min(start_iter, end), resume)
        return summary
    if resume:
        adapter = resume.path
    elif phase:
        adapter = start.path if start is not None else None
    else:
        sft = [c for c in checkpoints(ctx.rundb, ctx.run) if c.stage == "sft"]
        adapter = sft[-1].path if sft else None
    torch.manual_seed(derive_seed(recipe.run.seed, "init"))  # a fresh LoRA adapter's random init
    reference = reference_checkpoint(ctx, state)  # before minutes of loading: a refused one stops here
    model, tokenizer = load_policy(recipe.model, recipe.lora, recipe.quantization, adapter=adapter, trainable=True)
    if cfg.beta > 0 and reference is not None:
        attach_reference(model, require_folder(reference))
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if hasattr(model, "enable_input_require_grads"):
            model.enable_input_require_grads()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    schedule = planned_schedule(cfg, cfg.epochs * minibatches_per_epoch(recipe) * cfg.iterations, state)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule.factor)
    if state:
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        _apply_recipe_hyperparameters(optimizer, scheduler, cfg, schedule)
    # Stages after the checkpoint were done with weights that were not saved: redo them.
    for it in range(start_iter, end):
        if stage_done(ctx.rundb, ctx.run, f"train/{it}"):
            ctx.rundb.mark_stage(ctx.run, f"train/{it}", "pending")
    view = MetricsView(ctx.console)
    # The policy label of the phase's first rollout: the stage that wrote the weights it starts from.
    start_label = (start.stage if start else "base") if phase else ("sft" if adapter else "base")
    shown = f"{start_label} (checkpoint {start.id})" if start else start_label
    shown = f"checkpoint {resume.id}" if resume else shown
    anchor = f", KL to {'sft' if reference else 'base'} (beta {cfg.beta:g})" if cfg.beta > 0 else ""
    ctx.console.print(f"{title}: iterations {start_iter}..{end - 1}, starting from {shown}{anchor}")
    worker = None
    if cfg.max_staleness:  # asynchronous GRPO: a worker process plays the rollouts (engine/async_rollout.py)
        from rlcli.engine.async_rollout import RolloutWorker, thread_split

        trainer_threads, worker_threads = thread_split(recipe.run.threads)
        torch.set_num_threads(trainer_threads)
        worker = RolloutWorker(ctx, worker_threads)
    else:
        sampler = make_sampler(recipe, model, tokenizer, sampling_config(recipe.rollout), base=True)
    # The worker first: whatever fails after it has started must stop it.
    with (
        worker if worker is not None else contextlib.nullcontext(),
        open_trackers(recipe.run.trackers, ctx.run, recipe.to_dict(), log_dir=ctx.run_dir) as tracker,
    ):
        if worker is not None:
            ctx.console.print(
                f"train grpo: asynchronous, up to {cfg.max_staleness} updates stale; rollout worker on "
                f"{worker.device} ({worker_threads} threads), trainer on {next(model.parameters()).device} "
                f"({trainer_threads} threads)"
            )
            # The weights the first rollouts play with: the checkpoint resumed from, else the starting point.
            if resume:
                worker.push(resume.iteration, resume.path, f"train/{resume.iteration}")
            else:
                worker.push(-1, adapter, "sft" if adapter else "base")
            worker.ask_through(start_iter)
        evals = None
        if cfg.eval_every:
            from rlcli.engine.evaluate import TrainingEvals

            evals = TrainingEvals(ctx, model, tokenizer, METRICS_STAGE)
            evals_before(ctx, evals, first, start_iter, resume)
        for it in range(start_iter, end):
            policy = f"train/{it - 1}" if it > first else start_label  # the weights this iteration plays
            sync_s = None
            if worker is not None:
                worker.ask_through(it)
                rollout_summary, timings, fresh_rollout = worker.wait(it)
            else:
                rollout_summary, timings, fresh_rollout, sync_s = _sync_rollout(
                    ctx, it, sampler, tokenizer, model, uses_vllm, policy
                )

            t0 = time.perf_counter()
            ctx.stage(f"label/{it}", lambda: label_stage_episodes(ctx, f"rollout/{it}", LABEL_SET, reward_fns))
            timings["perf/time_label_s"] = time.perf_counter() - t0
            if cfg.dynamic_sampling:
                t0 = time.perf_counter()
                _refill(ctx, it, sampler, tokenizer, reward_fns, policy)
                timings["perf/time_refill_s"] = time.perf_counter() - t0

            if fresh_rollout:
                timings["perf/tokens_per_s"] = rollout_summary.get("tokens", 0) / max(
                    timings["perf/time_rollout_s"], 1e-9
                )
            else:  # timings of a resumed iteration would describe the resume, not the work
                timings = {}
            if sync_s is not None:
                timings["perf/time_sync_s"] = sync_s
            if uses_vllm and worker is None:
                # rollout.vllm_sleep: the update gets the engine's GPU memory; the next sync wakes it.
                sampler.engine.sleep()
            t0 = time.perf_counter()

            def commit(result: dict[str, Any]) -> None:
                # In the transaction that marks train/{it} done, once its checkpoint folder is durable.
                if fresh_rollout:
                    timings["perf/time_train_s"] = time.perf_counter() - t0
                record_replays(ctx.rundb, ctx.run, it, [tuple(r) for r in result.get("replayed_episodes", [])])
                if saves_checkpoint(cfg, it):
                    kind = "lora" if recipe.lora is not None else "full"
                    add_checkpoint(ctx.rundb, ctx.run, f"train/{it}", it, checkpoint_folder(ctx, it), kind)
                ctx.rundb.log_metrics(
                    ctx.run, METRICS_STAGE, it, {**iteration_metrics(rollout_summary, result), **timings}
                )

            result = ctx.stage(
                f"train/{it}",
                lambda: train_iteration(ctx, model, tokenizer, optimizer, scheduler, schedule, it, reference),
                params={"iteration": it},
                commit=commit,
            )
            if worker is not None and it + 1 < end:
                worker.push(it, pushed_weights(ctx, model, tokenizer, it), f"train/{it}")
            metrics = {**iteration_metrics(rollout_summary, result), **timings}
            if evals is not None and evaluates_after(cfg, it):
                saved = [c for c in train_checkpoints(ctx.rundb, ctx.run) if c.stage == f"train/{it}"]
                metrics.update(evals.evaluate(saved[-1], it, in_memory=True))
            tracker.log(metrics, step=it)
            view.show(it, metrics)
            for warning in guardrails.check(ctx, it):  # once its metrics and held-out eval are stored
                ctx.console.print(f"warning: {warning.message}", style="yellow", highlight=False)
    return summary


def _sync_rollout(ctx: RunContext, it: int, sampler, tokenizer, model, uses_vllm: bool, policy_label: str):
    """The synchronous loop's rollout/it, played here with the weights in memory; returns its stage
    result, its timings, whether it was played now (not before a resume) and the vLLM sync's seconds."""
    recipe = ctx.recipe
    timings: dict[str, float] = {}
    tasks = iteration_tasks(ctx, it)  # grpo.sampling; a resumed iteration reuses its recorded draw
    sizes = group_sizes(ctx, it, f"rollout/{it}", tasks)  # rollout.group_size_hard, recorded likewise
    set_aside_stale(ctx, it, 0)  # sampled ahead by an asynchronous run that is resumed synchronously
    fresh_rollout = not stage_done(ctx.rundb, ctx.run, f"rollout/{it}")

    sync_s = None
    if uses_vllm:
        # The engine serves the weights of the last update (or, first, of the loaded checkpoint).
        from rlcli.generation.vllm_engine import sync_weights

        t0 = time.perf_counter()
        # rollout.vllm_sync adapter: the last update's checkpoint folder, when saved, already holds the adapter
        # (not at a phase's first iteration: the model then comes from the stage before, e.g. DPO).
        in_phase = it % recipe.grpo.iterations != 0
        saved = checkpoint_folder(ctx, it - 1) if in_phase and saves_checkpoint(recipe.grpo, it - 1) else None
        sync_weights(sampler.engine, model, adapter_folder=saved)
        sync_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    rollout_summary = ctx.stage(
        f"rollout/{it}",
        lambda: collect(
            ctx,
            stage=f"rollout/{it}",
            policy_label=policy_label,
            sampler=sampler,
            tokenizer=tokenizer,
            task_indices=tasks,
            group_size=sizes,
            split="train",
            iteration=it,
            progress_label=f"rollout {it}",
        ),
        params={
            "iteration": it,
            "tasks": tasks,
            "group_sizes": list(sizes.values()),
            "max_turns": recipe.env.horizon(it),
        },
    )
    timings["perf/time_rollout_s"] = time.perf_counter() - t0
    return rollout_summary, timings, fresh_rollout, sync_s


def _refill(ctx: RunContext, it: int, sampler, tokenizer, reward_fns, policy_label: str) -> None:
    """grpo.dynamic_sampling: after rollout/it and label/it, extra rounds rollout/it+r and label/it+r
    (r = 1, 2, ...) of as many unplayed tasks as groups with unequal rewards are still missing, until
    rollout.tasks of them are in hand or grpo.max_rollout_rounds is reached. Each round's tasks are
    recorded with its stage, so a resumed run replays the same ones."""
    from rlcli.engine.labelling import label_stage_episodes

    recipe = ctx.recipe
    stages = [f"rollout/{it}"]
    played = list(iteration_tasks(ctx, it))
    for r in range(1, recipe.grpo.max_rollout_rounds):
        short = recipe.rollout.tasks - _informative_groups(ctx, stages)
        if short <= 0:
            break
        stage = f"rollout/{it}+{r}"
        tasks = extra_tasks(ctx, it, r, played, short)
        if not tasks:  # the pool holds no task this iteration has not played
            break
        sizes = group_sizes(ctx, it, stage, tasks)
        ctx.stage(
            stage,
            lambda stage=stage, tasks=tasks, sizes=sizes: collect(
                ctx,
                stage=stage,
                policy_label=policy_label,
                sampler=sampler,
                tokenizer=tokenizer,
                task_indices=tasks,
                group_size=sizes,
                split="train",
                iteration=it,
                progress_label=f"rollout {it}+{r}",
            ),
            params={
                "iteration": it,
                "round": r,
                "tasks": tasks,
                "group_sizes": list(sizes.values()),
                "max_turns": recipe.env.horizon(it),
            },
        )
        ctx.stage(f"label/{it}+{r}", lambda stage=stage: label_stage_episodes(ctx, stage, LABEL_SET, reward_fns))
        stages.append(stage)
        played += tasks


def rollout_stages(ctx: RunContext, it: int) -> list[str]:
    """The rollout stages iteration it trains on: rollout/it, and with grpo.dynamic_sampling the extra
    rounds _refill finished (rollout/it+1, ...), within grpo.max_rollout_rounds."""
    stages = [f"rollout/{it}"]
    if ctx.recipe.grpo.dynamic_sampling:
        for r in range(1, ctx.recipe.grpo.max_rollout_rounds):
            if not stage_done(ctx.rundb, ctx.run, f"rollout/{it}+{r}"):
                break
            stages.append(f"rollout/{it}+{r}")
    return stages


def _informative_groups(ctx: RunContext, stages: list[str]) -> int:
    """How many groups of these rollout stages have unequal rewards under the GRPO labels."""
    episodes = [e for stage in stages for e in episodes_for_training(ctx.rundb, ctx.run, stage, LABEL_SET)]
    if not episodes:
        return 0
    groups = [e.episode.task_index for e in episodes]
    zero_var = grpo.zero_variance_groups([e.reward for e in episodes], groups)
    return len({g for g, flat in zip(groups, zero_var.tolist(), strict=True) if not flat})


def training_batch(episodes: list[LabelledEpisode], target: int) -> list[LabelledEpisode]:
    """grpo.dynamic_sampling: the episodes of `target` groups, those with unequal rewards first, in the
    order they were drawn (a round's episodes come after the round before's); zero-variance groups
    only fill what the rounds' cap left short."""
    groups: dict[int, list[LabelledEpisode]] = {}
    for e in episodes:
        groups.setdefault(e.episode.task_index, []).append(e)
    informative = [g for g, members in groups.items() if len({m.reward for m in members}) > 1]
    flat = [g for g in groups if g not in set(informative)]
    chosen = set((informative + flat)[:target])
    return [e for e in episodes if e.episode.task_index in chosen]


def pushed_weights(ctx: RunContext, model, tokenizer, it: int) -> Path:
    """The folder holding iteration it's weights for the rollout worker: its checkpoint's, else a
    weights-only folder (engine/async_rollout.py removes those once the worker has moved on)."""
    from rlcli.models.loading import save_checkpoint

    if saves_checkpoint(ctx.recipe.grpo, it):
        return checkpoint_folder(ctx, it)
    return save_checkpoint(model, tokenizer, push_folder(ctx, it))


def iteration_metrics(rollout_summary: dict[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """An iteration's metrics, from its rollout stage's summary and its train stage's result."""
    return {
        "rollout/reward_mean": result.get("reward_mean"),
        "rollout/reward_std": result.get("reward_std"),
        "rollout/success_rate": rollout_summary.get("success_rate"),
        "rollout/return_mean": rollout_summary.get("return_mean"),
        "rollout/turns_mean": rollout_summary.get("turns_mean"),
        "rollout/failed": rollout_summary.get("failed"),
        "rollout/replayed_lost": rollout_summary.get("replayed_lost"),
        **{k: v for k, v in result.items() if k.startswith(("train/", "perf/"))},
    }


def train_iteration(
    ctx: RunContext, model, tokenizer, optimizer, scheduler, schedule: LrSchedule, it: int, reference: Checkpoint | None
) -> dict[str, Any]:
    """Advantages and K epochs of updates on iteration `it`'s stored rollouts (rollout_stages; with
    grpo.dynamic_sampling, rollout.tasks groups picked by training_batch); save a checkpoint (which
    records `reference`, the KL anchor: an SFT checkpoint, or None for the base model)."""
    import torch

    recipe, cfg = ctx.recipe, ctx.recipe.grpo
    stages = rollout_stages(ctx, it)
    episodes = [e for stage in stages for e in episodes_for_training(ctx.rundb, ctx.run, stage, LABEL_SET)]
    drawn = len({e.episode.task_index for e in episodes})
    if cfg.dynamic_sampling:
        episodes = training_batch(episodes, recipe.rollout.tasks)
    if not episodes:
        raise RlcliError(
            f"Iteration {it} has no successfully finished, labelled episodes to train on "
            f"(see `rlcli runs show {ctx.run}` for failed episodes)."
        )
    replayed = replays_for(ctx, it, episodes) if cfg.replay is not None else []
    episodes = episodes + replayed
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
    if cfg.replay is not None:
        stats["train/replayed"] = len(replayed)
        stats["replayed_episodes"] = [[e.episode.id, e.episode.task_index] for e in replayed]  # for commit()
    if cfg.dynamic_sampling:
        stats["train/groups_drawn"] = drawn
        stats["train/rollout_rounds"] = len(stages)
    if recipe.rollout.group_size_hard is not None:
        stats["train/hard_groups"] = len(hard_tasks(ctx, stages) & {e.episode.task_index for e in episodes})
    lags = [staleness(it, e.episode.policy) for e in episodes]
    replay_ids = {e.episode.id for e in replayed}
    if cfg.max_staleness:  # of the iteration's own rollouts: replays are as old as they are by design
        played = lags[: len(episodes) - len(replayed)]
        stats["train/staleness_mean"] = sum(played) / len(played)
        stats["train/staleness_max"] = max(played)
    if discarded := set_aside_count(ctx.rundb, ctx.run, f"rollout/{it}"):
        stats["train/discarded_episodes"] = discarded

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
            seq.stale = lags[i] > 0 or ep.id in replay_ids  # a replay's behaviour policy is its recorded one
            sequences.append(seq)
    stats["train/sequences"] = len(sequences)

    if sequences:
        torch.manual_seed(derive_seed(recipe.run.seed, "dropout", it))  # dropout, if any, replays exactly
        model.train()
        update_stats = update(ctx, model, optimizer, scheduler, sequences, it)
        stats.update(update_stats)
    else:  # every group had equal rewards, or every episode was masked: nothing to learn from
        stats["train/skipped"] = 1.0

    if saves_checkpoint(cfg, it):
        save_train_checkpoint(ctx, model, tokenizer, optimizer, scheduler, schedule, it, reference)
    return stats


def hard_tasks(ctx: RunContext, stages: list[str]) -> set[int]:
    """The tasks these rollout stages played with rollout.group_size_hard samples (their recorded sizes)."""
    hard = set()
    for stage in stages:
        params = ctx.rundb.stage(ctx.run, stage).params
        sizes = params.get("group_sizes") or []
        hard |= {t for t, n in zip(params["tasks"], sizes) if n == ctx.recipe.rollout.group_size_hard}
    return hard


def replays_for(ctx: RunContext, it: int, episodes: list[LabelledEpisode]) -> list[LabelledEpisode]:
    """grpo.replay: for each group with no episode of total reward >= min_reward, up to max_per_group of
    that task's stored episodes from earlier iterations that reached it (store/replays.py)."""
    cfg = ctx.recipe.grpo.replay
    best: dict[int, float] = {}
    for e in episodes:
        best[e.episode.task_index] = max(best.get(e.episode.task_index, -math.inf), e.reward)
    out = []
    for task, reward in best.items():
        if reward < cfg.min_reward:
            out += replay_candidates(ctx.rundb, ctx.run, task, it, LABEL_SET, cfg.min_reward, cfg.max_per_group)
    return out


def _turn_rewards(labelled: LabelledEpisode) -> list[float]:
    """The env's per-step rewards, with whatever the labelled total adds beyond them (judges,
    penalties, weights) credited to the last turn, so the turn rewards sum to the total."""
    rewards = [t.reward or 0.0 for t in labelled.episode.turns]
    rewards[-1] += labelled.reward - sum(rewards)
    return rewards


# --- schedule, checkpoints ------------------------------------------------------------


def saves_checkpoint(cfg, it: int) -> bool:
    """Every checkpoint_every-th iteration, and the last of each GRPO phase (a multiple of grpo.iterations)."""
    return (it + 1) % cfg.checkpoint_every == 0 or (it + 1) % cfg.iterations == 0


def evals_before(ctx: RunContext, evals, first: int, start_iter: int, resume: Checkpoint | None) -> None:
    """In phase 0 (first = 0) the starting point's eval (SFT, else base), then those of the phase's
    checkpoints saved before start_iter that a kill cut off or that predate eval_every. The model in
    memory holds `resume`'s weights, else the starting point's; every other one is loaded from disk.
    A later phase's start (the DPO checkpoint) gets no eval here: its step would be the phase
    before's last; an eval stage after dpo in run.stages measures it."""
    if first == 0:
        sft = [c for c in checkpoints(ctx.rundb, ctx.run) if c.stage == "sft"]
        evals.evaluate(sft[-1] if sft else None, -1, in_memory=resume is None)
    for ckpt in train_checkpoints(ctx.rundb, ctx.run):
        if first <= ckpt.iteration < start_iter and evaluates_after(ctx.recipe.grpo, ckpt.iteration):
            evals.evaluate(ckpt, ckpt.iteration, in_memory=resume is not None and ckpt.id == resume.id)


def evaluates_after(cfg, it: int) -> bool:
    """grpo.eval_every: iteration it's checkpoint gets a held-out eval (every n iterations, and the last)."""
    due = (it + 1) % cfg.eval_every == 0 or (it + 1) % cfg.iterations == 0 if cfg.eval_every else False
    return due and saves_checkpoint(cfg, it)


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


def resume_point(ctx: RunContext, first: int = 0) -> tuple[Checkpoint | None, dict[str, Any] | None]:
    """The newest GRPO checkpoint from iteration `first` on (the phase's first) whose trainer state
    reads back, with that state; (None, None) to start the phase afresh. One that a crash left
    unreadable is passed over, saying so: its iterations are redone."""
    import torch

    own = [c for c in train_checkpoints(ctx.rundb, ctx.run) if c.iteration >= first]
    for checkpoint in reversed(own):
        state_file = require_folder(checkpoint) / TRAINER_STATE
        try:
            return checkpoint, torch.load(state_file, map_location="cpu", weights_only=True)
        except Exception as exc:  # a cut-off or corrupt file: EOFError, RuntimeError, UnpicklingError, ...
            ctx.console.print(
                f"train grpo: checkpoint {checkpoint.id} ({state_file}) is unreadable "
                f"({type(exc).__name__}: {exc}); falling back to the one before it."
            )
    return None, None


def reference_checkpoint(ctx: RunContext, state: dict[str, Any] | None) -> Checkpoint | None:
    """The KL anchor that grpo.reference names: the run's SFT checkpoint, or None for the base model
    (auto: sft when the run has one). A resumed run keeps the anchor its checkpoint recorded, so the
    KL term means the same thing throughout (checkpoints from before rlcli recorded it anchored to the
    base); a recipe that now names the other one is refused."""
    choice = ctx.recipe.grpo.reference
    run_checkpoints = checkpoints(ctx.rundb, ctx.run)
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
    sft = [c for c in run_checkpoints if c.stage == "sft"]
    if choice == "sft" and not sft:
        raise UsageError(
            f"grpo.reference is sft, but run {ctx.run!r} has no SFT checkpoint; run `rlcli sft` first "
            "or set grpo.reference: base (or auto)."
        )
    return sft[-1] if sft and choice != "base" else None


def save_train_checkpoint(
    ctx: RunContext,
    model,
    tokenizer,
    optimizer,
    scheduler,
    schedule: LrSchedule,
    it: int,
    reference: Checkpoint | None,
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
            "reference": reference.id if reference is not None else None,  # the KL anchor a resume keeps
        },
        tmp / TRAINER_STATE,
    )
    fsync_folder(tmp)
    replace_folder(tmp, final)


# --- live view -----------------------------------------------------------------------


class MetricsView:
    """One line per iteration with the numbers a researcher watches."""

    COLUMNS = (
        ("iter", None),
        ("reward", "rollout/reward_mean"),
        ("success", "rollout/success_rate"),
        ("held-out", "eval/success_rate"),
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
