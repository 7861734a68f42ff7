"""Rollout time with slow environments: env.workers 0 (in the main process) vs 1 vs 4 worker processes,
and env.isolation worker (several envs per worker) vs episode (one live env per worker).

    .venv/bin/python bench/env_workers.py              # 16 episodes x 4 turns, 0.2 s per step, workers 0 1 4
    .venv/bin/python bench/env_workers.py --quick      # 8 episodes x 2 turns, workers 0 and 2 (~15 s)
    .venv/bin/python bench/env_workers.py --workers 0 2 4 8 --sleep 0.5 --repeats 3
    .venv/bin/python bench/env_workers.py --workers 4 16 --isolation worker episode --sleep 0 --threads 1

What is measured: one `rlcli rollout` stage (`run_rollout_stage`, the code the CLI runs) of --episodes
episodes in one chunk (rollout.batch_size = episodes), on the tiny random model (`tiny-random`, a
few ms per sampling call) so that the environment dominates. The environment is `Sleepy`, defined
in this file: every step sleeps --sleep seconds (time.sleep: it holds no core, like a web or tool
call waiting on I/O) and the episode ends after --turns steps. Each (workers) setting plays a fresh
stage with the same seeds, so every setting plays the same episodes; the best of --repeats timed
rollouts counts (a busy neighbour only ever slows a run down). The model is loaded once before the
timings; starting the worker processes is part of each timed rollout.

Expected: in the main process the steps run one after another, episodes x turns x sleep in all;
one worker runs them one after another too, but the main process samples while it steps; N
workers step N envs at a time, so the rollout takes about 1/N of the env time.

--isolation episode (each setting of --isolation is timed with each --workers above 0): a worker
hosts one live env at a time, so at most N episodes are live and a reset waits for a worker whose
episode has ended. With --sleep 0 the env costs nothing and the table shows what a step costs in
messages, process switches and sampling calls (ms per env step: the rollout's time over
episodes x turns).
"""

from __future__ import annotations

import argparse
import os
import time

for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ.setdefault(_var, "1")


class Sleepy:
    """A multi-turn env whose every step waits `sleep` seconds; the episode ends after `turns` steps."""

    def __init__(self, sleep: float = 0.2, turns: int = 4):
        self.sleep, self.turns = sleep, turns

    def reset(self, seed: int):
        self.seed, self.turn = seed, 0
        return f"Task {seed}: answer in a few words.", {"task": {"seed": seed}}

    def step(self, action: str):
        time.sleep(self.sleep)
        self.turn += 1
        done = self.turn >= self.turns
        return f"Step {self.turn} of {self.turns}: go on.", float(len(action) % 2), done, False, {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 1, 4], help="env.workers settings to time")
    parser.add_argument(
        "--isolation",
        nargs="+",
        choices=["worker", "episode"],
        default=["worker"],
        help="env.isolation settings to time with each env.workers above 0",
    )
    parser.add_argument("--episodes", type=int, default=16, help="episodes per rollout")
    parser.add_argument("--turns", type=int, default=4, help="steps per episode")
    parser.add_argument("--sleep", type=float, default=0.2, help="seconds each env step sleeps")
    parser.add_argument("--repeats", type=int, default=2, help="timed rollouts per setting; the best counts")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="8 episodes x 2 turns, workers 0 and 2, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.workers, args.episodes, args.turns, args.repeats = [0, 2], 8, 2, 1

    import tempfile
    from pathlib import Path

    import torch
    from rich.console import Console
    from rich.table import Table

    from rlcli.engine.context import RunContext
    from rlcli.engine.rollout import load_rollout_policy, run_rollout_stage
    from rlcli.recipe import Recipe
    from rlcli.store.db import RunDB

    if args.threads:
        torch.set_num_threads(args.threads)
    console = Console()
    load = os.getloadavg()[0]
    if load > 0.5:
        console.print(f"[yellow]warning: 1-min load average {load:.2f}: another process is busy; figures will be slow")

    recipe = Recipe.model_validate(
        {
            "run": {"name": "bench", "seed": 0},
            "model": {"name": "tiny-random", "max_length": 1024},
            "env": {
                "name": f"{Path(__file__).resolve()}:Sleepy",
                "kwargs": {"sleep": args.sleep, "turns": args.turns},
                "max_turns": args.turns,
                "step_timeout_s": 60,
            },
            "rollout": {"tasks": args.episodes, "group_size": 1, "max_new_tokens": 8, "batch_size": args.episodes},
        }
    )
    settings = [(w, "worker") if w == 0 else (w, iso) for w in args.workers for iso in args.isolation]
    settings = list(dict.fromkeys(settings))  # workers 0 has no isolation to vary
    results: dict[tuple[int, str], float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rundb = RunDB.open(Path(tmp))
        rundb.start_run("bench", recipe, "bench/env_workers.py")
        load_rollout_policy(RunContext(recipe, rundb, "bench", Path(tmp)), "base")  # build the tiny model once
        for workers, isolation in settings:
            recipe.env.workers, recipe.env.isolation = workers, isolation
            ctx = RunContext(recipe, rundb, "bench", Path(tmp), console=Console(quiet=True))
            best = float("inf")
            for repeat in range(args.repeats):
                start = time.perf_counter()
                stage = f"w{workers}-{isolation}-{repeat}"
                summary = run_rollout_stage(ctx, stage=stage, policy="base", split="train")
                best = min(best, time.perf_counter() - start)
                assert summary.episodes == args.episodes and summary.failed == 0, summary
            results[workers, isolation] = best
            console.print(f"workers {workers}, isolation {isolation}: {best:.2f} s")

    env_time = args.episodes * args.turns * args.sleep
    steps = args.episodes * args.turns
    table = Table(
        title=f"{args.episodes} episodes x {args.turns} turns, {args.sleep:g} s per step "
        f"({env_time:.1f} s of env time), {torch.get_num_threads()} torch threads, best of {args.repeats}"
    )
    first = settings[0]
    for column in ("env.workers", "env.isolation", "s / rollout", "ms / env step", f"vs {first[0]} {first[1]}"):
        table.add_column(column, justify="right")
    for (workers, isolation), seconds in results.items():
        table.add_row(
            str(workers),
            isolation if workers else "-",
            f"{seconds:.2f}",
            f"{1000 * seconds / steps:.1f}",
            f"{results[first] / seconds:.2f}x",
        )
    console.print(table)


if __name__ == "__main__":  # worker processes import this file for Sleepy: only a run times anything
    main()
