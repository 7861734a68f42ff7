"""The built-in `python_exec` tool (env.tools: [python_exec]): run a model's Python code in a child process.

This is a limit on accidents, not a security boundary. The code runs as the same user as rlcli: it
can read (and, in other folders, write) every file that user can, start processes, and reach the
network. The limits below stop the common accidents of model-written code: an endless loop, a list
that grows until the machine swaps, a write loop that fills the disk, a flood of output, a secret
read from an inherited environment variable. A security boundary would be a container or VM with no
network and a throw-away file system (gVisor, Firecracker), or nsjail/bubblewrap with a seccomp
filter and no network namespace; run untrusted models' code only inside one of those.

Each call gets a fresh `python -I` (the interpreter running rlcli, isolated mode: no user site,
no PYTHON* variables, the script's folder not on sys.path) in a new scratch folder, removed after.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

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

# Runs first in the child: set the limits, then replace itself with the interpreter running the code
# (limits survive exec). This rather than Popen's preexec_fn, which is unsafe in a process with threads
# (a tool box calls tools from threads) and can deadlock the child before exec.
_LIMITS_THEN_EXEC = (
    "import os, resource, sys\n"
    "for name, value in ((resource.RLIMIT_AS, int(sys.argv[1])), (resource.RLIMIT_FSIZE, int(sys.argv[2]))):\n"
    "    resource.setrlimit(name, (value, value))\n"
    "os.execv(sys.executable, [sys.executable, '-I', 'main.py'])\n"
)


def python_exec(code: str) -> str:
    """Run Python code in a fresh interpreter and return what it printed (stdout and stderr).

    Each call starts from nothing: no variables or imports carry over from an earlier call. The run is
    stopped after 10 seconds, and its output is cut after 8000 characters.

    Args:
        code: A complete Python program; use print() to show results.
    """
    with tempfile.TemporaryDirectory(prefix="rlcli-python-exec-") as folder:
        scratch = Path(folder) / "scratch"
        scratch.mkdir()
        (scratch / "main.py").write_text(code)
        output_path = Path(folder) / "output"
        with output_path.open("wb") as output:
            process = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _LIMITS_THEN_EXEC]
                + [str(MEMORY_LIMIT_BYTES), str(FILE_SIZE_LIMIT_BYTES)],
                cwd=scratch,
                env={**BASE_ENV, "HOME": str(scratch), "TMPDIR": str(scratch)},
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: the kill below takes its children too
            )
            try:
                status: str | None = _exit_status(process.wait(TIME_LIMIT_S))
            except subprocess.TimeoutExpired:
                status = f"timed out after {TIME_LIMIT_S:g} s"
            finally:
                # The whole group, also after a normal exit: a child it left running in the background goes too.
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        with output_path.open("rb") as output:
            data = output.read(OUTPUT_LIMIT_CHARS * 4 + 4)  # enough bytes for the characters kept, at most 4 each
        text = data.decode("utf-8", errors="replace")
        total = output_path.stat().st_size
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
