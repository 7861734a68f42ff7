"""`rlcli runs plot`: a run's curves and eval success as an image (matplotlib, no GUI)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import Any

from rlcli.errors import UsageError
from rlcli.export_folder import write_file
from rlcli.report.views import HELDOUT_KEY, REWARD_KEY, SUCCESS_KEY, metric_series
from rlcli.store.db import RunDB
from rlcli.store.evals import eval_results
from rlcli.store.records import EvalResult

# Default panels: (title, metric keys drawn in it). A panel whose keys are all missing is skipped.
# Held-out success (grpo.eval_every) shares the success panel: train success rising while held-out
# success falls is the reward hacking to catch.
DEFAULT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Reward (mean ± std)", (REWARD_KEY,)),
    ("Success rate: train rollouts and held-out", (SUCCESS_KEY, HELDOUT_KEY)),
    ("Policy loss", ("train/loss",)),
    ("KL to reference", ("train/kl",)),
    ("Entropy", ("train/entropy",)),
    ("SFT loss", ("sft/loss", "sft/eval_loss")),
)


def plot_run(rundb: RunDB, name: str, out: Path, metrics: list[str] | None = None, overwrite: bool = False) -> Path:
    """Write a PNG (or any format matplotlib knows by the suffix) of a run's curves and evals; an
    existing `out` is replaced only with `overwrite`, and whole (export_folder.write_file)."""
    run = rundb.require_run(name)
    series = metric_series(rundb, name)
    evals = eval_results(rundb, name)
    if metrics:
        missing = [key for key in metrics if key not in series]
        if missing:
            known = ", ".join(series) or "none"
            raise UsageError(f"Run {name!r} has no metric {missing[0]!r}; its metrics: {known}.")
        panels: list[tuple[str, tuple[str, ...]]] = [(key, (key,)) for key in metrics]
    else:
        panels = [(title, keys) for title, keys in DEFAULT_PANELS if any(k in series for k in keys)]
    show_evals = bool(evals) and not metrics
    if not panels and not show_evals:
        raise UsageError(f"Run {name!r} has nothing to plot yet: no metrics and no evals; train or evaluate it first.")

    # The object API with an explicit Agg canvas: no pyplot global state, no GUI backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    count = len(panels) + show_evals
    cols = 1 if count == 1 else 2
    rows = math.ceil(count / cols)
    fig = Figure(figsize=(6.0 * cols, 3.4 * rows), layout="constrained")
    canvas = FigureCanvasAgg(fig)
    suffix = out.suffix.lstrip(".").lower()
    if suffix not in canvas.get_supported_filetypes():
        raise UsageError(f"Cannot write {out}: give --out a file ending in .png (or .pdf, .svg).")
    fig.suptitle(f"{name} ({run.status})")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, (title, keys) in zip(axes, panels):
        present = [key for key in keys if key in series]
        for key in present:
            _plot_series(ax, key, series[key], std=series.get("rollout/reward_std") if key == REWARD_KEY else None)
        ax.set_title(title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if SUCCESS_KEY in keys or HELDOUT_KEY in keys:
            ax.set_ylim(-0.02, 1.02)
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        if len(present) > 1:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    if show_evals:
        _plot_evals(axes[len(panels)], evals)
    for ax in axes[count:]:
        ax.set_visible(False)
    image = io.BytesIO()
    fig.savefig(image, format=suffix, dpi=110)
    write_file(out, image.getvalue(), "--out", overwrite)
    return out


def _plot_series(ax: Any, key: str, entry: dict[str, Any], std: dict[str, Any] | None) -> None:
    steps, values = entry["steps"], entry["values"]
    # Held-out evals come every eval_every iterations, from step -1 (the starting point): larger markers.
    held_out = key == HELDOUT_KEY
    ax.plot(steps, values, marker="s" if held_out else "o", markersize=5 if held_out else 3, label=key)
    if std is not None:
        by_step = dict(zip(std["steps"], std["values"]))
        pairs = [(s, v, by_step[s]) for s, v in zip(steps, values) if s in by_step]
        if pairs:
            s, v, d = zip(*pairs)
            ax.fill_between(s, [a - b for a, b in zip(v, d)], [a + b for a, b in zip(v, d)], alpha=0.2)
    ax.set_xlabel("iteration" if entry["stage"] == "grpo" else f"{entry['stage']} step")


def _plot_evals(ax: Any, evals: list[EvalResult]) -> None:
    from matplotlib.ticker import PercentFormatter

    labels = [r.label if r.decoding == "greedy" else f"{r.label} {r.decoding}" for r in evals]
    rates = [r.success_rate for r in evals]
    # Clamped at 0: at 0% or 100% the interval's rounding can put its end a hair inside the rate.
    errors = [
        [max(0.0, r.success_rate - r.ci_low) for r in evals],
        [max(0.0, r.ci_high - r.success_rate) for r in evals],
    ]
    colours = [f"C{i % 10}" for i in range(len(evals))]
    ax.bar(range(len(evals)), rates, yerr=errors, capsize=5, color=colours, alpha=0.85)
    # The rate goes under the label: inside the bar it would collide with the error bar.
    ticks = [f"{label}\n{rate:.1%}" for label, rate in zip(labels, rates)]
    ax.set_xticks(range(len(evals)), ticks, rotation=20 if len(evals) > 3 else 0)
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title("Eval success (95% CI)")
    ax.grid(alpha=0.3, axis="y")
