"""`make demo` twice in a row (issue 56): the Makefile's demo commands, on the tiny model instead of
SmolLM2, both times exit 0; the second resumes the finished run and prints its tables and curves again."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from helpers import REPO, write_recipe

DEMO_RECIPE = "recipes/quickstart.yaml"


def demo_commands(makefile: Path, bin_dir: Path) -> list[list[str]]:
    """The commands `make demo` runs after its install step (make -n prints them; -o install takes the
    install as done), with the rlcli of `bin_dir`."""
    printed = subprocess.run(
        ["make", "-s", "-n", "-f", str(makefile), "-o", "install", "demo", f"BIN={bin_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [shlex.split(line) for line in printed.splitlines() if line.strip()]


def run_demo(
    commands: list[list[str]], recipe: Path, cwd: Path, env: dict[str, str]
) -> list[subprocess.CompletedProcess]:
    """The demo's commands, the quickstart recipe swapped for `recipe`, in `cwd`, stopping at a failure."""
    done = []
    for command in commands:
        assert DEMO_RECIPE in command or "quickstart" in command, command  # every step works on the demo's run
        args = [str(recipe) if arg == DEMO_RECIPE else arg for arg in command]
        done.append(subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=600))
        if done[-1].returncode:
            break
    return done


def test_make_demo_runs_twice_in_a_row(tmp_path, session_models):
    # The demo's run on the tiny model, under the demo's run name, in the folder the demo uses (./runs).
    recipe = write_recipe(
        tmp_path / "quickstart.yaml", run={"name": "quickstart", "seed": 0}, grpo={"iterations": 1}, eval={"tasks": 2}
    )
    env = {k: v for k, v in os.environ.items() if k != "RLCLI_HOME"}
    env["RLCLI_MODELS"] = str(session_models)
    commands = demo_commands(REPO / "Makefile", Path(sys.executable).parent)
    assert commands, "make demo runs nothing"

    first = run_demo(commands, recipe, tmp_path, env)
    assert [p.returncode for p in first] == [0] * len(commands), first[-1].stderr
    curves = tmp_path / "runs" / "quickstart" / "metrics.png"
    assert f"curves: {curves.relative_to(tmp_path)}" in first[-1].stdout
    written = curves.stat().st_mtime_ns

    again = run_demo(commands, recipe, tmp_path, env)
    assert [p.returncode for p in again] == [0] * len(commands), again[-1].stderr
    assert "Evaluation (held-out tasks)" in again[-1].stdout  # the finished run's tables, printed again
    assert f"curves: {curves.relative_to(tmp_path)}" in again[-1].stdout
    assert curves.stat().st_mtime_ns >= written  # rlcli's own file in the run's folder, replaced
