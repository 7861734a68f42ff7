"""`rlcli train grpo`: online GRPO over multi-turn episodes, resumable exactly.

Per iteration i, three stages of the run:
  rollout/i  tasks x group_size episodes with the current policy (stored token by token)
  label/i    the recipe's reward functions applied to them (label set "grpo")
  branch/i   grpo.branch: continuations sampled from stored turns, labelled (grpo/branches.py)
  train/i    advantages -> K epochs of clipped-ratio updates -> checkpoint -> metrics

_run_phase is that loop. The learner (policy, optimizer, learning-rate schedule, KL reference; its
setup, resume, one update per iteration, checkpoints) is grpo/learner.py's GrpoTrainer; the
rollouts come from a source (grpo/sources.py) that plays them here or in a worker process; what
an iteration trains on is chosen by grpo/selection.py and batched by grpo/batch.py.

Exact resume: the tasks of iteration i are fixed by i (engine/curriculum.py) and recorded with rollout/i,
every episode's sampling seed is derived from (run seed, stage, task, sample), the shuffling and
dropout seeds from (run seed, iteration), and a checkpoint holds the adapter, the optimizer and the learning-rate
schedule. A resumed run reloads the newest readable checkpoint and redoes any later `train/i` from
stored rollouts, so it ends with the same weights and metrics as a run that was never interrupted.
The rollouts that a redone iteration's lost weights played (grpo.checkpoint_every > 1) are superseded:
set aside and played again by the recomputed weights (grpo/resume.py, supersede_lost_rollouts).
An iteration's checkpoint row, metrics and `done` mark are committed together, once its checkpoint
folder is on disk (fsynced).

grpo.dynamic_sampling (DAPO) over-samples: rollout/i plays grpo.oversample x rollout.tasks tasks in
one batched generation (engine/curriculum.py, tasks_played), and train/i trains on rollout.tasks
groups, informative ones first: its own (training_batch), then, where they leave it short, those
carried from the iterations before (at most grpo.carry_staleness updates old, each trained once;
grpo/selection.py, carried_groups). With grpo.max_rollout_rounds > 1, rounds rollout/i+r, label/i+r after label/i
refill a batch still short of informative groups (grpo/sources.py, SyncRollouts), each
round's tasks recorded with its stage.

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

Distillation (`rlcli train distill`, run.stages' distill) is a phase of this loop with a teacher
(grpo/teacher.py): run_distill runs it as stage distill/<k> (phase 0 too), which records the teacher,
and each iteration gains teach/i after label/i, the teacher's logprobs of the episodes train/i trains
on; train/i's advantages are then per token (grpo/batch.py, teacher_advantages). grpo and distill
phases are numbered together.

grpo.max_staleness k > 0 (grpo/worker.py): a rollout worker process plays rollout/i+1..i+k
while this process labels and trains iteration i, and gets the new weights after each update; the
update weighs stale episodes against their recorded logprobs (decoupled PPO). k = 0 is the loop
above, unchanged.

What a resume may change (docs/database.md): grpo.lr and grpo.weight_decay take effect from the
next optimizer step, at the schedule's current position; a new number of optimizer steps (most
often grpo.iterations) spreads what is left of the schedule over the steps now left, so the
learning rate never jumps.
"""

from __future__ import annotations

import time
from typing import Any

from rlcli.engine import guardrails
from rlcli.engine.context import RunContext
from rlcli.engine.grpo.batch import build_batch
from rlcli.engine.grpo.checkpoints import saves_checkpoint
from rlcli.engine.grpo.evals import HeldOutEvals
from rlcli.engine.grpo.learner import METRICS_STAGE, GrpoTrainer
from rlcli.engine.grpo.metrics import MetricsView, iteration_metrics
from rlcli.engine.grpo.retention import prune_checkpoints
from rlcli.engine.grpo.selection import choose_groups
from rlcli.engine.grpo.sources import Rollout, rollout_source
from rlcli.engine.grpo.teacher import TeacherWeights, Teaching, check_tokenizer, resolve_teacher
from rlcli.engine.labelling import GRPO_LABEL_SET, label_stage_episodes
from rlcli.engine.memory import frees_on_failure
from rlcli.errors import UsageError
from rlcli.recipe import distill_problem
from rlcli.store.checkpoints import checkpoints
from rlcli.store.iterations import IterationStats
from rlcli.store.names import (
    DistillStage,
    GrpoStage,
    distill_phase_stage,
    grpo_label_stage,
    grpo_phase_stage,
    rollout_stage,
    train_stage,
    try_parse_stage,
)
from rlcli.store.records import Checkpoint, Stage


def run_grpo(ctx: RunContext, phase: int = 0) -> None:
    """GRPO phase `phase` (module docstring): 0 is `rlcli train grpo`; a later one (run.stages listing
    grpo again) runs as stage grpo/<phase>, so that once done it is skipped without loading a model."""
    check_phases(ctx)
    if (distilled := ctx.store.stage(distill_phase_stage(phase))) is not None:
        raise UsageError(
            f"Run {ctx.run!r}: phase {phase} of its training loop distills ({distilled.name}); run it with "
            "`rlcli train distill` (or `rlcli run` with the recipe's run.stages), or start a new run."
        )
    if phase == 0:
        _run_phase(ctx, 0, None, None)
        return
    name = grpo_phase_stage(phase)
    row = _phase_row(ctx, phase, name)
    start = phase_start(ctx, row)
    ctx.stage(
        name,
        lambda: _run_phase(ctx, phase, start, None),
        params={"start": None if start is None else start.id},
        identity=_phase_iterations(ctx, phase),
    )


def run_distill(ctx: RunContext, phase: int = 0) -> None:
    """Phase `phase` of the loop as on-policy distillation (grpo/teacher.py), run as stage distill/<phase>,
    which records the teacher it resolved when it began: a resumed phase is taught by the same weights."""
    if problem := distill_problem(ctx.recipe):
        raise UsageError(problem[0].upper() + problem[1:] + ".")
    check_phases(ctx)
    name = distill_phase_stage(phase)
    row = _phase_row(ctx, phase, name)
    if row is None and phase and ctx.store.stage(grpo_phase_stage(phase)) is not None:
        raise UsageError(f"Run {ctx.run!r}: phase {phase} of its training loop is GRPO; start a new run to distill.")
    start = phase_start(ctx, row) if phase else None  # phase 0 starts from the SFT checkpoint, as GRPO's
    teacher = TeacherWeights.from_params(row.params["teacher"]) if row and "teacher" in row.params else None
    teacher = teacher or resolve_teacher(ctx)
    check_tokenizer(ctx.recipe, teacher)  # before any of the phase's stages
    ctx.stage(
        name,
        lambda: _run_phase(ctx, phase, start, teacher),
        params={"start": None if start is None else start.id, "teacher": teacher.to_params()},
        identity={**_phase_iterations(ctx, phase), "distill.teacher": ctx.recipe.distill.teacher},
    )


def _phase_iterations(ctx: RunContext, phase: int) -> dict[str, int]:
    n = ctx.recipe.grpo.iterations
    return {"first_iteration": phase * n, "last_iteration": phase * n + n - 1}


def _phase_row(ctx: RunContext, phase: int, name: str) -> Stage | None:
    """The stage `name` around phase `phase`; refused when not recorded but its first iteration was run."""
    row, first = ctx.store.stage(name), phase * ctx.recipe.grpo.iterations
    if row is None and ctx.store.stage(rollout_stage(first)) is not None:
        raise UsageError(
            f"Run {ctx.run!r}: phase {phase} ({name}) would start at iteration {first}, which the run has already "
            "trained (in an earlier phase when grpo.iterations was larger, or with another of `rlcli train grpo` "
            "and `rlcli train distill`); set grpo.iterations back, or start a new run."
        )
    return row


def check_phases(ctx: RunContext) -> None:
    """Refuse a grpo.iterations that would move the iterations of a GRPO phase already begun."""
    n = ctx.recipe.grpo.iterations
    for row in ctx.store.stages():
        stage = try_parse_stage(row.name)
        if isinstance(stage, (GrpoStage, DistillStage)) and stage.phase and "first_iteration" in row.params:
            phase, first, last = stage.phase, row.params["first_iteration"], row.params["last_iteration"]
            if (first, last) != (phase * n, phase * n + n - 1):
                raise UsageError(
                    f"Run {ctx.run!r}: GRPO phase {phase} runs iterations {first}..{last}, and each phase runs "
                    f"grpo.iterations of them, numbered on from the phase before; set grpo.iterations back to "
                    f"{last - first + 1}, or start a new run."
                )


def phase_start(ctx: RunContext, row: Stage | None) -> Checkpoint | None:
    """The checkpoint a GRPO phase >= 1 starts from: the one its stage `row` recorded when it began,
    else the run's newest (None: the base model)."""
    known = checkpoints(ctx.store)
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


@frees_on_failure  # a failed phase's traceback keeps no policy, optimizer or reference alive
def _run_phase(ctx: RunContext, phase: int, start: Checkpoint | None, teacher: TeacherWeights | None) -> dict[str, Any]:
    """Iterations phase*N .. phase*N+N-1 (N = grpo.iterations), resumed where they stopped; phase 0
    starts from the SFT checkpoint (else the base model), a later one from `start`. With a teacher, the
    phase distills: teach/i scores each iteration's episodes, and train/i trains on those scores."""
    from rlcli.engine.trackers import send_unsent, stage_tracker
    from rlcli.rewards.scoring import build_reward_fns

    recipe = ctx.recipe
    trainer = GrpoTrainer(ctx, phase, start, "distill" if teacher else "grpo")
    rollouts = rollout_source(ctx, trainer)  # played here, or by a worker process ahead of the trainer
    reward_fns = build_reward_fns(recipe.rewards, device=recipe.model.device)
    summary = {
        "first_iteration": trainer.first,
        "last_iteration": trainer.end - 1,
        "start": None if start is None else start.id,
    }
    teaching = Teaching(ctx, teacher, trainer.first) if teacher is not None else None
    ctx.announce()  # before minutes of loading the policy and starting its engine
    iterations = trainer.resume()
    if not iterations:
        ctx.console.print(f"{trainer.title}: all {recipe.grpo.iterations} iterations are done.")
        HeldOutEvals(ctx, None, None).before(trainer)  # a kill may have cut off the last: loaded from disk
        send_unsent(ctx, METRICS_STAGE)  # and kept the last iteration's metrics, stored, from run.trackers
        prune_checkpoints(ctx, trainer.end - 1)  # and the pruning after it
        return summary
    try:
        trainer.setup()
        evals = HeldOutEvals(ctx, trainer.model, trainer.tokenizer)
        view = MetricsView(ctx.console, distills=teaching is not None)
        with (
            ctx.progress.running(ctx.run, ["distill" if teacher else "grpo"]),  # inside `rlcli run`, its bar instead
            stage_tracker(ctx, METRICS_STAGE) as tracker,
            rollouts.running(),
        ):
            evals.before(trainer)
            ctx.progress.steps(trainer.next_iteration - trainer.first, recipe.grpo.iterations, "iteration")
            for it in iterations:
                # plan and play: rollout/i, the iteration's tasks drawn and recorded, its episodes stored
                rollout = rollouts.play(it)
                with rollout.timed("perf/time_label_s"):  # label/i: the recipe's rewards for them
                    ctx.stage(
                        grpo_label_stage(it),
                        lambda: label_stage_episodes(ctx, rollout_stage(it), GRPO_LABEL_SET, reward_fns),
                    )
                rollouts.refill(it, rollout, reward_fns)  # grpo.dynamic_sampling: rounds while short of signal
                rollouts.branch(it, rollout, reward_fns)  # grpo.branch: branch/i, continuations from stored turns
                if teaching is not None:  # teach/i: the teacher's logprobs of what train/i trains on
                    with rollout.timed("perf/time_teach_s"):
                        teaching.teach(it)
                rollouts.before_update(it)  # a vLLM engine sleeps through the update
                # train/i: choose groups -> batch -> update -> save -> commit
                metrics = _train(ctx, trainer, it, rollout, distills=teaching is not None)
                rollouts.after_update(it)  # the rollout worker gets the new weights
                metrics |= evals.after(it)  # grpo.eval_every: the new checkpoint's held-out success
                tracker.log(metrics, step=it)  # log
                view.show(it, metrics)
                for warning in guardrails.check(ctx, it):  # once its metrics and held-out eval are stored
                    ctx.console.print(f"warning: {warning.message}", style="yellow", highlight=False)
                prune_checkpoints(ctx, it)  # grpo.keep_checkpoints, once the new checkpoint's eval is done
                ctx.progress.steps(it + 1 - trainer.first, recipe.grpo.iterations, "iteration")
    finally:
        # Failing or not, the policy, optimizer and schedule go with the phase: a failed iteration's
        # traceback, and the closures it holds, keep an empty learner.
        trainer.release()
        if teaching is not None:
            teaching.release()
    return summary


def _train(ctx: RunContext, trainer: GrpoTrainer, it: int, rollout: Rollout, distills: bool) -> dict[str, Any]:
    """Stage train/it: the groups it trains on, their batch, one update on it, and its checkpoint when
    one is due; committed, once that checkpoint folder is durable, with the checkpoint's row, the
    replays trained on and the iteration's metrics, which it returns."""
    started = time.perf_counter()

    def update_and_save() -> IterationStats:
        chosen = choose_groups(ctx, it, trainer.first)  # dynamic sampling, carried groups, replays
        stats = trainer.update(build_batch(ctx, chosen, trainer.rae_baselines, distills=distills))
        if saves_checkpoint(trainer.cfg, it):
            trainer.save(it)
        return stats

    def commit_iteration(stats: IterationStats) -> None:
        rollout.train_s = time.perf_counter() - started
        trainer.commit(it, stats, iteration_metrics(rollout, stats))

    stats = ctx.stage(
        train_stage(it), update_and_save, params={"iteration": it}, result=IterationStats, commit=commit_iteration
    )
    return iteration_metrics(rollout, stats)
