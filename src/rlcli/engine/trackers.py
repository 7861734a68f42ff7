"""Live mirrors of a run's metrics in TensorBoard, Trackio, Weights & Biases or MLflow (`run.trackers`).

The run database stays the source of truth (`rlcli runs show` / `plot` read it); a tracker only
copies the metrics to a tool someone already watches. Every stage that logs metrics goes through
this module: SFT (sft/loss, sft/eval_loss, sft/lr, sft/grad_norm, sft/entropy at each optimizer step), each GRPO
phase (rollout/*, train/*, perf/*, eval/success_rate at each iteration) and each DPO stage (dpo/loss,
dpo/reward_margin, ... at each optimizer step). It opens the trackers for its metrics series and logs
beside every `rundb.log_metrics` call, with the same keys and steps:

    from rlcli.engine.trackers import stage_tracker

    with stage_tracker(ctx, "sft") as tracker:
        ...
        ctx.store.log_metrics("sft", step, values)
        tracker.log(values, step=step)

With an empty run.trackers the tracker does nothing, so the call needs no `if`.

Each library is called directly, rather than through TRL's `report_to` or accelerate's trackers.
GRPO is rlcli's own loop, not a TRL trainer, so report_to would reach SFT and DPO only, through a
second code path with TRL's names (train/loss for both) and its own handling of resumes. accelerate's
trackers run through its process state (PartialState) and would still leave what matters here to
write: wandb offline by default, the MLflow store in the run folder (its MLflowTracker logs to the
process-wide tracking URI, in the working directory by default), a resumed stage continuing its
MLflow run, no step logged twice. Called directly, a backend is one small class below.

One tracker run per metrics series, named <run>/<stage> (t/sft, t/grpo, t/dpo, t/dpo/2), so that
steps only grow within it (each DPO stage counts its steps from 1; GRPO's phases number their
iterations on), which wandb requires of a run. Where each writes:

- tensorboard: event files in <run folder>/tensorboard/<stage>/ (dpo/2 -> dpo-2).
- wandb: offline files under <run folder>/wandb/ unless WANDB_MODE says otherwise (project
  WANDB_PROJECT, default rlcli; the group is the rlcli run).
- trackio: trackio's local database (TRACKIO_DIR, default under the Hugging Face cache), project
  rlcli; a Space or server only if TRACKIO_SPACE_ID / TRACKIO_SERVER_URL is set.
- mlflow: a SQLite store in <run folder>/mlflow/ (mlflow.db, artifacts/), unless MLFLOW_TRACKING_URI
  names another store or a server; experiment MLFLOW_EXPERIMENT_NAME, default rlcli. MLflow's usage
  telemetry is off unless MLFLOW_DISABLE_TELEMETRY says otherwise.

So nothing here reaches the network unless the user set it up.

Resuming: the run database records the last step of each series sent to the trackers (tracker_steps),
just before sending it. A stage resumed after a kill redoes the steps after its last checkpoint: the
tracker skips those it sent, so no step reaches a tracker twice, and sends those it had not (with the
redone values). A step the database holds but the trackers never had, and that the stage does not redo
(GRPO stores an iteration's metrics before its held-out eval and sends them after it, with the eval's),
is sent from the database before the next step, or by send_unsent. Only a kill in the moment between
recording a step and sending it loses that step. TensorBoard appends to its folder,
trackio continues the newest run of the same name and MLflow the run with the same tags; wandb
cannot continue an offline run, so each invocation is a new wandb run, with the same name and group.
A series with nothing logged yet always starts new tracker runs.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlcli.errors import UsageError

if TYPE_CHECKING:
    from rlcli.engine.context import RunContext
    from rlcli.store.run_store import RunStore

PROJECT = "rlcli"
# Tracker name -> the package it needs (what `pip install` takes and what is imported).
PACKAGES = {"tensorboard": "tensorboard", "trackio": "trackio", "wandb": "wandb", "mlflow": "mlflow"}
# Set (unless the user set them) before the package is first imported: MLflow starts its usage
# telemetry, which sends events over the network, when it is imported.
QUIET = {"mlflow": {"MLFLOW_DISABLE_TELEMETRY": "true"}}


class Tracker:
    """Fans metrics out to every opened backend, skipping the steps a resumed stage redoes."""

    def __init__(self, backends: list[Any], after_step: int | None = None):
        self.backends = backends
        self.after_step = after_step

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.after_step is not None and step <= self.after_step:
            return  # logged before a kill; the stage redoes it after resuming from a checkpoint
        self._send(metrics, step)

    def _send(self, metrics: dict[str, Any], step: int) -> None:
        # None marks a metric with no value this step, as in RunDB.log_metrics.
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        if values:
            for backend in self.backends:
                backend.log(values, step)

    def close(self, failed: bool = False) -> None:
        for backend in self.backends:
            backend.close(failed)
        self.backends = []

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        self.close(failed=kind is not None)


class SeriesTracker(Tracker):
    """The trackers of one metrics series of a run, which record in the run database the last step they
    were sent: a step the database holds and they missed is sent from there before the next one."""

    def __init__(self, backends: list[Any], store: RunStore, stage: str, sent: int) -> None:
        super().__init__(backends, after_step=sent)  # what earlier commands sent: skipped when redone
        self.store, self.stage = store, stage
        self.sent = sent  # the last step sent, as the database records it

    def log(self, metrics: dict[str, Any], step: int) -> None:
        if self.after_step is not None and step <= self.after_step:
            return  # sent before a kill; the stage redoes it after resuming from a checkpoint
        self.send_unsent(before=step)
        self._send(metrics, step)

    def send_unsent(self, before: int | None = None) -> None:
        """Send, from the database, the series' steps after the last one sent (and before `before`)."""
        if self.backends:
            for step, values in self.store.unsent_metrics(self.stage, self.sent, before):
                self._send(values, step)

    def _send(self, metrics: dict[str, Any], step: int) -> None:
        if not self.backends:
            return
        # Recorded first, and no database write comes between the record and the send: a kill at any
        # write leaves the step both recorded and sent, or neither (and then it is sent on resume).
        if step > self.sent:  # a stage may log one step in parts (SFT's loss, then its eval loss)
            self.store.record_tracker_step(self.stage, step)
            self.sent = step
        super()._send(metrics, step)


@dataclass(frozen=True)
class TrackedSeries:
    """What a backend opens: the rlcli run, its metrics series (stage), the recipe, the run folder, and
    whether the series has steps logged already (a resumed stage: its tracker run goes on)."""

    run: str
    stage: str
    config: dict[str, Any]
    folder: Path
    resumed: bool = False

    @property
    def name(self) -> str:
        return f"{self.run}/{self.stage}"

    @property
    def slug(self) -> str:
        """The stage as one folder name: dpo/2 -> dpo-2."""
        return re.sub(r"[^A-Za-z0-9_.-]", "-", self.stage)


def stage_tracker(ctx: RunContext, stage: str) -> SeriesTracker:
    """The recipe's run.trackers, opened for the metrics series `stage` of ctx's run (sft, grpo, dpo or
    dpo/<name>); steps up to the last one sent to them are not logged again, and those after it that the
    database holds are sent before the next step."""
    (last,) = ctx.rundb.db.execute(
        "select max(step) from metrics where run = ? and stage = ?", [ctx.run, stage]
    ).fetchone()
    # after_step=last: a series with steps stored continues its tracker runs (TrackedSeries.resumed).
    tracker = open_trackers(
        ctx.recipe.run.trackers, ctx.run, ctx.recipe.to_dict(), log_dir=ctx.run_dir, stage=stage, after_step=last
    )
    sent = ctx.store.tracker_step(stage)
    if sent is None:
        # Nothing recorded: a new series (trackers get steps from 0 on; -1 is the starting point's eval,
        # which stays in the database), or one begun by an older rlcli: its steps count as sent.
        sent = -1 if last is None else max(last, -1)
        if tracker.backends:
            ctx.store.record_tracker_step(stage, sent)
    return SeriesTracker(tracker.backends, ctx.store, stage, sent)


def send_unsent(ctx: RunContext, stage: str) -> None:
    """Send run.trackers the steps of the series `stage` that the database holds and they never had (a kill
    during the held-out eval after GRPO's last iteration); opens them only when there are such steps."""
    sent = ctx.store.tracker_step(stage)
    if ctx.recipe.run.trackers and sent is not None and ctx.store.unsent_metrics(stage, sent):
        tracker = stage_tracker(ctx, stage)
        with tracker:
            tracker.send_unsent()


def open_trackers(
    names: Sequence[str],
    run_name: str,
    config: dict[str, Any],
    log_dir: str | Path | None = None,
    *,
    stage: str,
    after_step: int | None = None,
) -> Tracker:
    """Open one backend per name (duplicates once) for the metrics series `stage`; every package is
    checked before any opens. log_dir is the run's folder (default <runs-dir>/<run>). Steps up to
    after_step are not logged (None: all are)."""
    from rlcli.redaction import shareable_recipe
    from rlcli.store.db import default_runs_dir

    names = list(dict.fromkeys(names))
    check_trackers(names)
    folder = Path(log_dir) if log_dir is not None else default_runs_dir() / run_name
    # The backends' run config is shared (a W&B or MLflow server): the recipe's secrets stay out of it.
    series = TrackedSeries(run_name, stage, shareable_recipe(config), folder, resumed=after_step is not None)
    openers = {"tensorboard": _TensorBoard, "trackio": _Trackio, "wandb": _Wandb, "mlflow": _MLflow}
    backends: list[Any] = []
    try:
        for name in names:
            backends.append(openers[name](series))
    except BaseException:
        Tracker(backends).close(failed=True)
        raise
    return Tracker(backends, after_step)


def check_trackers(names: Sequence[str]) -> None:
    """Every tracker is known and its package importable (imported, with QUIET's variables set); the
    mistake and its fix in one sentence."""
    for name in names:
        if name not in PACKAGES:
            raise UsageError(f"Unknown tracker {name!r} in run.trackers: expected {', '.join(PACKAGES)}.")
        package = PACKAGES[name]
        for var, value in QUIET.get(name, {}).items():
            os.environ.setdefault(var, value)
        try:
            importlib.import_module(package)
        except ModuleNotFoundError as exc:
            if exc.name != package:  # installed, but something it needs is not
                raise UsageError(
                    f"run.trackers lists {name} but the {package} package cannot be imported ({exc}): "
                    f"`pip install -U {package}`, or remove {name} from run.trackers."
                ) from None
            raise UsageError(
                f"run.trackers lists {name} but the {package} package is not installed: "
                f"`pip install {package}`, or remove {name} from run.trackers."
            ) from None
        except Exception as exc:  # a broken install: an incompatible dependency, say
            raise UsageError(
                f"run.trackers lists {name} but the {package} package cannot be imported "
                f"({type(exc).__name__}: {exc}): `pip install -U {package}`, or remove {name} from run.trackers."
            ) from None


class _TensorBoard:
    def __init__(self, series: TrackedSeries):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(series.folder / "tensorboard" / series.slug))
        # TensorBoard renders text as markdown: a code block keeps the recipe's indentation.
        self.writer.add_text("recipe", "```\n" + json.dumps(series.config, indent=2) + "\n```")

    def log(self, values: dict[str, float], step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        # A step takes seconds or more: flushing each one lets a live TensorBoard keep up.
        self.writer.flush()

    def close(self, failed: bool) -> None:
        self.writer.close()


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """trackio prints its notes to stdout, which a --json command keeps for its JSON."""
    with contextlib.redirect_stdout(sys.stderr):
        yield


class _Trackio:
    def __init__(self, series: TrackedSeries):
        import trackio

        # A resumed stage continues its trackio run (the newest of that name); a new one starts a run, also
        # when another rlcli run of the same name (in another runs folder, say) has one in the project.
        resume = "allow" if series.resumed else "never"
        with _stdout_to_stderr():
            trackio.init(project=PROJECT, name=series.name, group=series.run, config=series.config, resume=resume)
        self.trackio = trackio

    def log(self, values: dict[str, float], step: int) -> None:
        with _stdout_to_stderr():
            self.trackio.log(values, step=step)

    def close(self, failed: bool) -> None:
        with _stdout_to_stderr():
            self.trackio.finish()  # and forgets the run, which trackio would otherwise finish again at exit


class _Wandb:
    def __init__(self, series: TrackedSeries):
        import wandb

        series.folder.mkdir(parents=True, exist_ok=True)
        # wandb writes the run's .wandb file every 15 s by default: a kill -9 would lose up to that much
        # (all of a short stage). Every second instead, where this wandb has the setting (0.2x on).
        flush: dict[str, Any] = {"x_transaction_log_flush_interval": 1.0}
        settings = wandb.Settings(**flush) if flush.keys() <= wandb.Settings.model_fields.keys() else None
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=series.name,
            group=series.run,
            job_type=series.stage.split("/")[0],  # sft, grpo or dpo
            config=series.config,
            # Offline unless the user chose a mode: no upload that was not asked for.
            mode=os.environ.get("WANDB_MODE", "offline"),  # type: ignore[arg-type]
            dir=str(series.folder),
            settings=settings,
        )

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)


class _MLflow:
    def __init__(self, series: TrackedSeries):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        local = series.folder / "mlflow"
        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            local.mkdir(parents=True, exist_ok=True)
            uri = f"sqlite:///{local.resolve() / 'mlflow.db'}"
        # "Creating initial MLflow database tables...": two INFO lines the first time, nothing to act on.
        logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)
        self.client = client = MlflowClient(tracking_uri=uri)
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT)
        experiment = client.get_experiment_by_name(experiment_name)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:  # a local store keeps its artifacts beside it, not in ./mlruns
            artifacts = None if os.environ.get("MLFLOW_TRACKING_URI") else (local.resolve() / "artifacts").as_uri()
            experiment_id = client.create_experiment(experiment_name, artifact_location=artifacts)
        tags = {"rlcli.run": series.run, "rlcli.stage": series.stage, "rlcli.folder": str(series.folder.resolve())}
        found = []
        if series.resumed:  # the series' run, if this store has it (a run name is letters, digits and -_.)
            candidates = client.search_runs([experiment_id], filter_string=f"tags.`rlcli.run` = '{series.run}'")
            found = [r for r in candidates if all(r.data.tags.get(k) == v for k, v in tags.items())]
        if found:  # a resumed stage: its run goes on
            self.run_id = found[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = client.create_run(experiment_id, run_name=series.name, tags=tags).info.run_id
            # The recipe as the run's parameters; MLflow takes at most 100 per call.
            params = [Param(k, v) for k, v in _flat(series.config).items()]
            for i in range(0, len(params), 100):
                client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, values: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, failed: bool) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _flat(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """model.name -> value: a nested recipe as MLflow parameters (keys it accepts, values it stores)."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = prefix + re.sub(r"[^\w\-. /]", "_", str(key))
        if isinstance(value, dict) and value:
            flat |= _flat(value, name + ".")
        else:
            flat[name[:250]] = (value if isinstance(value, str) else json.dumps(value))[:6000]
    return flat
