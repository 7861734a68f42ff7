"""grpo.branch, rewind and branch: continuations sampled from stored turns, for per-turn credit.

After label/i, stage branch/i chooses branch points among rollout/i's labelled episodes (an episode and
one of its turns t; grpo.branch.choose says which), and for each plays grpo.branch.continuations
episodes that begin as their parent did: the env is reset with the parent's seed and the parent's
actions before t are replayed (`PrefixSampler` hands the stored tokens back instead of sampling), so
that turn t's prompt is the parent's, token for token, and the policy samples from there to the end.
A branch is stored as an episode of its own (parent_episode_id, branch_turn), labelled with the
recipe's rewards in the same stage. One whose replayed turns differ from its parent's (observations,
rewards, or turn t's prompt tokens; compared as `rlcli envs audit` compares two plays) is stored as
failed with that difference and never trained on; an env that does not replay at all is refused
before any stage (engine/preflight.py, check_replays).

With grpo.branch.choose expert (semi-online), the parents are the env's expert's episodes instead: the
stage first plays the expert once on each of grpo.branch.points of the iteration's tasks (those whose
groups had no success first) and stores it as sample 0 of its task, then branches from a turn of it
drawn at random. The expert's turns are replayed as the policy's tokens would carry its text (the
tokenizer's encoding and its eos) and are context only: a continuation trains from the branch turn on.

Exact resume: the points are recorded with the stage (and are a function of stored, labelled
episodes), each branch's sampling seed is derived from (run seed, stage, parent task, parent sample,
turn, k), and branches are committed in chunks of rollout.batch_size, as rollout stages are, so a
killed stage plays only its missing chunks, to the same tokens.

The batch (grpo/batch.py, branch_credit) turns their returns into per-turn advantages.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.engine.audit import replay_mismatch, stored_play
from rlcli.engine.context import RunContext
from rlcli.engine.episode_runner import EpisodeRunner
from rlcli.engine.labelling import GRPO_LABEL_SET, label_stage_episodes
from rlcli.engine.rollout import chunks, collect, env_host
from rlcli.engine.turns import EpisodeSpec, LiveEpisode, RolloutLimits
from rlcli.envs.tool_use import tool_use_spec
from rlcli.envs.tools import close_toolboxes
from rlcli.generation.sampler import Sample, Sampler
from rlcli.generation.seeds import derive_seed
from rlcli.store.episodes import episodes_for_training, stage_episodes, store_episodes, stored_episode_keys
from rlcli.store.names import EXPERT, PolicyRef, branch_stage, rollout_stage
from rlcli.store.records import Episode, LabelledEpisode, Turn

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlcli.models import vision
    from rlcli.recipe import BranchSection
    from rlcli.rewards.scoring import RewardFn


@dataclass(frozen=True)
class BranchPoint:
    """A stored turn to branch from: episode `parent_id`'s turn `turn`."""

    parent_id: int
    turn: int


def candidate_points(cfg: BranchSection, episodes: list[LabelledEpisode], seed: int) -> list[BranchPoint]:
    """Every turn grpo.branch.choose allows, best first: failed (the turns of episodes that did not
    succeed, in a draw seeded by `seed`), divergence (per group, the first turn where its episodes'
    actions differ, from its first episode, in a seeded draw of groups) or entropy (every turn by the
    mean -logprob of its sampled tokens, highest first)."""
    if cfg.choose == "entropy":
        scored = [
            (-sum(t.logprobs) / len(t.logprobs), BranchPoint(_id(e), t.turn_index))
            for e in episodes
            for t in e.episode.turns
            if t.logprobs
        ]
        return [point for _, point in sorted(scored, key=lambda item: -item[0])]
    if cfg.choose == "failed":
        points = [BranchPoint(_id(e), t.turn_index) for e in episodes if not e.episode.success for t in e.episode.turns]
    else:
        groups: dict[int, list[Episode]] = {}
        for e in episodes:
            groups.setdefault(e.episode.task_index, []).append(e.episode)
        points = [p for members in groups.values() if (p := _first_divergence(members)) is not None]
    random.Random(seed).shuffle(points)
    return points


def expert_tasks(episodes: list[LabelledEpisode], count: int, seed: int) -> list[int]:
    """grpo.branch.choose expert: `count` of the iteration's tasks for the expert to play, those whose
    group had no success first (where the policy alone gets no signal), each kind in a draw seeded by
    `seed`."""
    solved: dict[int, bool] = {}
    for e in episodes:
        solved[e.episode.task_index] = solved.get(e.episode.task_index, False) or bool(e.episode.success)
    rng = random.Random(seed)
    unsolved = [t for t, ok in sorted(solved.items()) if not ok]
    rest = [t for t, ok in sorted(solved.items()) if ok]
    rng.shuffle(unsolved)
    rng.shuffle(rest)
    return (unsolved + rest)[:count]


def expert_points(experts: list[Episode], seed: int) -> list[BranchPoint]:
    """A turn of each finished expert episode to branch from, drawn at random (seeded by `seed` and the
    task): not its first, whose state a rollout already samples from, unless it has only one."""
    points = []
    for e in experts:
        if e.status != "ok" or not e.turns:
            continue
        last = len(e.turns) - 1
        turn = random.Random(derive_seed(seed, e.task_index)).randint(1, last) if last >= 1 else 0
        points.append(BranchPoint(_id_of(e), turn))
    return points


def _first_divergence(members: list[Episode]) -> BranchPoint | None:
    """The first turn t at which a group's episodes (played from one seed) act differently, all of them
    having acted alike before it, so in one state: that state, as the first episode's turn t."""
    for t in range(min(len(e.turns) for e in members)):
        if len({e.turns[t].text for e in members}) > 1:
            return BranchPoint(_id_of(members[0]), t)
    return None


def _id(labelled: LabelledEpisode) -> int:
    return _id_of(labelled.episode)


def _id_of(episode: Episode) -> int:
    assert episode.id is not None  # read from the database
    return episode.id


class PrefixSampler:
    """The policy's sampler, except that a branch's first turns are its parent's: for each sample seed
    given to `start` that `prefixes` holds, the first len(prefix) turns return the stored tokens and
    logprobs, and only then does the policy sample (its generator untouched until then)."""

    def __init__(self, inner: Sampler, prefixes: dict[int, list[Turn]]) -> None:
        self.inner, self.prefixes = inner, prefixes
        self.config = inner.config
        self.replay: list[list[Turn]] = []
        self.turns: list[int] = []

    def start(self, seeds: list[int]) -> None:
        self.inner.start(seeds)
        self.replay = [self.prefixes.get(seed, []) for seed in seeds]
        self.turns = [0] * len(seeds)

    def sample(
        self,
        rows: list[int],
        prompts: list[list[int]],
        budgets: list[int],
        images: list[list[vision.ImageRef]] | None = None,
    ) -> list[Sample]:
        out: dict[int, Sample] = {}
        asked: list[int] = []
        for k, row in enumerate(rows):
            turn, self.turns[row] = self.turns[row], self.turns[row] + 1
            if turn < len(self.replay[row]):
                stored = self.replay[row][turn]
                out[row] = Sample(list(stored.completion_ids), list(stored.logprobs), True)
            else:
                asked.append(k)
        if asked:
            sampled = self.inner.sample(
                [rows[k] for k in asked],
                [prompts[k] for k in asked],
                [budgets[k] for k in asked],
                [images[k] for k in asked] if images is not None else None,
            )
            out.update({rows[k]: sample for k, sample in zip(asked, sampled, strict=True)})
        return [out[row] for row in rows]


def policy_turns(turns: list[Turn], tokenizer: PreTrainedTokenizerBase) -> list[Turn]:
    """Stored turns as the policy's sampled turns: a model's as they are; the expert's, which keep text
    only, as the tokens the policy would have sampled to write it (its text encoded, then eos)."""
    out = []
    for turn in turns:
        if turn.completion_ids:
            out.append(turn)
            continue
        ids = [*tokenizer(turn.text, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        out.append(replace(turn, completion_ids=ids, logprobs=[0.0] * len(ids)))
    return out


def replay_difference(parent: Episode, branch: Episode, turn: int) -> str | None:
    """How a branch's replayed turns differ from its parent's, or None: the reset's and each replayed
    turn's observation and reward (the audit's comparison of two plays), and turn `turn`'s prompt tokens
    (a model's parent: the expert's turns keep no tokens)."""

    def opening(episode: Episode) -> list[dict]:
        first = next((i for i, m in enumerate(episode.messages) if m.get("role") == "assistant"), 0)
        return episode.messages[:first]

    mismatch = replay_mismatch(
        stored_play(opening(parent), parent.turns[:turn]),
        stored_play(opening(branch), branch.turns[:turn]),
        parent.seed,
    )
    if mismatch is not None:
        return mismatch
    if len(branch.turns) <= turn:
        return f"the branch ended before its turn {turn}"
    if parent.turns[turn].prompt_ids and branch.turns[turn].prompt_ids != parent.turns[turn].prompt_ids:
        return f"turn {turn}'s prompt tokens differ from the parent's"
    return None


def play_branches(
    ctx: RunContext,
    it: int,
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    policy: PolicyRef,
    reward_fns: list[RewardFn],
) -> dict[str, Any]:
    """Stage branch/it: its points (recorded with the stage; with choose expert, the tasks its expert
    plays), their continuations played, stored and labelled under label set grpo; the stage's result."""
    cfg = ctx.recipe.grpo.branch
    assert cfg is not None  # the loop calls this only with grpo.branch set
    stage = branch_stage(it)
    rollouts = episodes_for_training(ctx.store, rollout_stage(it), GRPO_LABEL_SET)
    row = ctx.store.stage(stage)
    seed = derive_seed(ctx.recipe.run.seed, stage)
    key = "tasks" if cfg.choose == "expert" else "points"
    if row is not None and key in row.params:  # a resumed stage keeps the points (or tasks) it began with
        chosen = row.params[key]
    elif cfg.choose == "expert":
        chosen = expert_tasks(rollouts, cfg.points, seed)
    else:
        chosen = [[p.parent_id, p.turn] for p in candidate_points(cfg, rollouts, seed)[: cfg.points]]

    def work() -> dict[str, Any]:
        if cfg.choose == "expert":
            # Sample 0 of each task: the expert's episode, stored before any continuation names it.
            collect(ctx, stage=stage, policy=EXPERT, task_indices=chosen, group_size=1, split="train", iteration=it)
            parents = {
                _id_of(e): e for e in stage_episodes(ctx.store, stage, with_turns=True) if e.policy == str(EXPERT)
            }
            points = expert_points(list(parents.values()), seed)
        else:
            parents = {_id(e): e.episode for e in rollouts}
            points = [BranchPoint(*pair) for pair in chosen]
        first = 1 if cfg.choose == "expert" else 0
        _collect(ctx, it, points, {p: parents[p.parent_id] for p in points}, sampler, tokenizer, policy, first)
        labels = label_stage_episodes(ctx, stage, GRPO_LABEL_SET, reward_fns)
        return {"points": len(points), **labels}

    return ctx.stage(stage, work, params={"iteration": it, key: chosen})


def _collect(
    ctx: RunContext,
    it: int,
    points: list[BranchPoint],
    parents: dict[BranchPoint, Episode],
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    policy: PolicyRef,
    first_sample: int,
) -> None:
    """Play and store every branch of `points` that the stage has not stored, chunk by chunk (one
    transaction each), as engine/rollout.py's collect plays a rollout stage; their sample indices start
    at first_sample (after the expert's episode of the task, with choose expert)."""
    from rlcli.envs.loading import load_env

    recipe, stage = ctx.recipe, branch_stage(it)
    k = recipe.grpo.branch.continuations if recipe.grpo.branch is not None else 0
    specs, prefixes, origin = [], {}, {}
    for n, point in enumerate(points):
        parent = parents[point]
        for j in range(k):
            seed = derive_seed(recipe.run.seed, stage, parent.task_index, parent.sample_index, point.turn, j)
            specs.append(EpisodeSpec(parent.task_index, first_sample + n * k + j, parent.seed, seed))
            prefixes[seed], origin[seed] = policy_turns(parent.turns[: point.turn], tokenizer), point
    have = stored_episode_keys(ctx.store, stage)
    todo = [
        [s for s in c if (s.task_index, s.sample_index) not in have] for c in chunks(specs, recipe.rollout.batch_size)
    ]
    todo = [chunk for chunk in todo if chunk]
    if not todo:
        return
    kwargs = recipe.env.factory_kwargs()
    tools = tool_use_spec(recipe.env, Path.cwd(), tokenizer)
    keep_images = None if recipe.env.keep_images == "all" else recipe.env.keep_images
    limits = RolloutLimits(
        recipe.env.horizon(it),
        recipe.model.max_length,
        recipe.env.step_timeout_s,
        keep_images,
        recipe.env.timeout_retries,
    )

    def record(live: LiveEpisode) -> Episode:
        point = origin[live.spec.sample_seed]
        episode = live.to_record(ctx.run, stage, it, "train", str(policy))
        episode = replace(episode, parent_episode_id=point.parent_id, branch_turn=point.turn)
        if episode.status == "ok" and (difference := replay_difference(parents[point], episode, point.turn)):
            episode = replace(episode, status="failed", success=False, error=f"the parent did not replay: {difference}")
        return episode

    try:
        with env_host(recipe.env, kwargs, load_env(recipe.env.name, kwargs, tools=tools), tools) as envs:
            runner = EpisodeRunner(envs, limits, PrefixSampler(sampler, prefixes), tokenizer)
            for chunk in todo:
                store_episodes(ctx.rundb, [record(live) for live in runner.run(chunk)])
    finally:
        close_toolboxes()  # the MCP servers that envs in this process started (env.workers 0)


def stored_branches(ctx: RunContext, it: int) -> list[LabelledEpisode]:
    """Iteration it's branches for its batch: finished, labelled, replayed as their parent played (not the
    expert's episodes they branch from, with choose expert)."""
    stored = episodes_for_training(ctx.store, branch_stage(it), GRPO_LABEL_SET)
    return [b for b in stored if b.episode.parent_episode_id is not None]
