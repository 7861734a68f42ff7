"""`rlcli ARGS` in a process of its own, stopped (SIGSTOP) at its first database write once EVENT has
happened, for helpers.kill_at_event to SIGKILL it there.

The process is forked from a zygote: a multiprocessing forkserver that imported what rlcli's commands
import (torch, transformers, peft, rlcli's stages) once per pytest process, so that a killed command
starts in a fraction of a second instead of after ~6 s of imports. (tests/resume/test_kill_fuzz.py starts
real `rlcli` processes instead: it kills during imports too.)

EVENT: {"sql": "select count(*) ...", "at_least": N} (counted on the run's own connection),
{"glob": "checkpoint-*/trainer_state.json", "root": "/path"} (a file exists) or {"lines": "/path/file",
"more_than": N} (a file another process appends to has more than N lines). Polling from outside and
killing after the event lets the process run on for as long as the test's process waits for a core,
so a loaded machine could carry it past the point the test means to kill at; here it cannot move on.
The process stops just before a transaction, as between any two writes: what it computed since its
last commit (a rollout chunk, an SFT step) is in memory and lost with the kill, as in a real one.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sqlite3
import sys
import tempfile
from pathlib import Path

import torch


def install(event: dict) -> None:
    from rlcli.store.db import RunDB

    original = RunDB.transaction

    def happened(rundb: RunDB) -> bool:
        if "glob" in event:
            return any(Path(event["root"]).glob(event["glob"]))
        if "lines" in event:
            path = Path(event["lines"])
            return path.exists() and len(path.read_text().splitlines()) > event["more_than"]
        try:
            return rundb.db.conn.execute(event["sql"]).fetchone()[0] >= event["at_least"]
        except sqlite3.Error:  # its tables are not created yet
            return False

    @contextlib.contextmanager
    def transaction(self: RunDB):
        if not self.db.conn.in_transaction and happened(self):
            os.kill(os.getpid(), signal.SIGSTOP)  # every thread stops; the test kills the process here
        with original(self) as db:
            yield db

    RunDB.transaction = transaction


# What the zygote imports: every stage a test kills, through the command-line app. Not where a GPU is
# visible: these imports initialise CUDA, and a child forked from a process that did cannot use it
# ("Cannot re-initialize CUDA in forked subprocess", every killed command on an H100). There the
# forkserver imports nothing and each command imports its own, as a real one does.
PRELOAD = ["rlcli.cli.app", "rlcli.engine.pipeline", "rlcli.engine.grpo.loop", "rlcli.engine.sft", "rlcli.engine.dpo"]


def start(args: list[str], env: dict[str, str], cwd: str, event: dict, log: str) -> multiprocessing.Process:
    """`rlcli ARGS` with environment env, from cwd, its output to the file log, stopping at event."""
    context = multiprocessing.get_context("forkserver")
    # Read when this process's forkserver starts: at its first child.
    context.set_forkserver_preload([] if torch.cuda.is_available() else PRELOAD)
    process = context.Process(target=_rlcli, args=(args, env, cwd, event, log), name="rlcli")
    process.start()
    return process


def _rlcli(args: list[str], env: dict[str, str], cwd: str, event: dict, log: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    # The forkserver kept the temp folder of the environment it started in (tempfile caches it), which
    # may be a test's own TMPDIR, removed since: find it again from this command's environment.
    tempfile.tempdir = None
    os.chdir(cwd)
    out = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(out, 1)
    os.dup2(out, 2)
    install(event)
    from rlcli.cli.app import main

    sys.argv = ["rlcli", *args]
    code = 0
    try:
        main(args)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): the state field of /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] == "T"
    except FileNotFoundError:
        return False
