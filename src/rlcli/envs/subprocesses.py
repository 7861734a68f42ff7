"""Process supervision: everything rlcli starts dies with it, however rlcli ends (Ctrl-C, SIGTERM, kill -9).

One helper for every child:
- `die_with_parent(argv, supervision)`: the argv of a small supervisor (envs/supervisor.py, a script)
  that starts the program and stays its parent. Used for MCP servers (envs/tools.py), OpenEnv servers
  (envs/adapters/openenv.py), Chromium (envs/browser.py) and `python_exec` code (envs/python_exec.py).
  On Linux the kernel tells the supervisor when the thread that started it ends (PR_SET_PDEATHSIG:
  start it from a thread that lives as long as it should, the main thread, an event loop's, or one that
  waits on it), and the program is SIGKILLed by the kernel if the supervisor itself is killed. The
  supervisor is a child subreaper (PR_SET_CHILD_SUBREAPER): whatever the program starts stays in its
  tree, even a process that starts a session of its own (setsid) or daemonises, and when the program
  ends, is stopped, or the parent dies, the supervisor kills that whole tree, found through /proc.
  Optionally it also enforces a wall-clock limit, a bound on the tree's processes and resident memory,
  resource limits set in the program before it starts (inherited by its children, so RLIMIT_CPU holds
  even if the supervisor is gone), capabilities dropped when running as root, and it removes a scratch
  folder if its parent dies first. It forwards SIGTERM and SIGHUP to the program (killing the tree if
  it is still there after STOP_GRACE_S), ignores SIGINT (the terminal sends Ctrl-C to the program
  itself when they share a process group) and ends as the program did (its exit status or signal).
- `exit_with_parent(parent_pid)` and `kill_group_when_gone()`: the same tie for Python processes that
  multiprocessing starts (env workers, async GRPO's rollout worker), which cannot be wrapped in argv.
- `scratch_folder(prefix)`: a temporary folder named for this process, so that the folders of processes
  that are gone (killed -9 before their supervisor could remove them) are removed by the next one.
- `hide_environment()`: makes this process non-dumpable, so that code it runs (python_exec) cannot read
  its environment (API keys) through /proc/<pid>/environ.

Elsewhere than Linux the supervisor still runs the program, enforces the limits and kills what it can
(the program, and the process group of a program that leads one), but nothing tells it of its
parent's death: the parent's own clean-up is all there is.

The supervisor itself is envs/supervisor.py, run as a script with `python -I -S`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlcli.envs import supervisor
from rlcli.envs.supervisor import LINUX, PARENT_GONE, PR_SET_DUMPABLE, PR_SET_PDEATHSIG, prctl


@dataclass(frozen=True)
class Supervision:
    """What the supervisor enforces besides dying with its parent; the defaults add nothing."""

    time_limit_s: float | None = None  # wall clock from the start; past it the tree is killed
    max_processes: int | None = None  # processes in the program's tree at once
    wrapper_processes: int = 0  # processes of a wrapper around the program (bubblewrap's), not counted above
    max_memory_bytes: int | None = None  # resident memory of the program's tree, all processes together
    rlimits: tuple[tuple[str, int], ...] = ()  # ("RLIMIT_AS", bytes): set in the program before it starts
    drop_capabilities: bool = False  # running as root: the program holds no capability (cannot read rlcli's /proc)
    output: str | None = None  # a file the program's stdout and stderr are appended to
    report: str | None = None  # a file the supervisor writes why it stopped the program to, if it did
    remove: str | None = None  # a folder the supervisor removes if its parent dies before the program ends


def die_with_parent(argv: Sequence[str], supervision: Supervision = Supervision()) -> list[str]:
    """argv, run under a supervisor that kills it and everything it started when this process (the
    thread that starts it, on Linux) ends, and enforces `supervision`."""
    given = supervision
    rlimits = ",".join(f"{name}={value}" for name, value in given.rlimits)
    numbers = (given.time_limit_s, given.max_processes, given.wrapper_processes, given.max_memory_bytes)
    config = [str(os.getpid()), *("" if n is None else str(n) for n in numbers), rlimits]
    config += ["1" if given.drop_capabilities else "", given.output or "", given.report or "", given.remove or ""]
    return [sys.executable, "-I", "-S", supervisor.__file__, *config, *argv]


def exit_with_parent(parent_pid: int) -> None:
    """In a process multiprocessing started: ask Linux to SIGKILL it when its parent dies (even in C code)."""
    if LINUX:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # it died before the request above took effect
        os._exit(0)


def kill_group_when_gone() -> None:
    """Fork a watcher into this process's process group that kills the group when this process dies.

    A process that crashes, or that the kernel kills with its parent, runs no clean-up of its own, and
    the subprocesses it started (a game server, a browser) would live on, re-parented to init. Call it
    before any other code runs in the process: the watcher only waits, so forking is safe then.
    """
    watched = os.getpid()
    if os.fork():
        return
    try:
        os.closerange(3, 1 << 16)  # holds no pipe end open: the parent still reads EOF at a death
        if LINUX:
            # The kernel tells the watcher of the death at once; the signal stays blocked and is taken
            # by sigtimedwait, and the time-out re-checks the parent all the same.
            signal.pthread_sigmask(signal.SIG_BLOCK, {PARENT_GONE})
            prctl(PR_SET_PDEATHSIG, PARENT_GONE)
            while os.getppid() == watched:
                signal.sigtimedwait({PARENT_GONE}, 5.0)
        else:
            while os.getppid() == watched:
                time.sleep(0.5)
        os.killpg(watched, signal.SIGKILL)  # the group, the watcher last of all
    finally:
        os._exit(0)


def hide_environment() -> None:
    """Make this process non-dumpable (Linux): other processes of the same user can no longer read its
    /proc/<pid>/environ, memory or file descriptors, nor ptrace it (py-spy and gdb need root then).

    Reset when the process execs, so each rlcli process that runs model-written code calls it. A process
    with CAP_SYS_PTRACE (root, usually) still reads it: the supervisor drops that capability from the code.
    """
    if LINUX:
        prctl(PR_SET_DUMPABLE, 0)


def scratch_folder(prefix: str) -> Path:
    """A new temporary folder named `<prefix><this pid>-...`; first, those of processes that are gone."""
    for folder in Path(tempfile.gettempdir()).glob(f"{prefix}*"):
        owner = folder.name[len(prefix) :].partition("-")[0]
        if not owner.isdigit():
            continue
        try:
            os.kill(int(owner), 0)
        except ProcessLookupError:
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # another user's process: not ours to judge
            continue
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-"))
