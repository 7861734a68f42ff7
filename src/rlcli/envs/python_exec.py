"""The built-in `python_exec` tool (env.tools: [python_exec]): run a model's Python code in a child process.

Where it runs is env.code_sandbox's choice (recipe.py; `python_exec_tool(bwrap)` makes the tool):
- in bubblewrap (bwrap, and auto where bubblewrap runs): a security boundary short of the kernel.
  The code sees the system and rlcli's Python read-only, a fresh scratch folder and /tmp (size-limited)
  as its only writable places, no home folder, no network, none of rlcli's processes or variables, and
  cannot outlive its call (envs/sandbox.py says what it sees, docs/tools.md what it does not guard);
- with the limits alone (none, and auto elsewhere): a limit on accidents, not a security boundary. The
  code runs as the same user as rlcli and can read (and, in other folders, write) every file that
  user can, start processes, and reach the network.

Either way each call gets a fresh `python -I` (the interpreter running rlcli, isolated mode: no user
site, no PYTHON* variables, the script's folder not on sys.path) in a new scratch folder, removed
after, under a supervisor of its own (envs/subprocesses.py). The limits below stop the common
accidents of model-written code: an endless loop, a list that grows until the machine swaps, a write
loop that fills the disk, a flood of output, a secret read from an inherited environment variable. The
supervisor enforces the time limit and the bounds on the call's whole process tree, kills every process
the code started when the call ends, and when rlcli dies (Ctrl-C, SIGTERM, kill -9) kills them too and
removes the folder. The code's parent is that supervisor, started with the code's clean environment, and
every rlcli process above it is non-dumpable (hide_environment), so /proc shows the code none of rlcli's
API keys.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from rlcli.envs.sandbox import Limits, run_sandboxed
from rlcli.envs.subprocesses import hide_environment

# Each call's limits, read at the call (a test may lower one); why each is what it is: sandbox.Limits.
TIME_LIMIT_S = Limits.time_s
MEMORY_LIMIT_BYTES = Limits.memory_bytes
FILE_SIZE_LIMIT_BYTES = Limits.file_size_bytes
DISK_LIMIT_BYTES = Limits.disk_bytes
OUTPUT_LIMIT_CHARS = Limits.output_chars
MAX_PROCESSES = Limits.processes
CPU_LIMIT_S = Limits.cpu_s
# At most this many calls run at once in one process (parallel_tools, or episodes side by side with
# env.workers 0); each env worker process has its own. A call waits up to SLOT_WAIT_S for its turn,
# then is not run: the wait plus TIME_LIMIT_S stays below env.tool_timeout_s's default, after which
# the tool box would give up on a call that might still start later.
MAX_CONCURRENT_CALLS = 4
SLOT_WAIT_S = 4.0

_slots = threading.BoundedSemaphore(MAX_CONCURRENT_CALLS)


def python_exec_tool(bwrap: bool) -> Callable[[str], str]:
    """The python_exec tool, its code run in bubblewrap or with the limits alone (env.code_sandbox)."""

    def python_exec(code: str) -> str:
        """Run Python code in a fresh interpreter and return what it printed (stdout and stderr).

        Each call starts from nothing: no variables or imports carry over from an earlier call. The run is
        stopped after 10 seconds, and its output is cut after 8000 characters.

        Args:
            code: A complete Python program; use print() to show results.
        """
        hide_environment()  # before any code runs: it cannot read this process's API keys through /proc
        if not _slots.acquire(timeout=SLOT_WAIT_S):
            return f"[not run: {MAX_CONCURRENT_CALLS} other python_exec calls were running for {SLOT_WAIT_S:g} s]"
        try:
            limits = Limits(
                time_s=TIME_LIMIT_S,
                cpu_s=CPU_LIMIT_S,
                memory_bytes=MEMORY_LIMIT_BYTES,
                file_size_bytes=FILE_SIZE_LIMIT_BYTES,
                disk_bytes=DISK_LIMIT_BYTES,
                processes=MAX_PROCESSES,
                output_chars=OUTPUT_LIMIT_CHARS,
            )
            outcome = run_sandboxed([sys.executable, "-I", "main.py"], {"main.py": code}, bwrap=bwrap, limits=limits)
        finally:
            _slots.release()
        return outcome.output + (f"\n[{outcome.status}]" if outcome.status else "")

    return python_exec


# The tool without bubblewrap, as `rlcli.envs.python_exec:python_exec` names it (env.code_sandbox none).
python_exec = python_exec_tool(bwrap=False)
