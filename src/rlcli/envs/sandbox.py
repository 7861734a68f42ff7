"""The sandbox for code that the model or a task controls: bubblewrap (`bwrap`), on Linux.

A program run under bubblewrap (`sandboxed`) gets:
- new user, PID, IPC, UTS, cgroup and network namespaces: it sees only its own processes in /proc,
  no network but its own loopback (so not the ports of this machine's 127.0.0.1), the host name
  `sandbox`, and it holds no capability, nor can it make a user namespace of its own;
- the system (/usr and its /bin, /lib links; from /etc only the few files in SYSTEM_FILES) and this
  Python's virtual environment and base interpreter, read-only, and nothing else of the file system
  but what the caller names read-only (`Sandbox.readable`): no home folder, no runs folder;
- two writable places, each a size-limited tmpfs (`Sandbox.disk_bytes`): /tmp, which holds the
  scratch folder SCRATCH (its working folder and HOME, where `Sandbox.inputs` is copied), and
  /dev/shm; every other path is read-only, so a write loop fills at most those and then fails
  with "No space left on device";
- only the environment it is given (`Sandbox.env`, plus HOME and TMPDIR): none of rlcli's variables;
- death with its parent: bubblewrap's --die-with-parent, and the supervisor that die_with_parent puts
  around it (envs/subprocesses.py) kills the whole tree and applies the limits (time, processes,
  memory, rlimits), which the code cannot escape by killing the supervisor: it cannot see it.

Three entry points:
- `run_sandboxed(argv, files, bwrap=..., limits=...) -> Outcome`: one run of a short program (a
  python_exec call, a project's tests) in a fresh scratch folder holding `files`, with limits, its
  output returned. With bwrap=False the same run has the limits only (`sandbox: none`).
- `die_with_parent(sandboxed(argv, Sandbox(...)), Supervision(...))`: a long-lived program (an MCP
  server, an env worker: envs/tools.py, envs/workers.py) in the sandbox, under the supervisor.
- `use_bwrap(setting, field)`: a recipe's `none | bwrap | auto` made a yes or no before any stage:
  bwrap where bubblewrap cannot run is a UsageError in one sentence; auto says in one line on stderr
  which it took.

What it does not guard against (docs/tools.md): kernel exploits (it shares the kernel; run untrusted
tasks in a VM), side channels (timing, CPU caches), and the CPU and memory it uses within its limits.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from rlcli.envs.subprocesses import Supervision, die_with_parent, scratch_folder
from rlcli.envs.supervisor import STOP_GRACE_S
from rlcli.errors import UsageError

SandboxSetting = Literal["none", "bwrap", "auto"]  # a recipe's choice; use_bwrap makes it a yes or no
# The scratch folder as the sandboxed program sees it: inside /tmp's tmpfs, so one size limit bounds both.
SCRATCH = "/tmp/scratch"
# Where Sandbox.inputs is seen (read-only) while it is copied into SCRATCH.
_INPUTS = "/run/rlcli-inputs"
# The files of /etc a program may need, all without secrets: the dynamic linker's cache, user and group
# names (getpass, pytest), time zone, localhost's name, and the links Debian's alternatives make.
SYSTEM_FILES = (
    "alternatives",
    "group",
    "hosts",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "localtime",
    "nsswitch.conf",
    "passwd",
)
# Top-level folders of the system besides /usr: links into /usr on merged-/usr systems, folders elsewhere.
_SYSTEM_ROOTS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# Each tmpfs a sandboxed program may write to (/tmp with the scratch folder, /dev/shm) holds at most this:
# a write loop stops there. In memory, not on disk: a few calls at once on one machine must fit.
DISK_BYTES = 256 << 20
# bubblewrap's own processes in a sandboxed program's tree (its monitor, and PID 1 of the namespace): a
# bound on the tree's processes does not count them.
BWRAP_PROCESSES = 2
# The environment of a run_sandboxed program, besides HOME and TMPDIR: no variable of rlcli's own (API
# keys, tokens) reaches it. One thread per math library, as a shared machine's good citizen, and so
# that their per-thread buffers fit the address-space limit.
BASE_ENV = {
    "PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


@dataclass(frozen=True)
class Sandbox:
    """What a program in bubblewrap sees besides the system and this Python's environment (read-only)."""

    env: tuple[tuple[str, str], ...] = ()  # its whole environment; HOME is SCRATCH and TMPDIR /tmp
    inputs: str | None = None  # a folder whose contents are copied into SCRATCH before the program starts
    cwd: str = SCRATCH  # where it starts: SCRATCH, or a folder in `readable`
    readable: tuple[str, ...] = ()  # more folders (or files), seen read-only at their own paths
    hidden: tuple[str, ...] = ()  # folders inside `readable` that it sees empty (the runs folder)
    disk_bytes: int = DISK_BYTES  # size of each writable tmpfs, /tmp (with SCRATCH) and /dev/shm


def sandboxed(argv: Sequence[str], sandbox: Sandbox = Sandbox()) -> list[str]:
    """argv, run inside bubblewrap as `sandbox` says (see the module docstring for what it sees).

    argv[0] must be a path the sandbox shows (the system, this Python, `sandbox.readable`) or a program
    on the PATH of `sandbox.env`. Wrap the result in die_with_parent for the limits and the clean-up.
    """
    args = ["bwrap", "--unshare-user", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-net"]
    args += ["--unshare-cgroup-try", "--disable-userns", "--hostname", "sandbox", "--cap-drop", "ALL"]
    args += ["--die-with-parent", "--new-session", "--clearenv"]  # new session: no keystrokes pushed into a terminal
    environment = {**dict(sandbox.env), "HOME": SCRATCH, "TMPDIR": "/tmp"}
    for name, value in environment.items():
        args += ["--setenv", name, value]
    # The writable places first: a folder shown from under /tmp is mounted on top of its tmpfs, not hidden by it.
    size = str(sandbox.disk_bytes)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--perms", "1777", "--tmpfs", "/dev/shm"]
    args += ["--size", size, "--perms", "1777", "--tmpfs", "/tmp", "--dir", SCRATCH]
    args += ["--ro-bind", "/usr", "/usr"]
    for root in _SYSTEM_ROOTS:
        if os.path.islink(root):
            args += ["--symlink", os.readlink(root), root]
        elif os.path.isdir(root):
            args += ["--ro-bind", root, root]
    for name in SYSTEM_FILES:
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    for path in (*_python_folders(), *sandbox.readable):
        args += ["--ro-bind", path, path]
    for path in sandbox.hidden:
        args += ["--tmpfs", path, "--remount-ro", path]
    if sandbox.inputs is not None:
        args += ["--ro-bind", sandbox.inputs, _INPUTS]
    # Read-only from here on, but for the two tmpfs above (their own mounts) and /dev's device files.
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--chdir", sandbox.cwd, "--"]
    if sandbox.inputs is None:
        return [*args, *argv]
    # The inputs are copied rather than bound, so that the program may change them, within the size limit.
    return [*args, "/bin/sh", "-c", f'cp -R {_INPUTS}/. {SCRATCH} && exec "$@"', "sh", *argv]


def hidden_runs(shown: Sequence[str]) -> tuple[str, ...]:
    """rlcli's runs folder ($RLCLI_HOME, else ./runs), if it lies inside one of the folders `shown`: for
    Sandbox.hidden."""
    runs = Path(os.environ.get("RLCLI_HOME") or "runs").resolve()
    inside = runs.is_dir() and any(runs.is_relative_to(Path(folder).resolve()) for folder in shown)
    return (str(runs),) if inside else ()


def _python_folders() -> list[str]:
    """This Python's virtual environment and base installation, where /usr does not already show them."""
    folders = []
    for prefix in dict.fromkeys((sys.prefix, sys.base_prefix)):
        resolved = os.path.realpath(prefix)
        if not (resolved == "/usr" or resolved.startswith("/usr/")):
            folders.append(prefix)
            if resolved != prefix:  # a link: the path it stands for must be seen too
                folders.append(resolved)
    return folders


@functools.cache
def bwrap_problem() -> str | None:
    """Why bubblewrap cannot run a program here, in a few words; None if it can (tried once per process)."""
    if not sys.platform.startswith("linux"):
        return f"bubblewrap runs on Linux only, not {sys.platform}"
    if shutil.which("bwrap") is None:
        return "bwrap is not installed (apt-get install bubblewrap, or make install)"
    try:
        probe = sandboxed(["true"], Sandbox(env=(("PATH", BASE_ENV["PATH"]),)))
        done = subprocess.run(probe, capture_output=True, text=True, timeout=30, env=BASE_ENV)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"bwrap could not be started ({exc})"
    if done.returncode != 0:
        said = done.stderr.strip().splitlines()
        return f"bwrap cannot make its namespaces here ({said[-1] if said else f'exit status {done.returncode}'})"
    return None


_said: set[str] = set()  # the fields whose `auto` choice this process has told


def use_bwrap(setting: SandboxSetting, field: str) -> bool:
    """Whether the recipe's `field` (e.g. env.code_sandbox), set to `setting`, runs its programs in bubblewrap
    here: none, no; bwrap, yes, or a UsageError saying why it cannot; auto, whether it can, said once per
    process and field in one line on stderr. Call it before any stage, in the main process."""
    if setting == "none":
        return False
    problem = bwrap_problem()
    if setting == "bwrap":
        if problem is not None:
            raise UsageError(
                f"{field} is bwrap, but {problem}; expected a Linux machine with bubblewrap (or set none)."
            )
        return True
    if field not in _said:
        _said.add(field)
        from rlcli.console import err_console

        how = "runs in bubblewrap" if problem is None else f"runs with its limits only: {problem}"
        err_console.print(f"{field} auto: {how}.", markup=False)
    return problem is None


@dataclass(frozen=True)
class Limits:
    """What one run_sandboxed run may use; the defaults are python_exec's."""

    # Wall clock, past which the whole tree is killed: below env.tool_timeout_s's default (15 s: half of
    # env.step_timeout_s's 30), so that python_exec stops its own process and reports what it printed,
    # rather than the tool box giving up on a call that goes on.
    time_s: float = 10.0
    # CPU seconds per process (RLIMIT_CPU, inherited by what the program starts): the kernel stops a busy
    # loop even if the supervisor that enforces time_s were killed.
    cpu_s: int = 12
    # Address space per process (RLIMIT_AS), and resident memory of the tree together (checked ten times a
    # second): a runaway allocation fails with MemoryError instead of pushing the machine (and the training
    # run on it) into swap. 1 GiB leaves room for numpy's import and moderate arrays.
    memory_bytes: int = 1 << 30
    # Largest file written (RLIMIT_FSIZE; past it the kernel sends SIGXFSZ): a write loop cannot fill the
    # disk with one file. The output is written to a file as well, so this also bounds a print loop.
    file_size_bytes: int = 64 << 20
    # Under bwrap, each writable tmpfs (/tmp with the scratch folder, /dev/shm), all its files together.
    disk_bytes: int = DISK_BYTES
    # Processes of the program's tree at once (checked ten times a second): fork loops.
    processes: int = 16
    # Characters of output returned: what a model can use in its context (a tool box may cut further).
    output_chars: int = 8000


@dataclass(frozen=True)
class Outcome:
    """How a run_sandboxed run ended."""

    output: str  # stdout and stderr together, cut at Limits.output_chars (the cut said at the end)
    returncode: int  # the program's exit status; negative: killed by that signal
    status: str | None  # None for exit status 0, else why it ended: "exit status 1", "killed by SIGXFSZ",
    # "timed out after 10 s", "stopped: it ran more than 16 processes at once", ...


def run_sandboxed(
    argv: Sequence[str],
    files: Mapping[str, str | bytes],
    *,
    bwrap: bool,
    limits: Limits = Limits(),
    env: Mapping[str, str] | None = None,
) -> Outcome:
    """Run argv in a fresh scratch folder holding `files` (relative path -> content), its working folder and
    HOME, and return its output; the folder is removed after, and whatever the program started is killed.

    bwrap: inside bubblewrap (see the module docstring; use_bwrap decides), else with the limits alone,
    as the user, able to read and write what the user can. Either way: `limits`, no input, and only
    the environment BASE_ENV plus `env` (HOME and TMPDIR point at the scratch folder, or /tmp under
    bwrap). argv[0] must be an absolute path or on BASE_ENV's PATH, e.g. [sys.executable, "-I", "main.py"].
    """
    folder = scratch_folder("rlcli-sandbox-")  # named for this process: the next run removes it if we die first
    try:
        scratch = folder / "scratch"
        scratch.mkdir()
        for name, content in files.items():
            path = scratch / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content.encode() if isinstance(content, str) else content)
        output_path, report_path = folder / "output", folder / "report"
        given = {**BASE_ENV, **(env or {})}
        if bwrap:
            command = sandboxed(argv, Sandbox(tuple(given.items()), inputs=str(scratch), disk_bytes=limits.disk_bytes))
            cwd, environment = folder, given
        else:
            command, cwd = list(argv), scratch
            environment = {**given, "HOME": str(scratch), "TMPDIR": str(scratch)}
        supervision = _supervision(limits, bwrap, folder)
        # The supervisor is started with the program's clean environment: the program's parent holds no
        # secret. Its own session: no Ctrl-C from the terminal, and out of an env worker's process group,
        # so a worker killed as a group leaves the supervisor to kill the tree and remove the folder.
        with output_path.open("wb") as output:  # the supervisor's (and bubblewrap's) own words go there too
            process = subprocess.Popen(
                die_with_parent(command, supervision),
                cwd=cwd,
                env=environment,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=output,
                start_new_session=True,
            )
        try:
            returncode = process.wait(limits.time_s + STOP_GRACE_S + 5)
        except subprocess.TimeoutExpired:  # the supervisor is stuck: the kernel kills the program with it
            process.kill()
            returncode = process.wait()
        if bwrap:
            returncode = program_returncode(returncode)
        status = report_path.read_text() if report_path.exists() else _exit_status(returncode)
        with output_path.open("rb") as output:
            data = output.read(limits.output_chars * 4 + 4)  # enough bytes for the characters kept, at most 4 each
        total = output_path.stat().st_size
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    text = data.decode("utf-8", errors="replace")
    if len(text) > limits.output_chars or total > len(data):
        text = text[: limits.output_chars] + f"\n[output cut at {limits.output_chars} characters, of {total} bytes]"
    return Outcome(text, returncode, status)


def _supervision(limits: Limits, bwrap: bool, folder: Path) -> Supervision:
    """How the supervisor bounds one run_sandboxed program whose scratch folder is `folder`."""
    return Supervision(
        time_limit_s=limits.time_s,
        max_processes=limits.processes,
        wrapper_processes=BWRAP_PROCESSES if bwrap else 0,
        max_memory_bytes=limits.memory_bytes,
        rlimits=(
            ("RLIMIT_AS", limits.memory_bytes),
            ("RLIMIT_FSIZE", limits.file_size_bytes),
            ("RLIMIT_CPU", limits.cpu_s),
            ("RLIMIT_CORE", 0),
        ),
        # As root, the capabilities go: without CAP_SYS_PTRACE the code cannot read rlcli's /proc files. In
        # bubblewrap they must stay for it to map root into its user namespace; it drops them itself
        # (--cap-drop ALL), and its /proc shows none of rlcli's processes anyway.
        drop_capabilities=not bwrap,
        output=str(folder / "output"),
        report=str(folder / "report"),
        remove=str(folder),
    )


def program_returncode(returncode: int) -> int:
    """The return code of bubblewrap under its supervisor, as its program's: bubblewrap (and so the
    supervisor, which ends as its program did) exits with 128 + N for a program killed by signal N."""
    return 128 - returncode if returncode > 128 else returncode


def _exit_status(returncode: int) -> str | None:
    if returncode == 0:
        return None
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit status {returncode}"
