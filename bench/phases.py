"""Where does a recipe's wall-clock go? One `rlcli run`, cut into phases from its run database.

    .venv/bin/python bench/phases.py                       # recipes/quickstart.yaml
    .venv/bin/python bench/phases.py --recipe arithmetic --set grpo.iterations=4 --out /tmp/prof --markdown prof.md
    .venv/bin/python bench/phases.py --threads 1           # sets run.threads=1

What is measured: `rlcli run -r recipes/<recipe>.yaml [--set overrides]` in a runs dir of its own (--out,
default a new temporary folder; one that already holds the run is refused: a resumed run skips work),
its wall-clock and CPU time (user + system of the rlcli process and the children it waited for).
Then its run database (rlcli.db) says where the wall-clock went, one row per phase, in seconds and
as a share of the wall-clock; a phase that did not occur is left out, and the rows add up to it:

  SFT: expert demos    the sft/demos stage: the env's expert playing sft.demos episodes
  SFT: training        the sft stage less sft/demos, which runs inside it: data, model load,
                       tokenising, the Trainer's steps, saving the checkpoint
  rollout: generation  turns.gen_time_s of the episodes of every rollout/<i> (and rollout/<i>+<r>,
                       grpo.dynamic_sampling's rounds): the sampler's calls
  rollout: env steps   their turns.env_time_s: env.step after each turn
  rollout: rest        those stages' time less the two above: env resets, prompts, decoding, storing
  weight sync          perf/time_sync_s over the iterations (rollout.engine vllm): the weights go
                       into the vLLM engine just before each rollout/<i>, outside the stage
  labelling            the label/<i> stages: the recipe's rewards (perf/time_label_s times the same)
  update               the train/<i> stages: batch, logprobs, optimizer steps, checkpoint, commit
                       (perf/time_train_s times the same)
  DPO                  the dpo and dpo/<name> stages
  eval                 every eval/* stage: grpo.eval_every's during training, the recipe's at the end
  other stages         any other stage (none in an `rlcli run` of a shipped recipe)
  engine start and everything else
                       the wall-clock less all of the above: process start and imports, loading the
                       GRPO policy (and reference), the vLLM engine's start, bookkeeping between stages
A stage's time is its row's span (stages.started_at to finished_at), except for a stage run twice:
it keeps its first start (an eval of a checkpoint on grpo.eval_tasks during training, asked again
for eval.tasks at the end), so it counts from its start to the first start or end of another stage
(or weight sync) of its process inside its span, and from the last one to its end. grpo/<k> (a
later GRPO phase) holds its iterations' stages and is not counted itself.
Nothing overlaps in a synchronous run. With grpo.max_staleness > 0 a worker process plays the
rollouts while this one labels and updates, so the rollout rows overlap others and the last row
shrinks, possibly below zero; with env.workers > 0 env steps overlap each other and
generation, and "rollout: rest" may go below zero.
Threads: torch's default (one per core) unless --threads N, which adds the override run.threads=N.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from rich.text import Text  # noqa: E402

from rlcli.recipe import load_recipe  # noqa: E402
from rlcli.store.db import RunDB  # noqa: E402
from rlcli.store.names import (  # noqa: E402
    DpoStage,
    GrpoLabelStage,
    GrpoStage,
    RolloutStage,
    SftStage,
    TrainStage,
    try_parse_stage,
)
from rlcli.store.run_store import RunStore  # noqa: E402
from rlcli.store.timings import turn_times  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The rows, in order, with where each one's seconds come from.
SOURCES = {
    "SFT: expert demos": "stage sft/demos",
    "SFT: training": "stage sft less sft/demos",
    "rollout: generation": "turns.gen_time_s of rollout/*",
    "rollout: env steps": "turns.env_time_s of rollout/*",
    "rollout: rest": "rollout/* stages less the two above",
    "weight sync": "metric perf/time_sync_s",
    "labelling": "stages label/<i>",
    "update": "stages train/<i>",
    "DPO": "stages dpo, dpo/<name>",
    "eval": "stages eval/*",
    "other stages": "any other stage",
    "engine start and everything else": "wall-clock less the rows above",
}


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float


@dataclass(frozen=True)
class Span:
    """A stretch of one process's time: a stage's row, or the weight sync before a rollout stage."""

    name: str
    pid: int | None
    start: float
    end: float


def family(name: str) -> str:
    """The row a stage's time goes to."""
    stage = try_parse_stage(name)
    if isinstance(stage, SftStage):
        return "SFT: expert demos" if stage.demos else "SFT: training"
    if isinstance(stage, RolloutStage):
        return "rollout"
    if isinstance(stage, GrpoLabelStage):
        return "labelling"
    if isinstance(stage, TrainStage):
        return "update"
    if isinstance(stage, DpoStage):
        return "DPO"
    return "eval" if name.startswith("eval/") else "other stages"


def own_seconds(span: Span, others: list[Span]) -> float:
    """The span's time less that of the other spans of its process that start or end inside it (its
    own inner stage, sft/demos in sft; or, for a stage run twice, everything between its two runs)."""
    ends = [t for o in others if o.pid == span.pid and o is not span for t in (o.start, o.end)]
    inside = [t for t in ends if span.start < t < span.end]
    return (min(inside) - span.start) + (span.end - max(inside)) if inside else span.end - span.start


def phases(rundb: RunDB, run: str, wall_s: float) -> list[Phase]:
    """The run's wall-clock `wall_s` cut into the phases of the module docstring (those that occur)."""
    spans = [
        Span(s.name, s.pid, _t(s.started_at), _t(s.finished_at))
        for s in rundb.stages(run)
        if s.started_at and s.finished_at and not isinstance(try_parse_stage(s.name), GrpoStage)
    ]
    syncs = {m.step: m.value for m in rundb.metrics(run, "perf/time_sync_s")}
    everyone = list(spans)
    for span in spans:  # a sync ends where its rollout/<i> starts
        it = _synced_iteration(span.name)
        if it is not None and it in syncs:
            everyone.append(Span("sync", span.pid, span.start - syncs[it], span.start))
    seconds = dict.fromkeys(SOURCES, 0.0)
    rollout_s = 0.0
    for span in spans:
        row, own = family(span.name), own_seconds(span, everyone)
        if row == "rollout":
            rollout_s += own
        else:
            seconds[row] += own
    times = [
        t for name, t in turn_times(RunStore(rundb, run)).items() if isinstance(try_parse_stage(name), RolloutStage)
    ]
    seconds["rollout: generation"] = sum(t.gen_s for t in times)
    seconds["rollout: env steps"] = sum(t.env_s for t in times)
    seconds["rollout: rest"] = rollout_s - seconds["rollout: generation"] - seconds["rollout: env steps"]
    seconds["weight sync"] = sum(syncs.values())
    seconds["engine start and everything else"] = wall_s - sum(seconds.values())
    occurs = {"rollout: rest": rollout_s > 0, "engine start and everything else": True}
    return [Phase(name, s) for name, s in seconds.items() if occurs.get(name, s != 0)]


def _synced_iteration(name: str) -> int | None:
    """i of rollout/<i>, which the weight sync of iteration i precedes (not rollout/<i>+<r>, a round)."""
    stage = try_parse_stage(name)
    return stage.iteration if isinstance(stage, RolloutStage) and stage.round == 0 else None


def _t(stamp: str) -> float:
    return dt.datetime.fromisoformat(stamp).timestamp()


def cells(phase: Phase, wall_s: float) -> list[str]:
    return [phase.name, f"{phase.seconds:.1f}", f"{phase.seconds / wall_s:.1%}", SOURCES[phase.name]]


def table(rows: list[Phase], wall_s: float, title: str) -> Table:
    t = Table(title=Text(title))
    for col in ("phase", "seconds", "share", "from"):
        t.add_column(col, justify="right" if col in ("seconds", "share") else "left")
    for phase in rows:
        t.add_row(*cells(phase, wall_s))
    return t


def markdown(rows: list[Phase], wall_s: float, title: str) -> str:
    lines = [f"{title}.", "", "| phase | seconds | share | from |", "|---|---:|---:|---|"]
    lines += ["| " + " | ".join(cells(phase, wall_s)) + " |" for phase in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default="quickstart", help="A recipe under recipes/ (its name) or a path.")
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], help="Recipe overrides (key=value).")
    parser.add_argument("--out", type=Path, help="The runs dir (default: a new temporary folder).")
    parser.add_argument("--threads", type=int, help="run.threads (default: torch's, one per core).")
    parser.add_argument("--markdown", type=Path, help="Also write the table as Markdown to this file.")
    args = parser.parse_args()

    named = not args.recipe.endswith((".yaml", ".yml"))
    recipe = ROOT / "recipes" / f"{args.recipe}.yaml" if named else Path(args.recipe).resolve()
    overrides = [*args.overrides, *([f"run.threads={args.threads}"] if args.threads else [])]
    resolved = load_recipe(recipe, overrides)
    run = resolved.run.name
    out = (args.out or Path(tempfile.mkdtemp(prefix="rlcli-phases-"))).resolve()
    if (out / run).exists():
        raise SystemExit(f"{out} already holds run {run!r}: a resumed run would skip work; give another --out.")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = str(resolved.run.threads) if resolved.run.threads else f"torch default ({cores} cores)"
    console = Console()
    console.print(
        f"rlcli run -r {recipe} {' '.join(overrides)} in {out}, threads: {threads}", style="bold", markup=False
    )

    command = [sys.executable, "-m", "rlcli", "--runs-dir", str(out), "run", "-r", str(recipe), *overrides]
    t0, cpu0 = time.perf_counter(), _children_cpu_s()
    code = subprocess.run(command, cwd=ROOT).returncode  # its live view goes to this terminal
    wall_s, cpu_s = time.perf_counter() - t0, _children_cpu_s() - cpu0
    if code != 0:
        raise SystemExit(f"rlcli run failed with exit code {code} (its output is above)")

    rundb = RunDB.open(out)
    try:
        rows = phases(rundb, run, wall_s)
    finally:
        rundb.close()
    title = f"{recipe.stem} {' '.join(overrides)}: wall-clock {wall_s:.1f} s, CPU {cpu_s:.1f} s, threads: {threads}"
    console.print(table(rows, wall_s, title))
    console.print(f"The run is in {out}; delete it when done (its checkpoints take room).")
    if args.markdown:
        args.markdown.write_text(markdown(rows, wall_s, title))


def _children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    main()
