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
from rlcli.engine.episode_runner import EpisodeRunner, EpisodeSpec, LiveEpisode, RolloutLimits
from rlcli.engine.labelling import GRPO_LABEL_SET, label_stage_episodes
from rlcli.engine.rollout import chunks, env_host
from rlcli.envs.tool_use import tool_use_spec
from rlcli.envs.tools import close_toolboxes
from rlcli.generation.sampler import Sample, Sampler
from rlcli.generation.seeds import derive_seed
from rlcli.store.episodes import episodes_for_training, store_episodes, stored_episode_keys
from rlcli.store.names import PolicyRef, branch_stage, rollout_stage
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


def replay_difference(parent: Episode, branch: Episode, turn: int) -> str | None:
    """How a branch's replayed turns differ from its parent's, or None: the reset's and each replayed
    turn's observation and reward (the audit's comparison of two plays), and turn `turn`'s prompt tokens."""

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
    if len(branch.turns) <= turn or branch.turns[turn].prompt_ids != parent.turns[turn].prompt_ids:
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
    """Stage branch/it: its points (recorded with the stage), their continuations played, stored and
    labelled under label set grpo; the stage's result."""
    cfg = ctx.recipe.grpo.branch
    assert cfg is not None  # the loop calls this only with grpo.branch set
    stage = branch_stage(it)
    parents = {_id(e): e for e in episodes_for_training(ctx.store, rollout_stage(it), GRPO_LABEL_SET)}
    row = ctx.store.stage(stage)
    if row is not None and "points" in row.params:  # a resumed stage keeps the points it began with
        points = [BranchPoint(*pair) for pair in row.params["points"]]
    else:
        seed = derive_seed(ctx.recipe.run.seed, stage)
        points = candidate_points(cfg, list(parents.values()), seed)[: cfg.points]

    def work() -> dict[str, Any]:
        _collect(ctx, it, points, {p: parents[p.parent_id].episode for p in points}, sampler, tokenizer, policy)
        labels = label_stage_episodes(ctx, stage, GRPO_LABEL_SET, reward_fns)
        return {"points": len(points), **labels}

    return ctx.stage(stage, work, params={"iteration": it, "points": [[p.parent_id, p.turn] for p in points]})


def _collect(
    ctx: RunContext,
    it: int,
    points: list[BranchPoint],
    parents: dict[BranchPoint, Episode],
    sampler: Sampler,
    tokenizer: PreTrainedTokenizerBase,
    policy: PolicyRef,
) -> None:
    """Play and store every branch of `points` that the stage has not stored, chunk by chunk (one
    transaction each), as engine/rollout.py's collect plays a rollout stage."""
    from rlcli.envs.loading import load_env

    recipe, stage = ctx.recipe, branch_stage(it)
    k = recipe.grpo.branch.continuations if recipe.grpo.branch is not None else 0
    specs, prefixes, origin = [], {}, {}
    for n, point in enumerate(points):
        parent = parents[point]
        for j in range(k):
            seed = derive_seed(recipe.run.seed, stage, parent.task_index, parent.sample_index, point.turn, j)
            specs.append(EpisodeSpec(parent.task_index, n * k + j, parent.seed, seed))
            prefixes[seed], origin[seed] = parent.turns[: point.turn], point
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
    """Iteration it's branches for its batch: finished, labelled, replayed as their parent played."""
    return episodes_for_training(ctx.store, branch_stage(it), GRPO_LABEL_SET)
