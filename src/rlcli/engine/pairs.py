"""Preference pairs mined from a run's labelled groups, for DPO.

A group is the samples of one task in one rollout stage. Its best and worst episode by total
reward make a pair when their rewards differ by at least dpo.margin (ties go to the lower sample
index, so mining is deterministic). Two episodes of one task start from the same prompt; in a
multi-turn game they may also play the same first turns. The pair is cut at the first turn where
the policy acted differently on the same prompt: that turn's prompt is the pair's prompt, and
chosen and rejected are the two continuations from there to the end of each episode. Inside a
continuation, what the env and the chat template added between turns is context (mask 0): DPO
scores only the tokens the policy sampled. Everything is the stored token ids; nothing is re-tokenised.

Skipped: a group whose rewards differ by less than the margin, and a pair whose prompts part before
their actions do (the env answered the same actions differently) or where one episode's actions
are a prefix of the other's: neither tells which action was better.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from itertools import groupby

from rlcli.errors import UsageError
from rlcli.store.episodes import episodes_for_training, stages_with_episodes
from rlcli.store.pairs import PairRecord
from rlcli.store.records import Episode, LabelledEpisode, Turn
from rlcli.store.run_store import RunStore


@dataclass(frozen=True)
class PreferenceExample:
    """A pair as DPO trains on it: a shared prompt and two continuations with their loss masks."""

    prompt_ids: list[int]
    chosen_ids: list[int]
    chosen_mask: list[int]  # 1 on the tokens the policy sampled
    rejected_ids: list[int]
    rejected_mask: list[int]


@dataclass
class MiningReport:
    groups: int = 0
    pairs: list[PairRecord] = field(default_factory=list)
    below_margin: int = 0  # groups whose best and worst rewards differ by less than dpo.margin
    no_shared_prompt: int = 0  # pairs whose prompts part first, or whose actions never differ


def source_stages(store: RunStore, patterns: list[str]) -> list[str]:
    """The run's stages with episodes that dpo.source names (names or glob patterns), in order."""
    stages = stages_with_episodes(store)
    chosen = [s for s in stages if any(fnmatch.fnmatchcase(s, p) for p in patterns)]
    if not chosen:
        known = ", ".join(stages) or "none"
        raise UsageError(
            f"dpo.source {patterns} matches no stage of run {store.run!r} with episodes (stages with episodes: {known})."
        )
    return chosen


def mine_pairs(
    store: RunStore, stages: list[str], label_set: str, margin: float, max_pairs: int | None
) -> MiningReport:
    """Pairs from every labelled group of `stages`; with max_pairs, those with the largest reward gap."""
    report = MiningReport()
    for stage in stages:
        episodes = episodes_for_training(store, stage, label_set)  # by task, then sample
        for task, members in groupby(episodes, key=lambda e: e.episode.task_index):
            group = list(members)
            if len(group) < 2:
                continue
            report.groups += 1
            chosen = max(group, key=_reward)  # max and min keep the first of equals
            rejected = min(group, key=_reward)
            if _reward(chosen) - _reward(rejected) < margin:
                report.below_margin += 1
                continue
            pair = make_pair(stage, task, chosen, rejected)
            if pair is None:
                report.no_shared_prompt += 1
            else:
                report.pairs.append(pair)
    if max_pairs is not None and len(report.pairs) > max_pairs:
        # sorted is stable: among equal gaps the stage order and the task order stay.
        ranked = sorted(report.pairs, key=lambda p: -(p.chosen_reward - p.rejected_reward))
        report.pairs = ranked[:max_pairs]
    return report


def _reward(labelled: LabelledEpisode) -> float:
    """A labelled episode's total: episodes_for_training reads only episodes its label set covers."""
    assert labelled.reward is not None
    return labelled.reward


def make_pair(stage: str, task: int, chosen: LabelledEpisode, rejected: LabelledEpisode) -> PairRecord | None:
    turn = first_difference(chosen.episode.turns, rejected.episode.turns)
    if turn is None:
        return None
    assert chosen.episode.id is not None and rejected.episode.id is not None  # read from the database
    example = preference_example(chosen.episode, rejected.episode, turn)
    return PairRecord(
        source_stage=stage,
        task_index=task,
        chosen_episode_id=chosen.episode.id,
        rejected_episode_id=rejected.episode.id,
        turn_index=turn,
        chosen_reward=_reward(chosen),
        rejected_reward=_reward(rejected),
        prompt_tokens=len(example.prompt_ids),
        chosen_tokens=len(example.chosen_ids),
        rejected_tokens=len(example.rejected_ids),
    )


def first_difference(a: list[Turn], b: list[Turn]) -> int | None:
    """The first turn at which the two episodes' actions differ on the same prompt; None when
    their prompts part first or neither acted differently before one of them ended."""
    for index, (x, y) in enumerate(zip(a, b)):
        if x.prompt_ids != y.prompt_ids:
            return None
        if x.completion_ids != y.completion_ids:
            return index
    return None


def preference_example(chosen: Episode, rejected: Episode, turn: int) -> PreferenceExample:
    """The training example of a pair cut at `turn` (see the module docstring)."""
    chosen_ids, chosen_mask = continuation(chosen.turns, turn)
    rejected_ids, rejected_mask = continuation(rejected.turns, turn)
    return PreferenceExample(chosen.turns[turn].prompt_ids, chosen_ids, chosen_mask, rejected_ids, rejected_mask)


def continuation(turns: list[Turn], start: int) -> tuple[list[int], list[int]]:
    """The tokens after turn `start`'s prompt to the episode's end, and a mask that is 1 on the
    sampled ones. It stops early where a chat template rewrote earlier text (a later prompt that
    does not extend the tokens so far), since what follows was not a continuation of this prompt."""
    prompt = turns[start].prompt_ids
    ids, mask = list(turns[start].completion_ids), [1] * len(turns[start].completion_ids)
    for turn in turns[start + 1 :]:
        seen = prompt + ids
        if turn.prompt_ids[: len(seen)] != seen:
            break
        context = turn.prompt_ids[len(seen) :]
        ids += context + turn.completion_ids
        mask += [0] * len(context) + [1] * len(turn.completion_ids)
    return ids, mask
