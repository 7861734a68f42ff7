"""Several processes in one run database: writers to different runs, and first opens of a new file."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from sqlite_utils import Database

from rlcli.store.db import RunDB
from rlcli.store.migrations import migrations

# One process: create its run, then write stages and metrics in a loop, as a stage would; print "ok".
WRITER = textwrap.dedent(
    """
    import sys, time
    from rlcli.recipe import Recipe
    from rlcli.store.db import RunDB

    runs_dir, run, until = sys.argv[1], sys.argv[2], float(sys.argv[4])
    writes = int(sys.argv[3])
    rundb = RunDB.open(runs_dir)
    rundb.start_run(run, Recipe(), None)
    step = 0
    while step < writes or time.time() < until:
        rundb.mark_stage(run, f"s/{step}", "running", params={"step": step})
        rundb.log_metrics(run, "train", step, {"loss": float(step)})
        rundb.mark_stage(run, f"s/{step}", "done", result={"step": step})
        step += 1
    rundb.close()
    print(step)
    """
)

# One process: wait for the common start time, then open (and so create and migrate) the database.
OPENER = textwrap.dedent(
    """
    import sys, time
    from rlcli.store.db import RunDB

    time.sleep(max(0.0, float(sys.argv[2]) - time.time()))
    RunDB.open(sys.argv[1]).close()
    """
)


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # start_run looks for a git sha in the cwd


def _run_all(commands: list[list[str]], timeout: float) -> list[subprocess.CompletedProcess]:
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
    results = []
    for proc, cmd in zip(procs, commands):
        out, err = proc.communicate(timeout=timeout)
        results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    return results


def _two_writers(runs_dir: Path, writes: int, seconds: float) -> None:
    until = time.time() + seconds
    commands = [[sys.executable, "-c", WRITER, str(runs_dir), run, str(writes), str(until)] for run in ("a", "b")]
    results = _run_all(commands, timeout=seconds + 300)
    for result in results:
        assert result.returncode == 0, result.stderr
    rundb = RunDB.open(runs_dir)
    try:
        for run, result in zip(("a", "b"), results):
            steps = int(result.stdout)
            assert steps >= writes
            stages = rundb.stages(run)
            assert [s.name for s in stages] == [f"s/{i}" for i in range(steps)]
            assert all(s.done and s.result == {"step": int(s.name[2:])} for s in stages)
            assert [m.value for m in rundb.metrics(run, "loss")] == [float(i) for i in range(steps)]
    finally:
        rundb.close()


def test_two_processes_write_to_different_runs_and_nothing_is_lost(tmp_path):
    _two_writers(tmp_path / "runs", writes=300, seconds=0)


@pytest.mark.fuzz  # a soak: make test-fuzz runs it; the 300 writes above are make test's
def test_two_processes_write_to_different_runs_for_30_s(tmp_path):
    _two_writers(tmp_path / "runs", writes=0, seconds=30)


def test_concurrent_first_opens_migrate_once(tmp_path):
    runs_dir = tmp_path / "runs"
    start = str(time.time() + 3)  # after every process has imported rlcli, so that the opens overlap
    results = _run_all([[sys.executable, "-c", OPENER, str(runs_dir), start] for _ in range(8)], timeout=300)
    for result in results:
        assert result.returncode == 0, result.stderr
    rundb = RunDB.open(runs_dir)
    try:
        applied = [m.name for m in migrations.applied(rundb.db)]
        assert applied == [m.name for m in migrations.pending(Database(memory=True))]  # each once, all of them
    finally:
        rundb.close()
