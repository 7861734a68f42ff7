"""Live mirrors of a run's metrics in TensorBoard, Trackio or Weights & Biases (`run.trackers`).

The run database stays the source of truth (`rlcli runs show` / `plot` read it); a tracker only
copies the metrics to a tool someone already watches. Nothing here reaches the network unless the
user set it up: wandb runs offline unless WANDB_MODE says otherwise, trackio writes its local
database unless a Space is configured (TRACKIO_SPACE_ID), TensorBoard writes event files.

The training loop opens the trackers once and logs beside every `rundb.log_metrics` call:

    from rlcli.engine.trackers import open_trackers

    with open_trackers(recipe.run.trackers, ctx.run, recipe.to_dict(), log_dir=ctx.run_dir) as tracker:
        for it in range(start_iter, cfg.iterations):
            ...
            ctx.rundb.log_metrics(ctx.run, METRICS_STAGE, it, values)
            tracker.log(values, step=it)

With an empty list the tracker does nothing, so the call needs no `if`.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlcli.errors import UsageError

PROJECT = "rlcli"
# Tracker name -> the package it needs (what `pip install` takes and what is imported).
PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb"}


class Tracker:
    """Fans metrics out to every opened backend."""

    def __init__(self, backends: list[Any]):
        self.backends = backends

    def log(self, metrics: dict[str, Any], step: int) -> None:
        # None marks a metric with no value this step, as in RunDB.log_metrics.
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        if values:
            for backend in self.backends:
                backend.log(values, step)

    def close(self) -> None:
        for backend in self.backends:
            backend.close()
        self.backends = []

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trackers(
    names: Sequence[str], run_name: str, config: dict[str, Any], log_dir: str | Path | None = None
) -> Tracker:
    """Open one backend per name (duplicates once); every package is checked before any opens.

    log_dir is the run's folder (default <runs-dir>/<run>): TensorBoard writes to log_dir/tensorboard,
    wandb its offline files under log_dir/wandb.
    """
    from rlcli.store.db import default_runs_dir

    names = list(dict.fromkeys(names))
    check_trackers(names)
    folder = Path(log_dir) if log_dir is not None else default_runs_dir() / run_name
    openers = {"tensorboard": _TensorBoard, "trackio": _Trackio, "wandb": _Wandb}
    return Tracker([openers[name](run_name, config, folder) for name in names])


def check_trackers(names: Sequence[str]) -> None:
    """Every tracker is known and its package installed (found, not imported: wandb takes seconds)."""
    for name in names:
        if name not in PACKAGES:
            raise UsageError(f"Unknown tracker {name!r} in run.trackers: expected {', '.join(PACKAGES)}.")
        package = PACKAGES[name]
        if importlib.util.find_spec(package) is None:
            raise UsageError(
                f"run.trackers lists {name} but the {package} package is not installed: "
                f"`pip install {package}`, or remove {name} from run.trackers."
            )


class _TensorBoard:
    def __init__(self, run_name: str, config: dict[str, Any], log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))
        # TensorBoard renders text as markdown: a code block keeps the recipe's indentation.
        self.writer.add_text("recipe", "```\n" + json.dumps(config, indent=2) + "\n```")

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        # An iteration takes seconds or more: flushing each one lets a live TensorBoard keep up.
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Trackio:
    def __init__(self, run_name: str, config: dict[str, Any], log_dir: Path):
        import trackio

        # resume="allow": a resumed rlcli run continues its trackio run instead of starting a new one.
        trackio.init(project=PROJECT, name=run_name, config=config, resume="allow")
        self.trackio = trackio

    def log(self, values: dict[str, float], step: int) -> None:
        self.trackio.log(values, step=step)

    def close(self) -> None:
        self.trackio.finish()


class _Wandb:
    def __init__(self, run_name: str, config: dict[str, Any], log_dir: Path):
        import wandb

        log_dir.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=run_name,
            config=config,
            # Offline unless the user chose a mode: no upload that was not asked for.
            mode=os.environ.get("WANDB_MODE", "offline"),
            dir=str(log_dir),
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()
