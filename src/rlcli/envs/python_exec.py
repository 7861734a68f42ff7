"""The built-in `python_exec` tool (env.tools: [python_exec]): run a model's Python code in a child process.

This is a limit on accidents, not a security boundary. The code runs as the same user as rlcli: it
can read (and, in other folders, write) every file that user can, start processes, and reach the
network. The limits below stop the common accidents of model-written code: an endless loop, a list
that grows until the machine swaps, a write loop that fills the disk, a flood of output, a secret
read from an inherited environment variable. A security boundary would be a container or VM with no
network and a throw-away file system (gVisor, Firecracker), or nsjail/bubblewrap with a seccomp
filter and no network namespace; run untrusted models' code only inside one of those.

Each call gets a fresh `python -I` (the interpreter running rlcli, isolated mode: no user site,
no PYTHON* variables, the script's folder not on sys.path) in a new scratch folder, removed after,
under a supervisor of its own (envs/subprocesses.py). The supervisor enforces the time limit and the
bounds on the call's whole process tree, kills every process the code started when the call ends, and
when rlcli dies (Ctrl-C, SIGTERM, kill -9) kills them too and removes the folder. The code's parent is
that supervisor, started with the code's clean environment, and every rlcli process above it is
non-dumpable (hide_environment), so /proc shows the code none of rlcli's API keys.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import threading

from rlcli.envs.subprocesses import Supervision, die_with_parent, hide_environment, scratch_folder
from rlcli.envs.supervisor import STOP_GRACE_S

# Wall-clock seconds per call: below env.tool_timeout_s's default (15 s: half of env.step_timeout_s's
# 30), so that python_exec stops its own process and reports what it printed, rather than the tool box
# giving up on a call that goes on.
TIME_LIMIT_S = 10.0
# Address space (RLIMIT_AS): a runaway allocation fails with MemoryError instead of pushing the machine
# (and the training run on it) into swap. 1 GiB leaves room for numpy's import and moderate arrays.
MEMORY_LIMIT_BYTES = 1 << 30
# Largest file the code may write (RLIMIT_FSIZE; past it the kernel sends SIGXFSZ): a write loop cannot
# fill the disk. Its output is written to a file as well, so this also bounds what a print loop leaves.
FILE_SIZE_LIMIT_BYTES = 64 << 20
# Characters of output returned: what a model can use in its context; the tool box may cut further
# (env.tools' max_result_chars).
OUTPUT_LIMIT_CHARS = 8000
# The whole environment of the child: no variable of rlcli's own (API keys, tokens) reaches the code.
# One thread per math library, as a shared machine's good citizen, and so that their per-thread buffers
# fit the address-space limit.
BASE_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

# At most this many calls run at once in one process (parallel_tools, or episodes side by side with
# env.workers 0); each env worker process has its own. A call waits up to SLOT_WAIT_S for its turn,
# then is not run: the wait plus TIME_LIMIT_S stays below env.tool_timeout_s's default, after which
# the tool box would give up on a call that might still start later.
MAX_CONCURRENT_CALLS = 4
SLOT_WAIT_S = 4.0
# The whole process tree of a call (the code and what it starts) is bounded too, checked ten times a
# second by its supervisor (envs/subprocesses.py): processes alive at once, and their resident memory
# together (at most MEMORY_LIMIT_BYTES, as for each one's address space).
MAX_PROCESSES = 16
# CPU seconds per process (RLIMIT_CPU, inherited by what the code starts): the kernel stops a busy
# loop even if the supervisor that enforces TIME_LIMIT_S were killed.
CPU_LIMIT_S = int(TIME_LIMIT_S) + 2
SCRATCH_PREFIX = "rlcli-python-exec-"

_slots = threading.BoundedSemaphore(MAX_CONCURRENT_CALLS)


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
        return _run(code)
    finally:
        _slots.release()


def _run(code: str) -> str:
    # Named for this process: if it is killed before the supervisor removes the folder, the next
    # python_exec on the machine does.
    folder = scratch_folder(SCRATCH_PREFIX)
    try:
        scratch = folder / "scratch"
        scratch.mkdir()
        (scratch / "main.py").write_text(code)
        output_path, report_path = folder / "output", folder / "report"
        supervision = Supervision(
            time_limit_s=TIME_LIMIT_S,
            max_processes=MAX_PROCESSES,
            max_memory_bytes=MEMORY_LIMIT_BYTES,
            rlimits=(
                ("RLIMIT_AS", MEMORY_LIMIT_BYTES),
                ("RLIMIT_FSIZE", FILE_SIZE_LIMIT_BYTES),
                ("RLIMIT_CPU", CPU_LIMIT_S),
                ("RLIMIT_CORE", 0),
            ),
            drop_capabilities=True,
            output=str(output_path),
            report=str(report_path),
            remove=str(folder),
        )
        # The supervisor is started with the code's clean environment: the code's parent holds no secret.
        # Its own session: no Ctrl-C from the terminal, and out of an env worker's process group, so a
        # worker killed as a group leaves the supervisor to kill the code's tree and remove the folder.
        with output_path.open("wb") as output:  # the supervisor's own words, if any, go there too
            process = subprocess.Popen(
                die_with_parent([sys.executable, "-I", "main.py"], supervision),
                cwd=scratch,
                env={**BASE_ENV, "HOME": str(scratch), "TMPDIR": str(scratch)},
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=output,
                start_new_session=True,
            )
        try:
            returncode = process.wait(TIME_LIMIT_S + STOP_GRACE_S + 5)
        except subprocess.TimeoutExpired:  # the supervisor is stuck: the kernel kills the code with it
            process.kill()
            returncode = process.wait()
        status = report_path.read_text() if report_path.exists() else _exit_status(returncode)
        with output_path.open("rb") as output:
            data = output.read(OUTPUT_LIMIT_CHARS * 4 + 4)  # enough bytes for the characters kept, at most 4 each
        text = data.decode("utf-8", errors="replace")
        total = output_path.stat().st_size
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if len(text) > OUTPUT_LIMIT_CHARS or total > len(data):
        text = text[:OUTPUT_LIMIT_CHARS] + f"\n[output cut at {OUTPUT_LIMIT_CHARS} characters, of {total} bytes]"
    return text + (f"\n[{status}]" if status else "")


def _exit_status(returncode: int) -> str | None:
    if returncode == 0:
        return None
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"
