"""Does GRPO learn, on every shipped recipe that has a task? Base, SFT, final and best held-out success.

    .venv/bin/python bench/learning.py                         # every row (about an hour or more on 2 cores)
    .venv/bin/python bench/learning.py --only quickstart rg_basic_arithmetic
    .venv/bin/python bench/learning.py --out bench/learning-runs --markdown learning.md
    .venv/bin/python bench/learning.py --set rollout.engine=vllm    # an override applied to every row

What is measured, per recipe (one row each):
  * `rlcli run -r recipes/<name>.yaml` as shipped, in a runs dir of its own under --out, with the
    overrides given by --set; its wall-clock is the row's "wall-clock" (SFT, GRPO with any eval during
    training the recipe asks for, and the recipe's own final evals), and its CPU time (user + system
    of the rlcli process), which a busy machine does not inflate as it does wall-clock.
  * Then `rlcli eval` of base, sft (when the recipe has SFT), final (the last GRPO checkpoint) and
    best (the checkpoint with the best held-out success during training; needs grpo.eval_every) on
    the recipe's eval tasks and decoding. Evals the run already did are reused, not redone.
  * Success rate with its 95% Wilson interval for each (a two-player game's: its win rate against the
    first of eval.opponents), and two verdicts: "≥ SFT" says whether the
    run's result (best with grpo.keep_best, else final) is not below SFT (or base,
    without SFT) beyond the intervals, i.e. its interval's upper end reaches the SFT point estimate;
    "final ≥ SFT" says the same of the last checkpoint.
A recipe that is re-run with the same --out resumes (and, done, only re-reads its results and its
first timing), so the table can be built up a few rows at a time. The table goes to stdout, and as Markdown to --markdown.
Threads: whatever torch picks (one per core) unless --threads; run it alone on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# The shipped recipes with a task that runs on a CPU; gpu_1x/gpu_2x are for GPUs (a 1.5B model).
RECIPES = (
    "quickstart",
    "arithmetic",
    "calculator",
    "multihop_search",
    "miniwob_axtree",  # needs a Chromium (make browser) and rlcli[web]
    "dr_grpo",
    "gspo",
    "qlora_4bit",
    "reasoning_gym",
    "rg_basic_arithmetic",
    "rg_word_reversal",
    "textarena",
    "textarena_blackjack",
    "tictactoe_selfplay",  # success: the win rate against the first of eval.opponents (random)
    "verifiers_guess",
)


@dataclass
class Point:
    """One checkpoint's held-out success: the rate and its 95% interval, over `tasks` tasks."""

    checkpoint: str
    checkpoint_id: int | None
    success: float
    low: float
    high: float
    tasks: int

    def cell(self) -> str:
        return f"{self.success:.2f} [{self.low:.2f}, {self.high:.2f}]"


@dataclass
class Row:
    recipe: str
    seconds: float | None
    cpu_seconds: float | None
    points: dict[str, Point]
    latest_is: str  # which point is the run's result: best (grpo.keep_best) or final

    def not_below_reference(self, which: str) -> bool | None:
        """Not below SFT (base without SFT) beyond the interval: its upper end reaches the reference."""
        reference = self.points.get("sft") or self.points.get("base")
        point = self.points.get(which)
        if reference is None or point is None:
            return None
        return point.high >= reference.success


def rlcli(runs_dir: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rlcli", "--runs-dir", str(runs_dir), *args]
    return subprocess.run(command, cwd=ROOT, text=True, capture_output=True)


def check(result: subprocess.CompletedProcess, what: str) -> str:
    if result.returncode != 0:
        sys.stderr.write(result.stdout + result.stderr)
        raise SystemExit(f"{what} failed with exit code {result.returncode} (its output is above)")
    return result.stdout


def run_row(name: str, out: Path, overrides: list[str], console: Console) -> Row:
    recipe = ROOT / "recipes" / f"{name}.yaml"
    runs_dir = out / name
    runs_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"[bold]{name}[/]: rlcli run -r {recipe.relative_to(ROOT)} {' '.join(overrides)}")
    t0, cpu0 = time.perf_counter(), children_cpu_s()
    check(rlcli(runs_dir, "run", "-r", str(recipe), *overrides), f"rlcli run ({name})")
    seconds, cpu_seconds = time.perf_counter() - t0, children_cpu_s() - cpu0
    timing = runs_dir / "bench-seconds.json"
    if timing.exists():  # the run was done before: this call only re-read it
        seconds, cpu_seconds = (json.loads(timing.read_text())[k] for k in ("seconds", "cpu_seconds"))
    else:
        timing.write_text(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds}))

    from rlcli.recipe import load_recipe
    from rlcli.store.checkpoints import train_checkpoints
    from rlcli.store.db import RunDB
    from rlcli.store.run_store import RunStore

    resolved = load_recipe(recipe, overrides)
    rundb = RunDB.open(runs_dir)
    try:
        final = train_checkpoints(RunStore(rundb, resolved.run.name))[-1]
    finally:
        rundb.close()
    wanted = {"base": "base", "final": str(final.id)}
    if resolved.sft.source != "none":
        wanted["sft"] = "sft"
    if resolved.grpo.eval_every:
        wanted["best"] = "best"
    points = {}
    for label, which in wanted.items():  # one call each: eval reports a checkpoint asked for twice once
        args = ["eval", "-r", str(recipe), *overrides, "-c", which, "--json"]
        # Two-player games with eval.opponents: one result per opponent, the first (random) is the row's.
        result = json_list(check(rlcli(runs_dir, *args), f"rlcli eval -c {which} ({name})"))[0]
        points[label] = Point(
            checkpoint=label,
            checkpoint_id=result.get("checkpoint_id"),
            success=result["success_rate"],
            low=result["ci_low"],
            high=result["ci_high"],
            tasks=result["tasks"],
        )
    return Row(name, seconds, cpu_seconds, points, "best" if resolved.grpo.keep_best else "final")


def json_list(stdout: str) -> list:
    """The JSON list `--json` prints, even when a library wrote log lines to stdout before it."""
    start = next((i for i, line in enumerate(stdout.splitlines()) if line.startswith("[")), None)
    if start is None:
        raise SystemExit(f"no JSON in rlcli's output:\n{stdout}")
    return json.loads("\n".join(stdout.splitlines()[start:]))


def children_cpu_s() -> float:
    """CPU seconds (user + system) of this process's finished children: unlike wall-clock, it does
    not grow when other work shares the machine."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


COLUMNS = (
    "recipe",
    "tasks",
    "base",
    "SFT",
    "final",
    "best",
    "result",
    "≥ SFT",
    "final ≥ SFT",
    "wall-clock",
    "CPU time",
)


def cells(row: Row) -> list[str]:
    points = [row.points[k].cell() if k in row.points else "–" for k in ("base", "sft", "final", "best")]
    tasks = next(iter(row.points.values())).tasks if row.points else 0
    verdicts = [_yes_no(row.not_below_reference(row.latest_is)), _yes_no(row.not_below_reference("final"))]
    minutes = [f"{s / 60:.1f} min" if s is not None else "–" for s in (row.seconds, row.cpu_seconds)]
    return [row.recipe, str(tasks), *points, row.latest_is, *verdicts, *minutes]


def _yes_no(value: bool | None) -> str:
    return "–" if value is None else ("yes" if value else "NO")


def table(rows: list[Row], threads: str) -> Table:
    t = Table(title=f"Held-out success (95% Wilson CI), threads: {threads}")
    for col in COLUMNS:
        t.add_column(col, justify="left" if col == "recipe" else "right")
    for row in rows:
        t.add_row(*cells(row))
    return t


def markdown(rows: list[Row], threads: str) -> str:
    lines = [
        f"Held-out success, 95% Wilson intervals; threads: {threads}.",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|---|" + "---:|" * (len(COLUMNS) - 1),
    ]
    lines += ["| " + " | ".join(cells(row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", choices=RECIPES, help="Run only these recipes (default: all).")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "learning-runs", help="Runs dirs go here.")
    parser.add_argument("--set", dest="overrides", nargs="+", default=[], help="Recipe overrides for every row.")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's, one per core).")
    parser.add_argument("--markdown", type=Path, help="Also write the table as Markdown to this file.")
    args = parser.parse_args()

    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the rlcli subprocesses inherit it
    threads = str(args.threads) if args.threads else f"torch default ({os.cpu_count()} cores)"
    console = Console()
    rows = []
    for name in args.only or RECIPES:
        rows.append(run_row(name, args.out.resolve(), args.overrides, console))
        console.print(table(rows, threads))
    if args.markdown:
        args.markdown.write_text(markdown(rows, threads))


if __name__ == "__main__":
    main()
