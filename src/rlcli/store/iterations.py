"""A GRPO iteration's state in the run database, as typed records: its plan (RolloutPlan, the params
of each of its rollout stages: the tasks drawn, their group sizes, the horizon) and its outcome
(IterationStats, its train stage's result). Stages store them as JSON; these are the only code that
knows their keys, so the engine reads fields, never `params.get("tasks")`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rlcli.store.run_store import RunStore


@dataclass(frozen=True)
class RolloutPlan:
    """What a GRPO rollout stage (rollout/i, or refill round rollout/i+r) plays, recorded with it when
    it begins, so that a resumed stage plays exactly the same tasks with the same group sizes."""

    iteration: int
    tasks: list[int]  # in the order drawn: grpo.dynamic_sampling prefers the first
    max_turns: int | None  # env.horizon at this iteration
    round: int = 0  # 0: rollout/i; r >= 1: grpo.dynamic_sampling's refill round rollout/i+r
    group_sizes: list[int] | None = None  # per task, in task order; None: rollout.group_size for all

    def to_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"iteration": self.iteration}
        if self.round:
            params["round"] = self.round
        params["tasks"] = self.tasks
        if self.group_sizes is not None:
            params["group_sizes"] = self.group_sizes
        params["max_turns"] = self.max_turns
        return params

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RolloutPlan | None:
        """The plan a stage recorded; None for a stage that recorded no task list (an older rlcli's)."""
        tasks = params.get("tasks")
        if not isinstance(tasks, list):
            return None
        sizes = params.get("group_sizes")
        return cls(
            int(params.get("iteration", -1)),
            [int(t) for t in tasks],
            params.get("max_turns"),
            int(params.get("round", 0)),
            [int(n) for n in sizes] if isinstance(sizes, list) else None,
        )


def rollout_plan(store: RunStore, stage: str) -> RolloutPlan | None:
    """The plan rollout stage `stage` recorded; None when it has not begun or recorded none."""
    row = store.stage(stage)
    return RolloutPlan.from_params(row.params) if row is not None else None


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
