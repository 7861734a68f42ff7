"""Where a GRPO iteration's episodes come from: one interface, two sources.

SyncRollouts (grpo.max_staleness 0) plays rollout/i here, with the weights of the update before
(grpo.dynamic_sampling: grpo.oversample times rollout.tasks tasks); with grpo.max_rollout_rounds > 1
it also plays the extra rounds rollout/i+r, label/i+r once label/i is done. AsyncRollouts (k > 0)
has a worker process (grpo/worker.py) play rollout/i+1..i+k while this process labels and
trains iteration i, and pushes it the new weights after each update.

The loop (grpo/loop.py) runs, inside `with source.running():`, per iteration i:
play(i) -> label/i -> refill(i) -> branch(i) -> before_update(i) -> train/i -> after_update(i).
The recipe refuses what the worker cannot play (grpo.dynamic_sampling, rollout.group_size_hard,
rollout.vllm_sleep true, GRPO phases) when it is loaded, with a sentence saying what to change.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch

from rlcli.engine.context import RunContext
from rlcli.engine.curriculum import extra_tasks, group_sizes, iteration_tasks
from rlcli.engine.games import recipe_opponent
from rlcli.engine.grpo.branches import play_branches
from rlcli.engine.grpo.checkpoints import checkpoint_folder, saves_checkpoint
from rlcli.engine.grpo.selection import carried_groups, group_keys, informative_groups
from rlcli.engine.grpo.staleness import START_VERSION, set_aside_stale
from rlcli.engine.grpo.worker import RolloutWorker, push_folder, thread_split
from rlcli.engine.labelling import GRPO_LABEL_SET, label_stage_episodes
from rlcli.engine.rollout import collect
from rlcli.generation.engines import generation_engine, make_sampler
from rlcli.generation.sampler import Sampler, sampling_config
from rlcli.models.loading import save_checkpoint
from rlcli.store.iterations import RolloutPlan
from rlcli.store.names import PolicyRef, grpo_label_stage, rollout_stage
from rlcli.store.records import EpisodeSummary
from rlcli.store.stages import stage_done

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rlcli.generation.vllm_engine import VllmEngine, VllmSampler
    from rlcli.rewards.scoring import RewardFn
    from rlcli.store.records import Checkpoint


@dataclass
class Rollout:
    """rollout/i as a source hands it over, with the seconds this process spent on its iteration."""

    summary: EpisodeSummary  # the rollout stage's result
    fresh: bool  # played now, not before a resume: only then do its timings describe the work
    timings: dict[str, float]  # perf/time_*_s: its rollout (or the wait for it), labelling, refill rounds
    sync_s: float | None = None  # the weight sync into the vLLM engine before it, done on resume too
    train_s: float | None = None  # train/i, up to its commit

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        start = time.perf_counter()
        yield
        self.timings[key] = time.perf_counter() - start

    def perf(self) -> dict[str, float]:
        """The iteration's perf/ metrics."""
        out: dict[str, float] = {}
        if self.fresh:
            tokens_per_s = self.summary.tokens / max(self.timings["perf/time_rollout_s"], 1e-9)
            out = {**self.timings, "perf/tokens_per_s": tokens_per_s}
        if self.sync_s is not None:
            out["perf/time_sync_s"] = self.sync_s
        if self.fresh and self.train_s is not None:
            out["perf/time_train_s"] = self.train_s
        return out


class Learner(Protocol):
    """What the rollouts read of the learner (grpo/learner.py's GrpoTrainer): the policy in memory, the
    phase's iterations and the weights each iteration plays. A protocol, so that the rollout side
    never imports the learner."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    first: int  # the phase's first iteration
    end: int  # one past its last
    next_iteration: int  # the first iteration left to run (after resume())
    resumed: Checkpoint | None  # the checkpoint the phase goes on from
    origin: Checkpoint | None  # the weights the phase starts from (None: the base model)
    start_policy: PolicyRef  # those weights as the first rollout's episodes record them

    def policy(self, it: int) -> PolicyRef:
        """The weights iteration it's rollouts play."""
        ...


class RolloutSource(Protocol):
    """An iteration's rollouts as the GRPO loop asks for them (see the module docstring)."""

    def running(self) -> contextlib.AbstractContextManager[None]:
        """The sampler or the worker, for the iterations the trainer has left (trainer.resume())."""
        ...

    def play(self, it: int) -> Rollout:
        """rollout/it, stored (played now, or before a resume)."""
        ...

    def refill(self, it: int, rollout: Rollout, reward_fns: list[RewardFn]) -> None:
        """After label/it: more rounds of rollouts while the iteration is short of informative groups."""
        ...

    def branch(self, it: int, rollout: Rollout, reward_fns: list[RewardFn]) -> None:
        """After the refill: grpo.branch's stage branch/it, continuations from stored turns of rollout/it."""
        ...

    def before_update(self, it: int) -> None:
        """Before train/it."""
        ...

    def after_update(self, it: int) -> None:
        """After train/it."""
        ...


def rollout_source(ctx: RunContext, trainer: Learner) -> RolloutSource:
    """grpo.max_staleness 0: SyncRollouts; k > 0: AsyncRollouts. Either refuses what it cannot play
    here, before the trainer loads anything."""
    if ctx.recipe.grpo.max_staleness:
        return AsyncRollouts(ctx, trainer)
    return SyncRollouts(ctx, trainer)


class SyncRollouts:
    """grpo.max_staleness 0: every rollout is played here, with the weights of the update before."""

    sampler: Sampler

    def __init__(self, ctx: RunContext, trainer: Learner) -> None:
        self.ctx, self.trainer = ctx, trainer
        self.uses_vllm = generation_engine(ctx.recipe) == "vllm"
        self.engine: VllmEngine | None = None  # the vLLM sampler's engine

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        recipe, trainer = self.ctx.recipe, self.trainer
        self.sampler = make_sampler(
            recipe, trainer.model, trainer.tokenizer, sampling_config(recipe.rollout), base=True
        )
        if self.uses_vllm:
            self.engine = cast("VllmSampler", self.sampler).engine
        yield

    def play(self, it: int) -> Rollout:
        """rollout/it with the weights in memory, synced into the vLLM engine first."""
        ctx = self.ctx
        tasks = iteration_tasks(ctx, it)  # grpo.sampling; a resumed iteration reuses its recorded draw
        sizes = group_sizes(ctx, it, rollout_stage(it), tasks)  # rollout.group_size_hard, recorded likewise
        set_aside_stale(ctx, it, 0)  # sampled ahead by an asynchronous run that is resumed synchronously
        fresh = not stage_done(ctx.store, rollout_stage(it))
        sync_s = self._sync_engine(it) if self.engine is not None else None
        start = time.perf_counter()
        summary = EpisodeSummary.from_dict(self._collect(it, rollout_stage(it), tasks, sizes, f"rollout {it}"))
        return Rollout(summary, fresh, {"perf/time_rollout_s": time.perf_counter() - start}, sync_s)

    def refill(self, it: int, rollout: Rollout, reward_fns: list[RewardFn]) -> None:
        """grpo.dynamic_sampling's extra rounds (_refill), timed as perf/time_refill_s."""
        if self.ctx.recipe.grpo.dynamic_sampling:
            with rollout.timed("perf/time_refill_s"):
                self._refill(it, reward_fns)

    def branch(self, it: int, rollout: Rollout, reward_fns: list[RewardFn]) -> None:
        """grpo.branch: stage branch/it (grpo/branches.py) with the policy in memory, timed as
        perf/time_branch_s."""
        if self.ctx.recipe.grpo.branch is not None:
            with rollout.timed("perf/time_branch_s"):
                policy, tokenizer = self.trainer.policy(it), self.trainer.tokenizer
                play_branches(self.ctx, it, self.sampler, tokenizer, policy, reward_fns)

    def before_update(self, it: int) -> None:
        """The vLLM engine sleeps through the update (rollout.vllm_sleep: the update gets its GPU
        memory; the next sync wakes it)."""
        if self.engine is not None:
            self.engine.sleep()

    def after_update(self, it: int) -> None:
        """Nothing: the next play syncs the new weights into the engine."""

    def _sync_engine(self, it: int) -> float:
        """Give the vLLM engine the weights of the last update (or, first, of the loaded checkpoint);
        return the seconds it took."""
        from rlcli.generation.vllm_engine import sync_weights

        start = time.perf_counter()
        # rollout.vllm_sync adapter: the last update's checkpoint folder, when saved, already holds the adapter
        # (not at a phase's first iteration: the model then comes from the stage before, e.g. DPO).
        cfg = self.ctx.recipe.grpo
        in_phase = it % cfg.iterations != 0
        saved = checkpoint_folder(self.ctx, it - 1) if in_phase and saves_checkpoint(cfg, it - 1) else None
        sync_weights(cast("VllmEngine", self.engine), self.trainer.model, adapter_folder=saved)
        return time.perf_counter() - start

    def _refill(self, it: int, reward_fns: list[RewardFn]) -> None:
        """grpo.dynamic_sampling: after rollout/it and label/it, extra rounds rollout/it+r and label/it+r
        (r = 1, 2, ...) of as many unplayed tasks as groups with unequal rewards are still missing (the
        groups carried from the iterations before count), until rollout.tasks of them are in hand or
        grpo.max_rollout_rounds is reached. Each round's tasks are recorded with its stage, so a resumed
        run replays the same ones."""
        ctx, recipe = self.ctx, self.ctx.recipe
        if recipe.grpo.max_rollout_rounds == 1:
            return
        stages = [rollout_stage(it)]
        played = list(iteration_tasks(ctx, it))
        carried = len(group_keys(carried_groups(ctx, it, self.trainer.first)))
        for r in range(1, recipe.grpo.max_rollout_rounds):
            short = recipe.rollout.tasks - carried - informative_groups(ctx, stages)
            if short <= 0:
                break
            stage = rollout_stage(it, r)
            tasks = extra_tasks(ctx, it, r, played, short)
            if not tasks:  # the pool holds no task this iteration has not played
                break
            sizes = group_sizes(ctx, it, stage, tasks)
            self._collect(it, stage, tasks, sizes, f"rollout {it}+{r}", round_=r)
            ctx.stage(grpo_label_stage(it, r), partial(label_stage_episodes, ctx, stage, GRPO_LABEL_SET, reward_fns))
            stages.append(stage)
            played += tasks

    def _collect(
        self, it: int, stage: str, tasks: list[int], sizes: dict[int, int], progress: str, round_: int = 0
    ) -> dict[str, Any]:
        """Play rollout `stage` of iteration it with the policy in memory, as a stage that records its tasks."""
        ctx = self.ctx
        return ctx.stage(
            stage,
            lambda: collect(
                ctx,
                stage=stage,
                policy=self.trainer.policy(it),
                sampler=self.sampler,
                tokenizer=self.trainer.tokenizer,
                task_indices=tasks,
                group_size=sizes,
                split="train",
                iteration=it,
                progress_label=progress,
                # env.opponent pool draws its checkpoint per iteration, the same one again on resume
                opponent=recipe_opponent(ctx, self.sampler, stage=stage, iteration=it),
            ),
            params=RolloutPlan(it, tasks, ctx.recipe.env.horizon(it), round_, list(sizes.values())).to_params(),
        )


class AsyncRollouts:
    """grpo.max_staleness k > 0: a worker process plays rollout/i+1..i+k while this process labels
    and trains iteration i, and gets the new weights after each update (grpo/worker.py)."""

    worker: RolloutWorker

    def __init__(self, ctx: RunContext, trainer: Learner) -> None:
        self.ctx, self.trainer = ctx, trainer
        # The worker's sampler would refuse the recipe's engine only once it has started.
        generation_engine(ctx.recipe)

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        trainer = self.trainer
        trainer_threads, worker_threads = thread_split(self.ctx.recipe.run.threads)
        torch.set_num_threads(trainer_threads)
        with RolloutWorker(self.ctx, worker_threads) as self.worker:
            self.ctx.console.print(
                f"train grpo: asynchronous, up to {self.ctx.recipe.grpo.max_staleness} updates stale; rollout worker "
                f"on {self.worker.device} ({worker_threads} threads), trainer on "
                f"{next(trainer.model.parameters()).device} ({trainer_threads} threads)"
            )
            # The weights the first rollouts play with: the checkpoint resumed from, else the starting point.
            if trainer.resumed:
                resumed = trainer.resumed.iteration
                self.worker.push(resumed, trainer.resumed.path, PolicyRef.train(resumed))
            else:
                origin = trainer.origin.path if trainer.origin is not None else None
                self.worker.push(START_VERSION, origin, trainer.start_policy)
            self.worker.ask_through(trainer.next_iteration)
            yield

    def play(self, it: int) -> Rollout:
        """Ask for rollout/it..it+k (those not asked for yet), then wait for rollout/it."""
        self.worker.ask_through(it)
        summary, timings, fresh = self.worker.wait(it)
        return Rollout(summary, fresh, timings)

    def refill(self, it: int, rollout: Rollout, reward_fns: list[RewardFn]) -> None:
        """Nothing: the recipe refuses grpo.dynamic_sampling with asynchronous rollouts."""

    def branch(self, it: int, rollout: Rollout, reward_fns: list[RewardFn]) -> None:
        """Nothing: the recipe refuses grpo.branch with asynchronous rollouts."""

    def before_update(self, it: int) -> None:
        """Nothing: the worker plays on during the update."""

    def after_update(self, it: int) -> None:
        """Push the new weights, unless the phase has no rollout left to play."""
        if it + 1 < self.trainer.end:
            self.worker.push(it, self._weights_folder(it), PolicyRef.train(it))

    def _weights_folder(self, it: int) -> Path:
        """The folder holding iteration it's weights: its checkpoint's, else a weights-only folder
        (grpo/worker.py removes those once the worker has moved on)."""
        if saves_checkpoint(self.ctx.recipe.grpo, it):
            return checkpoint_folder(self.ctx, it)
        return save_checkpoint(self.trainer.model, self.trainer.tokenizer, push_folder(self.ctx, it))
