"""Reward labelling: apply the recipe's reward functions to stored episodes, store every component.

Labels live beside the episodes under a label-set name, so relabelling with other rewards never
needs new rollouts, and a labelled stage can be read back by any later stage.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlcli.engine.context import RunContext
from rlcli.errors import UsageError
from rlcli.rewards.episodes import message_text
from rlcli.store.episodes import stage_episodes, stages_with_episodes, store_rewards, unlabelled_count
from rlcli.store.names import GRPO_LABEL_SET, RESERVED_LABEL_SETS, check_user_name, label_stage
from rlcli.store.records import Episode, RewardRow
from rlcli.store.tasks import refresh_task_stats

if TYPE_CHECKING:
    from rlcli.rewards.scoring import RewardFn


@dataclass(frozen=True)
class LabelSummary:
    """One labelled stage: how many episodes, and the mean of the total and of each component."""

    stage: str
    label_set: str
    episodes: int
    means: dict[str, float]  # "reward_mean" (the total) and "<component>_mean"

    @classmethod
    def from_result(cls, stage: str, result: dict[str, Any]) -> LabelSummary:
        means = {k: v for k, v in result.items() if k.endswith("_mean")}
        return cls(stage, result["label_set"], result["episodes"], means)


def episode_dict(episode: Episode) -> dict[str, Any]:
    """An episode as the plain dict reward functions receive (see docs/rewards.md)."""
    messages = episode.messages
    assistant = [m for m in messages if m.get("role") == "assistant"]
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    return {
        "id": episode.id,
        "messages": messages,
        "completion": message_text(assistant[-1]) if assistant else "",
        "completions": [message_text(m) for m in assistant],
        "prompt": messages[:first],
        "task": episode.task,
        "env_return": episode.env_return or 0.0,
        "success": episode.success,
        "num_turns": episode.num_turns,
        "num_tokens": episode.num_tokens,
        "truncated": episode.hit_a_cap,
        "tool_calls": sum(1 for m in messages if m.get("role") == "tool"),
        "end_reason": episode.end_reason.value if episode.end_reason else None,
    }


def label_stage_episodes(
    ctx: RunContext, rollout_stage: str, label_set: str, fns: list[RewardFn] | None = None
) -> dict[str, Any]:
    """Label every successfully finished episode of a stage; failed episodes carry no reward.
    Returns the stage's result (see LabelSummary)."""
    from rlcli.rewards.scoring import build_reward_fns, label_episodes

    fns = fns if fns is not None else build_reward_fns(ctx.recipe.rewards, device=ctx.recipe.model.device)
    episodes = [episode_dict(e) for e in stage_episodes(ctx.store, rollout_stage, finished_only=True)]
    if not episodes:
        return {"episodes": 0, "label_set": label_set}
    labels = label_episodes(fns, episodes)
    weights = {fn.component: fn.weight for fn in fns}
    failures = {fn.component: fn.failures for fn in fns}
    store_rewards(
        ctx.rundb,
        [
            RewardRow(
                ep["id"],
                label_set,
                component,
                float(value),
                weights.get(component),
                failures.get(component, {}).get(ep["id"]),
            )
            for ep, values in zip(episodes, labels)
            for component, value in values.items()
        ],
    )
    if label_set == GRPO_LABEL_SET:
        # Inside the stage's work: a kill before the stage is marked done redoes the refresh too.
        refresh_task_stats(ctx.store, rollout_stage, label_set)
    totals = [v["total"] for v in labels]
    summary = {"episodes": len(episodes), "label_set": label_set, "reward_mean": sum(totals) / len(totals)}
    for component in labels[0]:
        if component != "total":
            summary[f"{component}_mean"] = sum(v[component] for v in labels) / len(labels)
    return summary


def run_label_stage(ctx: RunContext, *, label_set: str) -> list[LabelSummary]:
    """`rlcli label`: label every rollout stage of the run that has episodes, under one label set."""
    from rlcli.rewards.scoring import build_reward_fns

    check_user_name("--label-set", label_set, reserved=RESERVED_LABEL_SETS)
    stages = stages_with_episodes(ctx.store)
    if not stages:
        raise UsageError(f"Run {ctx.run!r} has no episodes to label; run `rlcli rollout` first.")
    fns = build_reward_fns(ctx.recipe.rewards, device=ctx.recipe.model.device)
    summaries = []
    for stage in stages:
        name = label_stage(label_set, stage)
        row = ctx.store.stage(name)
        if row is not None and row.done and unlabelled_count(ctx.store, stage, label_set):
            # The stage gained episodes since it was labelled (a raised eval.tasks): label it again.
            ctx.store.mark_stage(name, "pending")
        result = ctx.stage(
            name,
            functools.partial(label_stage_episodes, ctx, stage, label_set, fns),
            {"label_set": label_set},
            # Labels under one name come from one set of rewards; relabelling in place would hide the
            # change. A time limit changes no label: it may change, and older label sets lack it.
            identity={"rewards": [r.model_dump(exclude={"timeout_s"}) for r in ctx.recipe.rewards]},
            new_stage_hint=(
                f"label set {label_set!r} keeps the rewards it was labelled with; "
                "use another --label-set to label with these beside it"
            ),
        )
        summaries.append(LabelSummary.from_result(stage, result))
    return summaries
