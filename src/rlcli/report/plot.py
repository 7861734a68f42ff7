"""`rlcli runs plot`: a run's curves and eval success as an image (matplotlib, no GUI)."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.errors import UsageError
from rlcli.export_folder import write_file
from rlcli.report.views import HELDOUT_KEY, REWARD_KEY, SUCCESS_KEY, metric_series, teachers_view
from rlcli.store.evals import eval_results
from rlcli.store.names import EXPERT, GRPO_STAGE
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
    ("Reverse KL to the teacher (distill)", ("train/teacher_kl",)),
    ("Entropy", ("train/entropy",)),
    ("SFT loss", ("sft/loss", "sft/eval_loss")),
)
# Noisy once per iteration: drawn as a centred moving mean over the raw points, which stay faint.
SMOOTHED = (REWARD_KEY, SUCCESS_KEY)
# 1 at a GRPO iteration that made no update, which logs no loss, KL or entropy (_mark_no_update); the
# update's metrics are train/..., the rollout's (rollout/...) and held-out evals' (eval/...) never miss one.
SKIPPED_KEY = "train/skipped"
UPDATE_PREFIX = "train/"
# Logged as 0 when the loss has no such term: the default panels leave them out then.
ZERO_WHEN_OFF = ("train/kl",)


def plot_run(
    stores: list[RunStore], out: Path, metrics: list[str] | None = None, overwrite: bool = False
) -> list[dict[str, Any]]:
    """Write a PNG (or any format matplotlib knows by the suffix) of the runs' curves and evals, one
    run's or several overlaid; an existing `out` is replaced only with `overwrite`, and whole
    (export_folder.write_file).

    Returns what it drew of each run, as `runs plot --json` prints it: "run", "series" ({key: {"stage",
    "steps", "values"}}, NaN as null) and "evals" (label, decoding, success_rate, ci_low, ci_high, tasks, k)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    suffix = out.suffix.lstrip(".").lower()
    if suffix not in FigureCanvasAgg.get_supported_filetypes():
        raise UsageError(f"Cannot write {out}: give --out a file ending in .png (or .pdf, .svg).")
    fig, drawn = runs_figure(stores, metrics)
    write_file(out, figure_bytes(fig, suffix), "--out", overwrite)
    return [
        {
            "run": run.run,
            "series": {
                key: {**entry, "values": [v if v is not None and math.isfinite(v) else None for v in entry["values"]]}
                for key, entry in run.series.items()
            },
            "evals": [
                {
                    "label": r.label,
                    "decoding": r.decoding,
                    **{k: getattr(r, k) for k in ("success_rate", "ci_low", "ci_high", "tasks", "k")},
                }
                for r in run.evals
            ],
        }
        for run in drawn
    ]


def figure_bytes(fig: Figure, fmt: str = "png", dpi: int = 110) -> bytes:
    """The figure as an image file's bytes, in a format matplotlib's Agg canvas writes (png, svg, pdf, ...)."""
    image = io.BytesIO()
    fig.savefig(image, format=fmt, dpi=dpi)
    return image.getvalue()


@dataclass(frozen=True)
class DrawnRun:
    """What a figure drew of one run: its curves ({key: {"stage", "steps", "values"}}, as
    views.metric_series gives them) and its eval bars, in the order drawn."""

    run: str
    series: dict[str, dict[str, Any]]
    evals: list[EvalResult]


@dataclass(frozen=True)
class _Loaded:
    """A run as the figure reads it."""

    name: str
    status: str
    series: dict[str, dict[str, Any]]
    evals: list[EvalResult]  # in training order
    teachers: list[tuple[str, float]]  # a distill phase's teacher and its own held-out success, drawn as a line


def run_figure(
    store: RunStore, metrics: list[str] | None = None
) -> tuple[Figure, dict[str, dict[str, Any]], list[EvalResult]]:
    """The figure of one run's curves (one panel each) and evals, the series it draws and the evals it
    draws as bars (runs_figure)."""
    fig, [drawn] = runs_figure([store], metrics)
    return fig, drawn.series, drawn.evals


def runs_figure(stores: list[RunStore], metrics: list[str] | None = None) -> tuple[Figure, list[DrawnRun]]:
    """The figure of the runs' curves, overlaid one colour a run when there are several, and their evals.

    Refused in one sentence (UsageError): a metric key no run has, or runs with no metrics and no evals."""
    runs = [
        _Loaded(
            store.run,
            store.require_run().status,
            metric_series(store),
            in_training_order(eval_results(store)),
            [(t["teacher"], t["success_rate"]) for t in teachers_view(store) if t["success_rate"] is not None],
        )
        for store in stores
    ]
    runs, panels, show_evals = _panels(runs, ", ".join(repr(store.run) for store in stores), metrics)

    # The object API with an explicit Agg canvas: no pyplot global state, no GUI backend.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator, PercentFormatter

    count = len(panels) + show_evals
    cols = 1 if count == 1 else 2
    rows = math.ceil(count / cols)
    fig = Figure(figsize=(6.0 * cols, 3.4 * rows), layout="constrained")
    FigureCanvasAgg(fig)
    overlaid = len(runs) > 1
    fig.suptitle(" vs ".join(f"{run.name} ({run.status})" for run in runs))
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax in axes:
        # Tick labels show the values themselves: an entropy between 6.2120 and 6.2125 is not
        # "0.0000 ... 0.0005" with "+6.212" in the corner.
        ax.ticklabel_format(useOffset=False)
    drawn = [DrawnRun(run.name, {}, run.evals if show_evals else []) for run in runs]
    for ax, (title, keys) in zip(axes, panels):
        for number, (run, done) in enumerate(zip(runs, drawn)):
            series = run.series
            present = [key for key in keys if key in series]
            for position, key in enumerate(present):
                # One run: a colour a key. Several: a colour a run, and the panel's second key dashed.
                colour = f"C{number if overlaid else position}"
                std = series.get("rollout/reward_std") if key == REWARD_KEY else None
                name = f"{run.name}: {key}" if overlaid else key
                _plot_series(ax, key, name, series[key], std, colour, dashed=overlaid and position > 0)
                done.series[key] = series[key]
                if std is not None:
                    done.series["rollout/reward_std"] = std
                if key.startswith(UPDATE_PREFIX) and series[key]["stage"] == GRPO_STAGE:
                    _mark_no_update(ax, series[key], series.get(SKIPPED_KEY), colour, overlaid)
        ax.set_title(title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if HELDOUT_KEY in keys:
            _draw_teachers(ax, runs, overlaid)
        if SUCCESS_KEY in keys or HELDOUT_KEY in keys:
            ax.set_ylim(-0.02, 1.02)
            ax.yaxis.set_major_formatter(PercentFormatter(1.0))
        if len(ax.get_legend_handles_labels()[0]) > 1:
            ax.legend(fontsize="small")
        ax.grid(alpha=0.3)
    if show_evals:
        _plot_evals(axes[len(panels)], [(done.run, done.evals) for done in drawn], overlaid)
    for ax in axes[count:]:
        ax.set_visible(False)
    return fig, drawn


def _panels(
    runs: list[_Loaded], names: str, metrics: list[str] | None
) -> tuple[list[_Loaded], list[tuple[str, tuple[str, ...]]], bool]:
    """The panels to draw (title, keys), whether the evals get one, and the runs without the series that
    say nothing (a KL that is 0 throughout); a UsageError for a metric no run has or nothing to plot."""
    whose = f"Run {names} has" if len(runs) == 1 else f"Runs {names} have"
    if metrics:
        known = dict.fromkeys(key for run in runs for key in run.series)
        missing = [key for key in metrics if key not in known]
        if missing:
            raise UsageError(f"{whose} no metric {missing[0]!r}; the metrics: {', '.join(known) or 'none'}.")
        panels: list[tuple[str, tuple[str, ...]]] = [(key, (key,)) for key in metrics]
    else:
        # A KL that is 0 throughout was not measured (grpo.beta 0 and no reference): a flat line says nothing.
        runs = [
            replace(run, series={k: v for k, v in run.series.items() if not (k in ZERO_WHEN_OFF and _all_zero(v))})
            for run in runs
        ]
        panels = [(title, keys) for title, keys in DEFAULT_PANELS if any(k in run.series for run in runs for k in keys)]
    show_evals = any(run.evals for run in runs) and not metrics
    if not panels and not show_evals:
        raise UsageError(f"{whose} nothing to plot yet: no metrics and no evals; train or evaluate first.")
    return runs, panels, show_evals


def _draw_teachers(ax: Any, runs: list[_Loaded], overlaid: bool) -> None:
    """What a distilled student is measured against: each teacher's own held-out success, a dotted line."""
    for number, run in enumerate(runs):
        for teacher, rate in run.teachers:
            ax.axhline(rate, color=f"C{number}" if overlaid else "grey", linestyle=":", label=f"teacher: {teacher}")


def in_training_order(evals: list[EvalResult]) -> list[EvalResult]:
    """Evals as the policy trained: base, then checkpoints by id (SFT's comes before GRPO's), the
    expert last; the evals of one policy (decodings, opponents) in the order they were stored."""
    return sorted(
        evals,
        key=lambda r: (r.checkpoint == str(EXPERT), -1 if r.checkpoint_id is None else r.checkpoint_id),
    )


def _all_zero(entry: dict[str, Any]) -> bool:
    return all(v == 0 for v in entry["values"] if v is not None and math.isfinite(v))


def _mark_no_update(
    ax: Any, entry: dict[str, Any], skipped: dict[str, Any] | None, colour: str, overlaid: bool
) -> None:
    """Shade the GRPO iterations that made no update (train/skipped: every group had equal rewards, or
    every episode was masked) where this curve has no value, as loss, KL and entropy have none there: a
    curve that stops before the last iteration then says why, and the axis reaches that iteration."""
    if skipped is None:
        return
    has_value = set(entry["steps"])
    idle = [step for step, value in zip(skipped["steps"], skipped["values"]) if value and step not in has_value]
    spans: list[list[int]] = []
    for step in idle:
        if spans and step == spans[-1][1] + 1:
            spans[-1][1] = step
        else:
            spans.append([step, step])
    for number, (first, last) in enumerate(spans):
        label = "no update: no group to learn from" if number == 0 else None
        # Several runs: each run's iterations in its colour, faint, as they may overlap.
        ax.axvspan(first - 0.5, last + 0.5, color=colour if overlaid else "0.5", alpha=0.12, linewidth=0, label=label)


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


def _plot_series(
    ax: Any,
    key: str,
    name: str,
    entry: dict[str, Any],
    std: dict[str, Any] | None,
    colour: str,
    dashed: bool = False,
) -> None:
    steps, values = with_gaps(key, entry)
    # Held-out evals come every eval_every iterations, from step -1 (the starting point): larger markers.
    held_out = key == HELDOUT_KEY
    style = "--" if dashed else "-"
    points = sum(1 for v in values if math.isfinite(v))
    if key in SMOOTHED and points >= 5:
        half = max(1, round(points / 20))
        ax.plot(steps, values, color=colour, alpha=0.3, linewidth=1, marker="o", markersize=2.5, label=f"{name} (raw)")
        smooth = [m if math.isfinite(v) else v for m, v in zip(moving_mean(steps, values, half), values)]
        ax.plot(
            steps,
            smooth,
            color=colour,
            linewidth=2,
            linestyle=style,
            label=f"{name} (mean of {2 * half + 1} iterations)",
        )
    else:
        marker, size = ("s", 5) if held_out else ("o", 3)
        ax.plot(steps, values, color=colour, marker=marker, markersize=size, linestyle=style, label=name)
    if std is not None:
        # NaN where either is missing: fill_between leaves a hole there, as the line does.
        by_step = dict(zip(std["steps"], std["values"]))
        spread = [by_step.get(s, math.nan) for s in steps]
        lower = [v - d for v, d in zip(values, spread)]
        upper = [v + d for v, d in zip(values, spread)]
        ax.fill_between(steps, lower, upper, color=colour, alpha=0.15, linewidth=0)
    ax.set_xlabel("iteration" if entry["stage"] == "grpo" else f"{entry['stage']} step")


def _plot_evals(ax: Any, runs: list[tuple[str, list[EvalResult]]], overlaid: bool) -> None:
    """A bar per eval with its 95% interval, in training order; several runs' side by side, a colour a run."""
    from matplotlib.ticker import PercentFormatter

    bars = [(number, run, r) for number, (run, evals) in enumerate(runs) for r in evals]
    labels = [
        (f"{run}\n" if overlaid else "") + (r.label if r.decoding == "greedy" else f"{r.label} {r.decoding}")
        for _, run, r in bars
    ]
    rates = [r.success_rate for _, _, r in bars]
    # Clamped at 0: at 0% or 100% the interval's rounding can put its end a hair inside the rate.
    errors = [
        [max(0.0, r.success_rate - r.ci_low) for _, _, r in bars],
        [max(0.0, r.ci_high - r.success_rate) for _, _, r in bars],
    ]
    colours = [f"C{number if overlaid else i % 10}" for i, (number, _, _) in enumerate(bars)]
    ax.bar(range(len(bars)), rates, yerr=errors, capsize=5, color=colours, alpha=0.85)
    # The rate goes under the label: inside the bar it would collide with the error bar.
    ticks = [f"{label}\n{rate:.1%}" for label, rate in zip(labels, rates)]
    ax.set_xticks(range(len(bars)), ticks, rotation=20 if len(bars) > 3 else 0)
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_title("Eval success (95% CI)")
    ax.grid(alpha=0.3, axis="y")
