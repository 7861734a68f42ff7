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
    """One line per iteration with the numbers a researcher watches: as many of COLUMNS, the most
    watched first, as the console is wide (eight at a terminal's 80 columns, all of them piped); the
    run database has every metric (`rlcli runs show`)."""

    COLUMNS = (
        ("reward", "rollout/reward_mean"),
        ("success", "rollout/success_rate"),
        ("held-out", "eval/success_rate"),
        ("loss", "train/loss"),
        ("kl", "train/kl"),
        ("entropy", "train/entropy"),
        ("0-var", "train/zero_var_groups"),
        ("tok/s", "perf/tokens_per_s"),
        ("t_roll", "perf/time_rollout_s"),
        ("t_train", "perf/time_train_s"),
        ("|g|", "train/grad_norm"),
        ("clip", "train/clip_frac_high"),
    )
    ITER_WIDTH = 5  # the iteration number's column
    CELL_WIDTH = 8  # each metric's, after a space

    def __init__(self, console: Console, distills: bool = False) -> None:
        self.console = console
        self.distills = distills  # a distill phase watches its reverse KL to the teacher where GRPO's KL was
        self.columns: tuple[tuple[str, str], ...] | None = None  # chosen at the first line

    def show(self, it: int, metrics: dict[str, Any]) -> None:
        if self.columns is None:
            fits = (self.console.width - self.ITER_WIDTH) // (self.CELL_WIDTH + 1)
            columns = tuple(
                ("t-kl", "train/teacher_kl") if self.distills and key == "train/kl" else (name, key)
                for name, key in self.COLUMNS
            )
            self.columns = columns[:fits]
            header = [f"{'iter':>{self.ITER_WIDTH}}", *(f"{name:>{self.CELL_WIDTH}}" for name, _ in self.columns)]
            self.console.print(" ".join(header), style="bold", highlight=False)
        cells = [f"{it:>{self.ITER_WIDTH}}"]
        for _, key in self.columns:
            value = metrics.get(key)
            cells.append(f"{self._cell(value):>{self.CELL_WIDTH}}")
        self.console.print(" ".join(cells), highlight=False)

    def _cell(self, value: Any) -> str:
        if not isinstance(value, (int, float)):
            return "–"
        text = number(float(value), 3)
        # -1.23e-05 is one character too wide: one digit fewer keeps the columns straight.
        return text if len(text) <= self.CELL_WIDTH else number(float(value), 2)
