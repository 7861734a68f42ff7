"""`python tests/stop_at.py EVENT ARGS...`: `rlcli ARGS`, stopped (SIGSTOP) at its first database write
once EVENT has happened, for helpers.kill_when to SIGKILL it there.

EVENT is JSON: {"sql": "select count(*) ...", "at_least": N} (counted on the run's own connection),
{"glob": "checkpoint-*/trainer_state.json", "root": "/path"} (a file exists) or {"lines": "/path/file",
"more_than": N} (a file another process appends to has more than N lines). Polling from outside and
killing after the event lets the process run on for as long as the test's process waits for a core,
so a loaded machine could carry it past the point the test means to kill at; here it cannot move on.
The process stops just before a transaction, as between any two writes: what it computed since its
last commit (a rollout chunk, an SFT step) is in memory and lost with the kill, as in a real one.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sqlite3
import sys
from pathlib import Path


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


if __name__ == "__main__":  # not in the processes that multiprocessing spawns from this file
    install(json.loads(sys.argv[1]))
    from rlcli.cli.app import main

    sys.argv = ["rlcli", *sys.argv[2:]]
    main()
