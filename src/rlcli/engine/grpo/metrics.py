"""An iteration's metrics (its rollout's summary, its update's stats, its timings) and the live view
that prints one line of them per iteration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rlcli.console import number
from rlcli.engine.grpo.sources import Rollout
from rlcli.store.iterations import IterationStats

if TYPE_CHECKING:
    from rich.console import Console


def iteration_metrics(rollout: Rollout, stats: IterationStats) -> dict[str, Any]:
    """An iteration's metrics, from its rollout stage's summary, its train stage's stats and its timings."""
    summary = rollout.summary
    return {
        "rollout/reward_mean": stats.reward_mean,
        "rollout/reward_std": stats.reward_std,
        "rollout/success_rate": summary.success_rate,
        "rollout/return_mean": summary.return_mean,
        "rollout/turns_mean": summary.turns_mean,
        "rollout/failed": summary.failed,
        "rollout/replayed_lost": summary.replayed_lost,
        **stats.metrics,
        **rollout.perf(),
    }


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

    def __init__(self, console: Console) -> None:
        self.console = console
        self.header_shown = False

    def show(self, it: int, metrics: dict[str, Any]) -> None:
        if not self.header_shown:
            self.console.print(" ".join(f"{name:>8}" for name, _ in self.COLUMNS), style="bold")
            self.header_shown = True
        cells = [f"{it:>8}"]
        for _, key in self.COLUMNS[1:]:
            value = metrics.get(key)
            cells.append(f"{number(float(value), 3):>8}" if isinstance(value, (int, float)) else f"{'–':>8}")
        self.console.print(" ".join(cells), highlight=False)
