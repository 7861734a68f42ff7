"""GRPO's learner: the policy and what updates it, one iteration at a time (engine/train.py runs the loop).

GrpoTrainer has a torchtune recipe's shape: `resume` finds where a phase goes on, `setup` loads the
policy, its KL reference, AdamW and the learning-rate schedule from there, `batch` builds an
iteration's IterationBatch from its stored, labelled episodes, `iteration` is one policy update on
it, `save` writes its checkpoint folder and `commit` the rows that go with it.

What is trained on is read from the run database inside stage train/i, never from what this process
played: a resumed iteration trains on exactly the episodes, groups and replays that an uninterrupted
run would have.
"""

from __future__ import annotations

import math
import shutil
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

# Heavy, but this module is only imported by the commands that train.
import torch

from rlcli.engine import grpo
from rlcli.engine.async_rollout import staleness
from rlcli.engine.context import RunContext
from rlcli.engine.labelling import GRPO_LABEL_SET
from rlcli.engine.update import TrainSequence, minibatches_per_epoch, update
from rlcli.errors import RlcliError, UsageError
from rlcli.generation.seeds import derive_seed
from rlcli.models.loading import (
    attach_reference,
    check_reference_possible,
    fsync_folder,
    load_policy,
    replace_folder,
    save_checkpoint,
)
from rlcli.store.checkpoints import add_checkpoint, checkpoints, require_folder, train_checkpoints
from rlcli.store.episodes import episodes_for_training, set_aside_count
from rlcli.store.names import BASE, GRPO_STAGE, SFT_STAGE, PolicyRef, rollout_stage, train_stage
from rlcli.store.records import Checkpoint, LabelledEpisode, Turn
from rlcli.store.replays import record_replays, replay_candidates
from rlcli.store.stages import stage_done

if TYPE_CHECKING:
    from torch.optim.lr_scheduler import LambdaLR
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from rlcli.recipe import GrpoSection

METRICS_STAGE = GRPO_STAGE
TRAINER_STATE = "trainer_state.pt"


@dataclass
class IterationBatch:
    """What train/i updates on (GrpoTrainer.batch)."""

    iteration: int
    sequences: list[TrainSequence]  # each with its per-token advantages
    reward_mean: float  # over the episodes trained on, replays included
    reward_std: float
    metrics: dict[str, float]  # train/: groups, zero-variance groups, sequences, staleness, ...
    replayed: list[tuple[int, int]] | None  # grpo.replay's (episode id, task) added; None: replay is off
    rae_baselines: dict[str, float] | None = None  # grpo.advantage rae: the baselines after this batch
    trained_groups: list[tuple[int, int]] | None = None  # grpo.dynamic_sampling: (iteration played, task) chosen


@dataclass
class IterationStats:
    """train/i's result, stored with its stage: the rewards of the episodes it trained on, its train/
    and perf/ metrics, and grpo.replay's episodes that it trained on again, which its commit records."""

    reward_mean: float
    reward_std: float
    metrics: dict[str, float]
    replayed: list[tuple[int, int]] | None = None  # (episode id, task); None: grpo.replay is off
    # grpo.dynamic_sampling: the groups it trained on, as (iteration that played it, task), so that the
    # iterations after it carry only the informative groups no iteration has trained on
    trained_groups: list[tuple[int, int]] | None = None

    def to_dict(self) -> dict[str, Any]:
        stored: dict[str, Any] = {"reward_mean": self.reward_mean, "reward_std": self.reward_std, **self.metrics}
        if self.replayed is not None:
            stored["replayed_episodes"] = [list(r) for r in self.replayed]
        if self.trained_groups is not None:
            stored["trained_groups"] = [list(g) for g in self.trained_groups]
        return stored

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> IterationStats:
        replayed, trained = data.get("replayed_episodes"), data.get("trained_groups")
        return cls(
            data["reward_mean"],
            data["reward_std"],
            {k: v for k, v in data.items() if k.startswith(("train/", "perf/"))},
            None if replayed is None else [(episode, task) for episode, task in replayed],
            None if trained is None else [(iteration, task) for iteration, task in trained],
        )


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

    def __init__(self, ctx: RunContext, phase: int, start: Checkpoint | None) -> None:
        self.ctx, self.cfg, self.phase = ctx, ctx.recipe.grpo, phase
        check_reference_possible(ctx.recipe.lora, self.cfg.beta)
        self.first, self.end = phase * self.cfg.iterations, (phase + 1) * self.cfg.iterations
        self.title = f"train grpo phase {phase}" if phase else "train grpo"
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
            _apply_recipe_hyperparameters(self.optimizer, self.scheduler, cfg, self.schedule)
        # Stages after the checkpoint were done with weights that were not saved: redo them.
        for it in range(self.next_iteration, self.end):
            if stage_done(self.ctx.rundb, self.ctx.run, train_stage(it)):
                self.ctx.rundb.mark_stage(self.ctx.run, train_stage(it), "pending")
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

    def batch(self, it: int) -> IterationBatch:
        """Iteration it's batch from its stored, labelled episodes: those of its rollout stages
        (rollout_stages; with grpo.dynamic_sampling, rollout.tasks groups picked by training_batch among
        them and the groups carried from the iterations before) and grpo.replay's, their advantages per
        group, and one training sequence per episode (or turn)."""
        ctx, recipe, cfg = self.ctx, self.ctx.recipe, self.cfg
        stages = rollout_stages(ctx, it)
        episodes = [e for stage in stages for e in drawn_episodes(ctx, stage)]
        trained_groups = None
        if cfg.dynamic_sampling:
            carried = carried_groups(ctx, it, self.first)
            drawn = len(group_keys(episodes + carried))
            # The iteration's own groups first: a carried one only fills what they leave short.
            episodes = training_batch(episodes + carried, recipe.rollout.tasks)
            trained_groups = sorted(group_keys(episodes))
        if not episodes:
            raise RlcliError(
                f"Iteration {it} has no successfully finished, labelled episodes to train on "
                f"(see `rlcli runs show {ctx.run}` for failed episodes)."
            )
        # A replay joins its task's group of this iteration, never a carried one.
        replayed = (
            replays_for(ctx, it, [e for e in episodes if e.episode.iteration == it]) if cfg.replay is not None else []
        )
        played_in = [e.episode.iteration for e in episodes] + [it] * len(replayed)
        episodes = episodes + replayed
        rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float64)
        groups = role_groups(episodes, played_in)
        grpo.check_finite("the rewards", rewards)
        zero_var = grpo.zero_variance_groups(rewards, groups)
        metrics: dict[str, float] = {
            "train/zero_var_groups": int(len(set(groups[zero_var].tolist()))),
            "train/groups": int(len(set(groups.tolist()))),
        }
        if cfg.replay is not None:
            metrics["train/replayed"] = len(replayed)
        if cfg.dynamic_sampling:
            metrics["train/groups_drawn"] = drawn
            metrics["train/carried"] = len({g for g in trained_groups or [] if g[0] != it})
            metrics["train/rollout_rounds"] = len(stages)
        if recipe.rollout.group_size_hard is not None:
            metrics["train/hard_groups"] = len(hard_tasks(ctx, stages) & {e.episode.task_index for e in episodes})
        lags = [staleness(it, e.episode.policy) for e in episodes]
        replay_ids = {e.episode.id for e in replayed}
        if cfg.max_staleness:  # of the iteration's own rollouts: replays are as old as they are by design
            played = lags[: len(episodes) - len(replayed)]
            metrics["train/staleness_mean"] = sum(played) / len(played)
            metrics["train/staleness_max"] = max(played)
        if discarded := set_aside_count(ctx.rundb, ctx.run, rollout_stage(it)):
            metrics["train/discarded_episodes"] = discarded

        rae = None
        if cfg.advantage == "rae":
            turn_returns = [
                grpo.discounted_turn_returns(_turn_rewards(e), cfg.gamma) if cfg.gamma is not None else []
                for e in episodes
            ]
            returns = [g[0] if g else float(rewards[i]) for i, g in enumerate(turn_returns)]
            roles = [role_of(e) for e in episodes]
            rae = grpo.rae_baselines(returns, roles, self.rae_baselines, cfg.rae_decay)
            turn_adv = [
                [g - rae[roles[i]] for g in turn_returns[i]]
                if cfg.gamma is not None
                else [returns[i] - rae[roles[i]]] * len(e.episode.turns)
                for i, e in enumerate(episodes)
            ]
            metrics.update({f"train/rae_baseline/{role}": rae[role] for role in sorted(set(roles))})
        elif cfg.gamma is not None:
            turn_returns = [grpo.discounted_turn_returns(_turn_rewards(e), cfg.gamma) for e in episodes]
            turn_adv = grpo.turn_advantages(turn_returns, groups, cfg.advantage)
        else:
            adv = grpo.compute_advantages(rewards, groups, cfg.advantage)
            turn_adv = [[float(adv[i])] * len(e.episode.turns) for i, e in enumerate(episodes)]

        sequences: list[TrainSequence] = []
        for i, labelled in enumerate(episodes):
            ep = labelled.episode
            if cfg.drop_zero_var_groups and cfg.advantage != "rae" and bool(zero_var[i]):
                continue
            if cfg.mask_truncated and ep.hit_a_cap:
                continue
            if not ep.turns:  # a seat whose game ended before it moved (the other's invalid move): no tokens
                continue
            assert ep.id is not None  # read from the database: every stored episode has its id
            for seq in episode_sequences(ep.id, ep.task_index, ep.turns):
                seq.advantage = [turn_adv[i][t] for t in seq.turn_of_token]
                seq.truncated = ep.hit_a_cap
                seq.stale = lags[i] > 0 or ep.id in replay_ids  # a replay's behaviour policy is its recorded one
                sequences.append(seq)
        metrics["train/sequences"] = len(sequences)
        return IterationBatch(
            it,
            sequences,
            float(rewards.mean()),
            float(rewards.std(unbiased=False)),
            metrics,
            [(_stored_id(e), e.episode.task_index) for e in replayed] if cfg.replay is not None else None,
            rae,
            trained_groups,
        )

    def iteration(self, batch: IterationBatch) -> IterationStats:
        """One policy update on `batch`: grpo.epochs passes of clipped-ratio steps (engine/update.py)."""
        # The learning rate this iteration's first step uses.
        metrics: dict[str, float] = {"train/lr": self.optimizer.param_groups[0]["lr"], **batch.metrics}
        if batch.rae_baselines is not None:  # what this iteration's checkpoint saves and the next one goes on from
            self.rae_baselines = batch.rae_baselines
        if batch.sequences:
            it = batch.iteration
            torch.manual_seed(derive_seed(self.ctx.recipe.run.seed, "dropout", it))  # dropout, if any, replays exactly
            self.model.train()
            metrics.update(update(self.ctx, self.model, self.optimizer, self.scheduler, batch.sequences, it))
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
        record_replays(ctx.rundb, ctx.run, it, stats.replayed or [])
        if saves_checkpoint(self.cfg, it):
            kind = "lora" if ctx.recipe.lora is not None else "full"
            add_checkpoint(ctx.rundb, ctx.run, train_stage(it), it, checkpoint_folder(ctx, it), kind)
        ctx.rundb.log_metrics(ctx.run, METRICS_STAGE, it, metrics)


# --- building the batch from stored episodes ------------------------------------------------


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


def role_of(labelled: LabelledEpisode) -> str:
    """An episode's role for grpo.advantage rae: its game and seat ("TicTacToe-v0/seat1"), from the task
    its env reported; an env without seats has one role per game (or one in all)."""
    task = labelled.episode.task or {}
    game = str(task.get("game", ""))
    return f"{game}/seat{task['seat']}" if "seat" in task else game


def role_groups(episodes: list[LabelledEpisode], played_in: list[int | None] | None = None) -> torch.Tensor:
    """The group of each episode: its task, and within a task its seat (two-player games), so that
    group-relative advantages compare an episode only with others that played the same role.
    played_in: the iteration whose group each episode belongs to (grpo.dynamic_sampling carries groups
    from earlier iterations, which may have played the same task); None: all the same."""
    origins = played_in if played_in is not None else [None] * len(episodes)
    keys = [
        (origin if origin is not None else -1, e.episode.task_index, (e.episode.task or {}).get("seat", -1))
        for e, origin in zip(episodes, origins, strict=True)
    ]
    dense = {key: i for i, key in enumerate(sorted(set(keys)))}
    return torch.tensor([dense[key] for key in keys])


def rollout_stages(ctx: RunContext, it: int) -> list[str]:
    """The rollout stages iteration it trains on: rollout/it, and with grpo.dynamic_sampling the extra
    rounds that SyncRollouts finished (rollout/it+1, ...), within grpo.max_rollout_rounds."""
    stages = [rollout_stage(it)]
    if ctx.recipe.grpo.dynamic_sampling:
        for r in range(1, ctx.recipe.grpo.max_rollout_rounds):
            if not stage_done(ctx.rundb, ctx.run, rollout_stage(it, r)):
                break
            stages.append(rollout_stage(it, r))
    return stages


def training_batch(episodes: list[LabelledEpisode], target: int) -> list[LabelledEpisode]:
    """grpo.dynamic_sampling: the episodes of `target` groups (a group: a task as one iteration played
    it), those with unequal rewards first, in the order given (the iteration's draw, a round's after
    the round before's, then carried groups); zero-variance groups only fill what is left short."""
    groups: dict[tuple[int, int], list[LabelledEpisode]] = {}
    for e in episodes:
        groups.setdefault(_group_key(e), []).append(e)
    informative = [g for g, members in groups.items() if _informative(members)]
    flat = [g for g in groups if g not in set(informative)]
    chosen = set((informative + flat)[:target])
    return [e for e in episodes if _group_key(e) in chosen]


def carried_groups(ctx: RunContext, it: int, first: int) -> list[LabelledEpisode]:
    """grpo.dynamic_sampling: the episodes of the informative groups that iterations it-k .. it-1 of
    the phase (k = grpo.carry_staleness) played and none trained on, oldest first. What each iteration
    trained on is read from its train stage's result; an iteration that did not record it (trained
    before rlcli carried groups) carries nothing from itself or before."""
    start = max(first, it - ctx.recipe.grpo.carry_staleness)
    trained: set[tuple[int, int]] = set()
    for k in range(start, it):
        row = ctx.rundb.stage(ctx.run, train_stage(k))
        result = row.result if row is not None and row.status == "done" else None
        recorded = (result or {}).get("trained_groups")
        if recorded is None:
            start, trained = k + 1, set()
            continue
        trained |= {(int(j), int(task)) for j, task in recorded}
    out = []
    for j in range(start, it):
        episodes = [e for stage in rollout_stages(ctx, j) for e in drawn_episodes(ctx, stage)]
        groups: dict[tuple[int, int], list[LabelledEpisode]] = {}
        for e in episodes:
            groups.setdefault(_group_key(e), []).append(e)
        out += [e for key, members in groups.items() if key not in trained and _informative(members) for e in members]
    return out


def drawn_episodes(ctx: RunContext, stage: str) -> list[LabelledEpisode]:
    """A rollout stage's labelled episodes for training, their groups in the order the stage drew its
    tasks (its recorded list), so that grpo.dynamic_sampling prefers the first drawn, as a draw means."""
    episodes = episodes_for_training(ctx.rundb, ctx.run, stage, GRPO_LABEL_SET)
    row = ctx.rundb.stage(ctx.run, stage)
    recorded = row.params.get("tasks") if row is not None else None
    if not isinstance(recorded, list):
        return episodes
    position = {int(task): i for i, task in reversed(list(enumerate(recorded)))}
    return sorted(episodes, key=lambda e: position.get(e.episode.task_index, len(position)))


def _group_key(labelled: LabelledEpisode) -> tuple[int, int]:
    """(the iteration that played it, its task): a GRPO group of grpo.dynamic_sampling."""
    iteration = labelled.episode.iteration
    return (-1 if iteration is None else iteration, labelled.episode.task_index)


def group_keys(episodes: list[LabelledEpisode]) -> set[tuple[int, int]]:
    """The grpo.dynamic_sampling groups these episodes belong to."""
    return {_group_key(e) for e in episodes}


def _informative(members: list[LabelledEpisode]) -> bool:
    """A group with unequal rewards: one GRPO learns from."""
    return len({m.reward for m in members}) > 1


def hard_tasks(ctx: RunContext, stages: list[str]) -> set[int]:
    """The tasks these rollout stages played with rollout.group_size_hard samples (their recorded sizes)."""
    hard = set()
    for stage in stages:
        row = ctx.rundb.stage(ctx.run, stage)
        assert row is not None  # rollout_stages names only stages that were played
        params = row.params
        sizes = params.get("group_sizes") or []
        hard |= {t for t, n in zip(params["tasks"], sizes) if n == ctx.recipe.rollout.group_size_hard}
    return hard


def replays_for(ctx: RunContext, it: int, episodes: list[LabelledEpisode]) -> list[LabelledEpisode]:
    """grpo.replay: for each group with no episode of total reward >= min_reward, up to max_per_group of
    that task's stored episodes from earlier iterations that reached it (store/replays.py)."""
    cfg = ctx.recipe.grpo.replay
    assert cfg is not None  # GrpoTrainer.batch calls this only with grpo.replay set
    best: dict[int, float] = {}
    for e in episodes:
        best[e.episode.task_index] = max(best.get(e.episode.task_index, -math.inf), _total(e))
    out = []
    for task, reward in best.items():
        if reward < cfg.min_reward:
            out += replay_candidates(ctx.rundb, ctx.run, task, it, GRPO_LABEL_SET, cfg.min_reward, cfg.max_per_group)
    return out


def _turn_rewards(labelled: LabelledEpisode) -> list[float]:
    """The env's per-step rewards, with whatever the labelled total adds beyond them (judges,
    penalties, weights) credited to the last turn, so the turn rewards sum to the total."""
    rewards = [t.reward or 0.0 for t in labelled.episode.turns]
    rewards[-1] += _total(labelled) - sum(rewards)
    return rewards


def _total(labelled: LabelledEpisode) -> float:
    """A training episode's total: episodes_for_training and replay_candidates read only episodes
    with a total under the label set."""
    assert labelled.reward is not None
    return labelled.reward


def _stored_id(labelled: LabelledEpisode) -> int:
    """A training episode's id: it was read from the database, where every episode has one."""
    assert labelled.episode.id is not None
    return labelled.episode.id


# --- schedule, checkpoints, resume ------------------------------------------------------------


def saves_checkpoint(cfg: GrpoSection, it: int) -> bool:
    """Every checkpoint_every-th iteration, and the last of each GRPO phase (a multiple of grpo.iterations)."""
    return (it + 1) % cfg.checkpoint_every == 0 or (it + 1) % cfg.iterations == 0


def checkpoint_folder(ctx: RunContext, it: int) -> Path:
    return ctx.run_dir / "checkpoints" / f"iter-{it:04d}"


def newest_sft(ctx: RunContext) -> Checkpoint | None:
    sft = [c for c in checkpoints(ctx.rundb, ctx.run) if c.stage == SFT_STAGE]
    return sft[-1] if sft else None


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


def planned_schedule(cfg: GrpoSection, total_steps: int, state: dict[str, Any] | None) -> LrSchedule:
    """The recipe's schedule over `total_steps`; on resume, the checkpoint's, stretched over a new total."""
    total_steps = max(total_steps, 1)
    fresh = LrSchedule(cfg.schedule, cfg.warmup_steps, total_steps, total_steps)
    if state is None or "schedule" not in state:  # a fresh start, or a checkpoint from before rlcli stored it
        return fresh
    saved = replace(LrSchedule(**state["schedule"]), kind=cfg.schedule, warmup=cfg.warmup_steps)
    step = state["scheduler"]["last_epoch"]
    return saved if saved.end == total_steps or total_steps <= step else saved.stretched(step, total_steps)


def _apply_recipe_hyperparameters(
    optimizer: torch.optim.Optimizer, scheduler: LambdaLR, cfg: GrpoSection, schedule: LrSchedule
) -> None:
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


def supersede_lost_rollouts(ctx: RunContext, next_iteration: int, end: int) -> None:
    """The resume rule for the work after the checkpoint resumed from (docs/database.md, "Resuming GRPO").

    A resume redoes train/<next_iteration> .. from that checkpoint, so the weights those updates made
    before the kill are gone (grpo.checkpoint_every > 1 saved none of them), and the redo may compute
    others (a GPU's reductions are not bit-reproducible). A rollout stage of these iterations (its extra
    rounds included) that holds an episode such weights played is therefore superseded, and so is one begun
    after rollout/<next_iteration> that holds no episode yet (its recorded draw may rest on redone work):
    its episodes are set aside into superseded/<stage>/<n>, kept with their turns and labels but never
    trained on nor counted, and its rows and those of its label stages are removed, so that it is drawn,
    played and labelled again, as the first time, by the recomputed weights. In the synchronous loop that
    is every rollout/i begun for i > next_iteration. rollout/<next_iteration> (played by the checkpoint's
    weights), one sampled ahead with saved weights (grpo.max_staleness), and what the iterations before
    trained on are kept: an iteration's data is fixed once it has trained and its weights are saved.
    On a CPU the redo computes the same weights, and the stage is played again to the same episodes."""
    from rlcli.engine.async_rollout import policy_version
    from rlcli.store.episodes import stage_episodes, supersede_stage
    from rlcli.store.names import GrpoLabelStage, LabelStage, RolloutStage, try_parse_stage
    from rlcli.store.tasks import refresh_task_stats

    rows = {row.name: try_parse_stage(row.name) for row in ctx.rundb.stages(ctx.run)}
    for name, parsed in rows.items():
        if not isinstance(parsed, RolloutStage) or not next_iteration <= parsed.iteration < end:
            continue
        played = {episode.policy for episode in stage_episodes(ctx.rundb, ctx.run, name)}
        versions = [v for v in map(policy_version, played) if v is not None]
        if not any(v >= next_iteration for v in versions) and (played or parsed.iteration == next_iteration):
            continue
        labels = [GrpoLabelStage(parsed.iteration, parsed.round).name]
        labels += [other for other, p in rows.items() if isinstance(p, LabelStage) and p.stage == name]
        aside, moved = supersede_stage(ctx.rundb, ctx.run, name, [name, *labels])
        if moved:
            refresh_task_stats(ctx.rundb, ctx.run, aside, GRPO_LABEL_SET)  # counted without them
        kept = f"its {moved} episodes set aside as {aside}" if moved else "it had stored no episode yet"
        ctx.console.print(
            f"train grpo: {name} was begun with weights that this resume recomputes from the last checkpoint "
            f"({', '.join(sorted(played)) or 'the update before it'}); it starts again ({kept}).",
            highlight=False,
        )


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
    sft = [c for c in run_checkpoints if c.stage == SFT_STAGE]
    if choice == "sft" and not sft:
        raise UsageError(
            f"grpo.reference is sft, but run {ctx.run!r} has no SFT checkpoint; run `rlcli sft` first "
            "or set grpo.reference: base (or auto)."
        )
    return sft[-1] if sft and choice != "base" else None
