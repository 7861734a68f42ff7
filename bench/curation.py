"""Does task curation pay for itself? Default GRPO against curriculum + dynamic sampling + replay, at equal compute.

    .venv/bin/python bench/curation.py --threads 1 --out /tmp/curation       # 2 tasks x 2 settings x 3 seeds
    .venv/bin/python bench/curation.py --tasks quickstart --seeds 0 --budget 60   # a quick look
    .venv/bin/python bench/curation.py --tasks quickstart --settings default curated lean dapo

For each task, seed and setting, in a runs dir of its own under --out:
  1. `rlcli sft`, when the task's recipe has SFT. Not counted: it is the same in both settings.
  2. `rlcli train grpo` with no eval during training and more iterations than the budget allows, killed
     (kill -9, which rlcli is built to survive) once the process has used --budget CPU seconds. The
     budget is CPU time (user + system), not wall-clock, so that a machine shared with other work
     gives both settings the same compute; each checkpoint's CPU time is read off a trace of the
     process's CPU time taken every half second.
  3. `rlcli eval` of the last checkpoint made within 70% of the budget and of the last one made
     within the budget, on the recipe's held-out tasks and decoding (--eval-tasks of them).
The settings:
  * default: the recipe as shipped (a fresh task every draw, sequential seeds);
  * curated: a 64-task pool (env.tasks), grpo.sampling=curriculum, grpo.dynamic_sampling=true (twice
    rollout.tasks tasks in the one rollout, informative groups first, the unused ones carried one
    iteration), and grpo.replay (1 stored success joins a group that has none);
  * lean (for the quickstart, whose rollout.tasks is 4): curated with rollout.tasks 2, so that it plays
    as many tasks as the default (2 x 2) and trains on the 2 most informative groups of them (and what
    was carried); on arithmetic (rollout.tasks 2) it is curated again;
  * dapo: lean's dynamic sampling alone (grpo.dynamic_sampling, oversample 2, rollout.tasks 2) on the
    default's fresh tasks: no pool, curriculum or replay;
  * t08: the rollouts sampled at 0.8, as the quickstart was until 2026-11-28 (issue 52's default GRPO);
  * branch: grpo.branch with 4 points an iteration and 2 continuations each (rewind and branch).
The tasks: the quickstart (guess_number, SFT then GRPO) and arithmetic with 3-digit numbers (no SFT).
Reported per task and setting, pooled over the seeds: held-out success at 70% and 100% of the budget
with 95% Wilson intervals, iterations done, the share of trained groups with zero reward variance, the
iterations that trained on nothing (every group equal), and rollouts per useful (non-zero variance)
group. Issue 38's target: curated at 70% of the budget reaches default at 100%, or curated beats
default at 100% beyond the intervals.
A finished cell is re-read, not re-run, when the same --out is given again.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from learning import ROOT, check, json_list, rlcli  # noqa: E402
from rlcli.engine.evaluate import wilson_interval  # noqa: E402

TASKS = {
    "quickstart": ("quickstart", []),
    "arithmetic3": ("arithmetic", ["env.kwargs.digits=3"]),
}
SETTINGS = {
    "default": [],
    "curated": [
        "env.tasks=[0, 64]",
        "grpo.sampling=curriculum",
        "grpo.dynamic_sampling=true",
        "grpo.oversample=2",
        "grpo.replay={max_per_group: 1, min_reward: 1.0}",
    ],
    # On the quickstart (rollout.tasks 4), curated at the default's generation cost per iteration: as many
    # tasks played (2 x 2), half as many groups trained on, the most informative.
    "lean": [
        "env.tasks=[0, 64]",
        "grpo.sampling=curriculum",
        "grpo.dynamic_sampling=true",
        "grpo.oversample=2",
        "rollout.tasks=2",
        "grpo.replay={max_per_group: 1, min_reward: 1.0}",
    ],
    # Dynamic sampling alone, on the default's tasks (fresh ones, in order) at its generation cost: no pool,
    # curriculum or replay.
    "dapo": ["grpo.dynamic_sampling=true", "grpo.oversample=2", "rollout.tasks=2"],
    # Issue 52: the quickstart's sampling before it shipped rollout.temperature 1.2 (2026-11-28), the
    # "default GRPO" the issue measures against; and rewind and branch on top of the shipped recipe.
    "t08": ["rollout.temperature=0.8"],
    "branch": ["grpo.branch={points: 4, continuations: 2}"],
}
# Eval during training would spend the budget on evaluation; keep_best would make `latest` depend on it;
# the checkpoint at 70% of the budget must keep its weights (the quickstart keeps only the newest).
COMMON = ["grpo.eval_every=0", "grpo.keep_best=false", "grpo.iterations=10000", "grpo.keep_checkpoints=null"]
EARLY = 0.7  # the "in at most 70% of the CPU budget"
TRACE_EVERY_S = 0.5


@dataclass
class Cell:
    """One (task, setting, seed): held-out success at 70% and 100% of the budget, and the signal."""

    successes: dict[str, tuple[int, int]]  # "early" | "full" -> (successes, tasks)
    iterations: int
    groups: int
    zero_var_groups: int
    rollouts: int
    empty: int | None = None  # iterations that trained on nothing (not counted by cells before 2026-11-29)


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process and its waited-for children, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


def run_on_budget(runs_dir: Path, args: list[str], budget: float) -> list[tuple[float, float]]:
    """Run `rlcli <args>` until it exits or has used `budget` CPU seconds; the (time, CPU) trace."""
    command = [sys.executable, "-m", "rlcli", "--runs-dir", str(runs_dir), *args]
    log = (runs_dir / "bench-grpo.log").open("w")
    proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    trace = []
    while proc.poll() is None:
        try:
            used = cpu_seconds(proc.pid)
        except (FileNotFoundError, ProcessLookupError):
            break
        trace.append((time.time(), used))
        if used >= budget:
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(TRACE_EVERY_S)
    proc.wait()
    log.close()
    return trace


def cpu_at(trace: list[tuple[float, float]], created_at: str) -> float:
    """The process's CPU time when a checkpoint row was written (the last sample before it)."""
    when = dt.datetime.fromisoformat(created_at).timestamp()
    before = [cpu for t, cpu in trace if t <= when]
    return before[-1] if before else 0.0


def run_cell(task: str, setting: str, seed: int, out: Path, budget: float, extra: list[str], console: Console) -> Cell:
    recipe_name, task_overrides = TASKS[task]
    recipe = ROOT / "recipes" / f"{recipe_name}.yaml"
    runs_dir = out / f"{task}-{setting}-seed{seed}"
    done = runs_dir / "bench-cell.json"
    if done.exists():
        return Cell(**json.loads(done.read_text()))
    if runs_dir.exists():
        raise SystemExit(f"{runs_dir} holds an unfinished cell: its CPU trace is lost, so remove it and run again.")
    runs_dir.mkdir(parents=True)
    overrides = [f"run.seed={seed}", *task_overrides, *SETTINGS[setting], *COMMON, *extra]
    console.print(f"[bold]{task} {setting} seed {seed}[/]: {' '.join(overrides)}")

    from rlcli.recipe import load_recipe
    from rlcli.store.checkpoints import train_checkpoints
    from rlcli.store.db import RunDB
    from rlcli.store.run_store import RunStore

    resolved = load_recipe(recipe, overrides)
    if resolved.sft.source != "none":
        check(rlcli(runs_dir, "sft", "-r", str(recipe), *overrides), f"rlcli sft ({task}, seed {seed})")
    trace = run_on_budget(runs_dir, ["train", "grpo", "-r", str(recipe), *overrides], budget)

    rundb = RunDB.open(runs_dir)
    try:
        made = [(cpu_at(trace, c.created_at), c) for c in train_checkpoints(RunStore(rundb, resolved.run.name))]
        groups = _metric_sum(rundb, resolved.run.name, "train/groups")
        zero_var = _metric_sum(rundb, resolved.run.name, "train/zero_var_groups")
        empty = sum(m.value == 0 for m in rundb.metrics(resolved.run.name, "train/sequences"))
        played = rundb.db.execute(
            "select count(*) from episodes where run = ? and stage like 'rollout/%'", [resolved.run.name]
        ).fetchone()[0]
    finally:
        rundb.close()
    if not made:
        raise SystemExit(f"{task} {setting} seed {seed}: no GRPO checkpoint within {budget:.0f} CPU s; raise --budget.")
    successes = {}
    for label, share in (("early", EARLY), ("full", 1.0)):
        within = [c for cpu, c in made if cpu <= share * budget] or [made[0][1]]
        args = ["eval", "-r", str(recipe), *overrides, "-c", str(within[-1].id), "--json"]
        (result,) = json_list(check(rlcli(runs_dir, *args), f"rlcli eval ({task}, {setting}, seed {seed})"))
        successes[label] = (round(result["success_rate"] * result["tasks"]), result["tasks"])
    cell = Cell(successes, len(made), int(groups), int(zero_var), int(played), int(empty))
    done.write_text(json.dumps(cell.__dict__))
    return cell


def _metric_sum(rundb, run: str, key: str) -> float:
    return sum(m.value for m in rundb.metrics(run, key))


def summary(cells: list[Cell]) -> list[str]:
    """One table row's cells, pooled over the seeds."""
    row = []
    for label in ("early", "full"):
        hits = sum(c.successes[label][0] for c in cells)
        n = sum(c.successes[label][1] for c in cells)
        p, (low, high) = hits / n, wilson_interval(hits, n)
        per_seed = "/".join(f"{c.successes[label][0] / c.successes[label][1]:.2f}" for c in cells)
        row.append(f"{p:.2f} [{low:.2f}, {high:.2f}] ({per_seed})")
    groups = sum(c.groups for c in cells)
    useful = groups - sum(c.zero_var_groups for c in cells)
    row.append(f"{sum(c.iterations for c in cells) / len(cells):.1f}")
    row.append(f"{sum(c.zero_var_groups for c in cells) / max(groups, 1):.2f}")
    counted = [c.empty for c in cells if c.empty is not None]
    row.append("/".join(map(str, counted)) if len(counted) == len(cells) else "–")
    row.append(f"{sum(c.rollouts for c in cells) / useful:.1f}" if useful else "–")
    return row


COLUMNS = (
    "task",
    "setting",
    "held-out at 70% (per seed)",
    "held-out at 100% (per seed)",
    "iterations",
    "0-var share",
    "iterations training nothing (per seed)",
    "rollouts / useful group",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS), help="Which tasks.")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="run.seed values.")
    parser.add_argument(
        "--settings",
        nargs="+",
        choices=list(SETTINGS),
        default=["default", "curated"],
        help="Which settings (lean and dapo on request).",
    )
    parser.add_argument("--budget", type=float, default=240.0, help="CPU seconds of `rlcli train grpo` per cell.")
    parser.add_argument("--eval-tasks", type=int, default=64, help="Held-out tasks per eval (eval.tasks).")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "curation-runs", help="Runs dirs go here.")
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], help="Recipe overrides for every cell.")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core).")
    parser.add_argument("--markdown", type=Path, help="Also write the table as Markdown to this file.")
    args = parser.parse_args()

    extra = [f"eval.tasks={args.eval_tasks}", *args.overrides]
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the rlcli subprocesses inherit it
        extra.append(f"run.threads={args.threads}")
    console = Console()
    rows = []
    for task in args.tasks:
        for setting in args.settings:
            cells = [run_cell(task, setting, s, args.out.resolve(), args.budget, extra, console) for s in args.seeds]
            rows.append([task, setting, *summary(cells)])
    title = (
        f"Held-out success (95% Wilson CI, pooled over seeds {args.seeds}) at equal CPU budget "
        f"{args.budget:.0f} s; threads: {args.threads or 'torch default'}"
    )
    table = Table(title=title)
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("task", "setting") else "right")
    for row in rows:
        table.add_row(*row)
    console.print(table)
    if args.markdown:
        lines = [title + ".", "", "| " + " | ".join(COLUMNS) + " |", "|---|---|" + "---:|" * (len(COLUMNS) - 2)]
        args.markdown.write_text("\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n")


if __name__ == "__main__":
    main()
