"""`rlcli runs plot`: a run's curves and eval success as an image (matplotlib, no GUI)."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.errors import UsageError
from rlcli.export_folder import write_file
from rlcli.report.views import HELDOUT_KEY, REWARD_KEY, SUCCESS_KEY, metric_series
from rlcli.store.evals import eval_results
from rlcli.store.records import EvalResult
from rlcli.store.run_store import RunStore

if TYPE_CHECKING:
    from matplotlib.figure import Figure

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
# Noisy once per iteration: drawn as a centred moving mean over the raw points, which stay faint.
SMOOTHED = (REWARD_KEY, SUCCESS_KEY)


def plot_run(store: RunStore, out: Path, metrics: list[str] | None = None, overwrite: bool = False) -> dict[str, Any]:
    """Write a PNG (or any format matplotlib knows by the suffix) of a run's curves and evals; an
    existing `out` is replaced only with `overwrite`, and whole (export_folder.write_file).

    Returns what it drew, as `runs plot --json` prints it: "series" ({key: {"stage", "steps",
    "values"}}, NaN as null) and "evals" (label, decoding, success_rate, ci_low, ci_high, tasks, k)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    suffix = out.suffix.lstrip(".").lower()
    if suffix not in FigureCanvasAgg.get_supported_filetypes():
        raise UsageError(f"Cannot write {out}: give --out a file ending in .png (or .pdf, .svg).")
    fig, drawn, evals = run_figure(store, metrics)
    write_file(out, figure_bytes(fig, suffix), "--out", overwrite)
    return {
        "series": {
            key: {**entry, "values": [v if v is not None and math.isfinite(v) else None for v in entry["values"]]}
            for key, entry in drawn.items()
        },
        "evals": [
            {
                "label": r.label,
                "decoding": r.decoding,
                **{k: getattr(r, k) for k in ("success_rate", "ci_low", "ci_high", "tasks", "k")},
            }
            for r in evals
        ],
    }


def figure_bytes(fig: Figure, fmt: str = "png", dpi: int = 110) -> bytes:
    """The figure as an image file's bytes, in a format matplotlib's Agg canvas writes (png, svg, pdf, ...)."""
    image = io.BytesIO()
    fig.savefig(image, format=fmt, dpi=dpi)
    return image.getvalue()


def run_figure(
    store: RunStore, metrics: list[str] | None = None
) -> tuple[Figure, dict[str, dict[str, Any]], list[EvalResult]]:
    """The figure of a run's curves (one panel each) and evals, the series it draws ({key: {"stage",
    "steps", "values"}}, as views.metric_series gives them) and the evals it draws as bars.

    Refused in one sentence (UsageError): an unknown metric key, or a run with no metrics and no evals."""
    run = store.require_run()
    series = metric_series(store)
    evals = eval_results(store)
    if metrics:
        missing = [key for key in metrics if key not in series]
        if missing:
            known = ", ".join(series) or "none"
            raise UsageError(f"Run {store.run!r} has no metric {missing[0]!r}; its metrics: {known}.")
        panels: list[tuple[str, tuple[str, ...]]] = [(key, (key,)) for key in metrics]
    else:
        panels = [(title, keys) for title, keys in DEFAULT_PANELS if any(k in series for k in keys)]
    show_evals = bool(evals) and not metrics
    if not panels and not show_evals:
        raise UsageError(
            f"Run {store.run!r} has nothing to plot yet: no metrics and no evals; train or evaluate it first."
        )

    # The object API with an explicit Agg canvas: no pyplot global state, no GUI backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    count = len(panels) + show_evals
    cols = 1 if count == 1 else 2
    rows = math.ceil(count / cols)
    fig = Figure(figsize=(6.0 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(f"{store.run} ({run.status})")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax in axes:
        # Tick labels show the values themselves: an entropy between 6.2120 and 6.2125 is not
        # "0.0000 ... 0.0005" with "+6.212" in the corner.
        ax.ticklabel_format(useOffset=False)
    drawn: dict[str, dict[str, Any]] = {}
    for ax, (title, keys) in zip(axes, panels):
        present = [key for key in keys if key in series]
        for colour, key in enumerate(present):
            std = series.get("rollout/reward_std") if key == REWARD_KEY else None
            _plot_series(ax, key, series[key], std, f"C{colour}")
            drawn[key] = series[key]
            if std is not None:
                drawn["rollout/reward_std"] = std
        ax.set_title(title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if SUCCESS_KEY in keys or HELDOUT_KEY in keys:
            ax.set_ylim(-0.02, 1.02)
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        if len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    if show_evals:
        _plot_evals(axes[len(panels)], evals)
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, drawn, evals if show_evals else []


def with_gaps(key: str, entry: dict[str, Any]) -> tuple[list[float], list[float]]:
    """A series' steps and values with a NaN wherever GRPO iterations without a value lie between
    two with one (loss and KL skip the iterations that made no update): matplotlib breaks the line
    there instead of drawing it across. Held-out evals (eval/...) come every grpo.eval_every
    iterations by design and stay joined, as do SFT steps (logged every logging_steps)."""
    steps, values = list(entry["steps"]), [math.nan if v is None else v for v in entry["values"]]
    if entry["stage"] != "grpo" or key.startswith("eval/"):
        return steps, values
    xs: list[float] = []
    ys: list[float] = []
    for step, value in zip(steps, values):
        if xs and step - xs[-1] > 1:
            xs.append((xs[-1] + step) / 2)
            ys.append(math.nan)
        xs.append(step)
        ys.append(value)
    return xs, ys


def moving_mean(steps: list[float], values: list[float], half: int) -> list[float]:
    """The mean of the finite values within `half` steps either side of each step (fewer at the ends
    and beside gaps), so that a missing iteration neither shifts nor zeroes the curve."""
    out = []
    for step in steps:
        near = [v for s, v in zip(steps, values) if abs(s - step) <= half and math.isfinite(v)]
        out.append(sum(near) / len(near) if near and math.isfinite(step) else math.nan)
    return out


def _plot_series(ax: Any, key: str, entry: dict[str, Any], std: dict[str, Any] | None, colour: str) -> None:
    steps, values = with_gaps(key, entry)
    # Held-out evals come every eval_every iterations, from step -1 (the starting point): larger markers.
    held_out = key == HELDOUT_KEY
    points = sum(1 for v in values if math.isfinite(v))
    if key in SMOOTHED and points >= 5:
        half = max(1, round(points / 20))
        ax.plot(steps, values, color=colour, alpha=0.3, linewidth=1, marker="o", markersize=2.5, label=f"{key} (raw)")
        smooth = [m if math.isfinite(v) else v for m, v in zip(moving_mean(steps, values, half), values)]
        ax.plot(steps, smooth, color=colour, linewidth=2, label=f"{key} (mean of {2 * half + 1} iterations)")
    else:
        marker, size = ("s", 5) if held_out else ("o", 3)
        ax.plot(steps, values, color=colour, marker=marker, markersize=size, label=key)
    if std is not None:
        # NaN where either is missing: fill_between leaves a hole there, as the line does.
        by_step = dict(zip(std["steps"], std["values"]))
        spread = [by_step.get(s, math.nan) for s in steps]
        lower = [v - d for v, d in zip(values, spread)]
        upper = [v + d for v, d in zip(values, spread)]
        ax.fill_between(steps, lower, upper, color=colour, alpha=0.15, linewidth=0)
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
