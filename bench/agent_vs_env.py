"""An agent program against its env form: does GRPO through rlcli's endpoint learn as GRPO on the env does?

    .venv/bin/python bench/agent_vs_env.py                    # about 35 minutes on 2 cores
    .venv/bin/python bench/agent_vs_env.py --out bench/agent-runs --markdown agent.md
    .venv/bin/python bench/agent_vs_env.py --quick --out /tmp/agent-quick     # checks that it runs, ~10 min
    .venv/bin/python bench/agent_vs_env.py --seed 1 --out bench/agent-runs-1  # another GRPO seed, same start

The task is multihop_search (1 hop): SmolLM2-135M-Instruct looks an entity up with `search` and `open`
and answers. One runs dir under --out holds:
  1. `rlcli sft -r recipes/multihop_search.yaml` (SFT on 48 expert lookups) and that SFT checkpoint
     exported merged (`rlcli export --checkpoint sft --merge`): the start of both forms;
  2. the agent form, `rlcli run -r recipes/multihop_search_agent.yaml` (the task as an OpenAI-SDK agent,
     envs/agents/multihop_search.py) from the merged model;
  3. the env form, `rlcli run -r recipes/multihop_search.yaml` from the same merged model with the same
     GRPO settings (20 iterations of 4 tasks x 8 samples) and no SFT of its own.
Each form's base (the merged SFT model) and final checkpoint are evaluated on the same 96 held-out
questions, greedy: success with its 95% Wilson interval, and each run's wall-clock and CPU time (user +
system of the rlcli process and its children, which include the agent's processes). A re-run with the same
--out resumes and re-reads what is done. Threads: torch's default (one per core); run it alone.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from learning import ROOT, Point, check, children_cpu_s, json_list, rlcli

RUNS = {
    "agent": ("multihop_search_agent", []),
    "env": ("multihop_search", ["run.name=multihop_search_env", "sft.source=none"]),
}


def timed(runs_dir: Path, name: str, *args: str) -> tuple[float, float]:
    """Run an rlcli command once; its wall-clock and CPU seconds, kept in runs_dir for a re-run to re-read."""
    timing = runs_dir / f"bench-{name}.json"
    if timing.exists():
        check(rlcli(runs_dir, *args), name)  # done before: resumes to nothing, or finishes what a kill left
        saved = json.loads(timing.read_text())
        return saved["seconds"], saved["cpu_seconds"]
    t0, cpu0 = time.perf_counter(), children_cpu_s()
    check(rlcli(runs_dir, *args), name)
    seconds, cpu = time.perf_counter() - t0, children_cpu_s() - cpu0
    timing.write_text(json.dumps({"seconds": seconds, "cpu_seconds": cpu}))
    return seconds, cpu


def evaluate(runs_dir: Path, recipe: Path, overrides: list[str], which: str) -> Point:
    result = json_list(check(rlcli(runs_dir, "eval", "-r", str(recipe), *overrides, "-c", which, "--json"), which))[0]
    return Point(
        which, result.get("checkpoint_id"), result["success_rate"], result["ci_low"], result["ci_high"], result["tasks"]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "agent-runs", help="Runs dir of the comparison.")
    parser.add_argument("--markdown", type=Path, help="Also write the table as Markdown here.")
    parser.add_argument(
        "--quick", action="store_true", help="2 GRPO iterations and 8 held-out tasks: checks the script runs."
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="run.seed of both GRPO runs (sampling); SFT and its start are seed 0's."
    )
    parser.add_argument("--form", choices=[*RUNS, "both"], default="both", help="Which form(s) to run.")
    args = parser.parse_args()
    quick = ["grpo.iterations=2", "eval.tasks=8", "sft.demos=8"] if args.quick else []
    console = Console(stderr=True)
    runs_dir = args.out.resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    merged = runs_dir / "multihop_search-sft"
    console.print("SFT on expert lookups, exported merged")
    sft = ["sft", "-r", str(ROOT / "recipes" / "multihop_search.yaml"), *quick]
    check(rlcli(runs_dir, *sft), "rlcli sft")  # done: a no-op
    if not merged.exists():
        check(rlcli(runs_dir, "export", "multihop_search", "--checkpoint", "sft", "--merge", str(merged)), "export")
    rows = []
    for form, (recipe_name, extra) in RUNS.items():
        if args.form not in (form, "both"):
            continue
        recipe = ROOT / "recipes" / f"{recipe_name}.yaml"
        overrides = [f"model.name={merged}", *extra, *quick, *([f"run.seed={args.seed}"] if args.seed else [])]
        console.print(f"{form} form: rlcli run -r {recipe.relative_to(ROOT)} {' '.join(overrides)}")
        seconds, cpu = timed(runs_dir, form, "run", "-r", str(recipe), *overrides)
        base, final = (evaluate(runs_dir, recipe, overrides, which) for which in ("base", "latest"))
        rows.append((form, base, final, seconds, cpu))
    table = Table(title="multihop_search, agent form against env form")
    for column in ("form", "start (SFT, merged)", "after GRPO", "wall-clock", "CPU"):
        table.add_column(column)
    lines = ["| form | start (SFT, merged) | after GRPO | wall-clock | CPU |", "|---|---|---|---|---|"]
    for form, base, final, seconds, cpu in rows:
        cells = [form, base.cell(), final.cell(), f"{seconds / 60:.1f} min", f"{cpu / 60:.1f} min"]
        table.add_row(*cells)
        lines.append("| " + " | ".join(cells) + " |")
    Console().print(table)
    if args.markdown:
        args.markdown.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
