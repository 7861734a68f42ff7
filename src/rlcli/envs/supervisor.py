"""The process supervisor that envs/subprocesses.py's die_with_parent runs a program under.

Run as `python -I -S supervisor.py PARENT_PID TIME_LIMIT_S MAX_PROCESSES WRAPPER_PROCESSES MAX_MEMORY_BYTES
RLIMITS DROP_CAPABILITIES OUTPUT REPORT REMOVE ARGV...` (an empty field: not set; RLIMITS: `RLIMIT_AS=bytes,...`;
see subprocesses.Supervision for what each means). It starts for every python_exec call and every
server, so it imports only the lightest of the standard library (no json, dataclasses or pathlib:
they would double its start-up) and nothing of rlcli's.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time

TYPE_CHECKING = False  # typing itself would add a fifth to the start-up
if TYPE_CHECKING:
    from typing import NoReturn

LINUX = sys.platform.startswith("linux")
# prctl(2) options
PR_SET_PDEATHSIG = 1
PR_SET_DUMPABLE = 4
_PR_CAPBSET_DROP = 24
_PR_SET_CHILD_SUBREAPER = 36
_PR_CAP_AMBIENT = 47
_PR_CAP_AMBIENT_CLEAR_ALL = 4
# The signal the kernel sends the supervisor (and kill_group_when_gone's watcher) when its parent
# dies; nothing else sends it.
PARENT_GONE = signal.SIGUSR1
# Seconds a program asked to stop (SIGTERM, SIGHUP) gets before its tree is killed.
STOP_GRACE_S = 5.0
# Seconds between checks of the parent and, with bounds, of the tree's processes and memory: a tree can
# overshoot a bound for this long.
_CHECK_S = 1.0
_LIMITS_CHECK_S = 0.1


class _Config:
    """The command line's fields, parsed."""

    def __init__(self, fields: list[str]) -> None:
        parent, limit, processes, wrapper, memory, rlimits, drop, output, report, remove = fields
        self.parent = int(parent)
        self.time_limit_s = float(limit) if limit else None
        self.max_processes = int(processes) if processes else None
        self.wrapper_processes = int(wrapper)
        self.max_memory_bytes = int(memory) if memory else None
        pairs = [pair.partition("=") for pair in rlimits.split(",") if pair]
        self.rlimits = [(name, int(value)) for name, _, value in pairs]
        self.drop_capabilities = bool(drop)
        self.output, self.report, self.remove = output or None, report or None, remove or None


def prctl(option: int, value: int) -> int:
    import ctypes

    return int(ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0))


class _Tree:
    """The program's process and, on Linux, every process below the supervisor."""

    def __init__(self, program: int) -> None:
        self.program = program
        self.status: int | None = None  # the program's wait status, once reaped

    def reap(self) -> None:
        """Collect every child that ended (processes adopted as subreaper too), noting the program's status."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.program:
                self.status = status

    def members(self) -> list[int]:
        """The processes below the supervisor (elsewhere than Linux: the program, while it lives)."""
        if not LINUX:
            return [self.program] if self.status is None else []
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat", "rb") as file:
                    stat = file.read()
            except OSError:  # it ended meanwhile
                continue
            parent = int(stat[stat.rindex(b")") + 2 :].split()[1])
            children.setdefault(parent, []).append(int(entry))
        found, todo = [], [os.getpid()]
        while todo:
            below = children.get(todo.pop(), [])
            found += below
            todo += below
        return found

    def over(self, config: _Config) -> str:
        """Why the tree is past a bound, or ''."""
        members = self.members()
        most = config.max_processes
        if most is not None and len(members) - config.wrapper_processes > most:
            return f"stopped: it ran more than {most} processes at once"
        most = config.max_memory_bytes
        if most is not None and LINUX:
            resident = 0
            for pid in members:
                try:
                    with open(f"/proc/{pid}/statm") as file:
                        resident += int(file.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
                except (OSError, ValueError, IndexError):  # it ended meanwhile
                    continue
            if resident > most:
                return f"stopped: its processes held more than {most >> 20} MiB of memory together"
        return ""

    def kill(self) -> None:
        """SIGKILL every process of the tree until none is left (a dying one's children come up to us)."""
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            self.reap()
            members = self.members()
            if not members:
                return
            for pid in members:
                _signal(pid, signal.SIGKILL)
            if not LINUX:
                try:
                    if os.getpgid(self.program) != os.getpgid(0):
                        os.killpg(self.program, signal.SIGKILL)
                except OSError:  # the group is gone
                    pass
            time.sleep(0.005)


def _signal(pid: int, signum: int) -> None:
    """os.kill, for a process that may have ended (without contextlib: a tenth of the start-up)."""
    try:
        os.kill(pid, signum)
    except OSError:
        return


def _start(config: _Config, argv: list[str], supervisor: int) -> NoReturn:
    """In the forked child: tie it to the supervisor, set its limits and output, and become the program."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)  # ignored in the supervisor; an ignored signal survives exec
        if LINUX:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != supervisor:
                os._exit(1)
        import resource

        for name, value in config.rlimits:
            resource.setrlimit(getattr(resource, name), (value, value))
        if config.drop_capabilities and LINUX and os.geteuid() == 0:
            _drop_capabilities()
        if config.output is not None:
            output = os.open(config.output, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            os.dup2(output, 1)
            os.dup2(output, 2)
            os.close(output)
        os.execvp(argv[0], argv)
    except BaseException as exc:
        try:
            os.write(2, f"rlcli supervisor: cannot start {argv[0]}: {exc}\n".encode())
        finally:
            os._exit(127)
    os._exit(127)


def _drop_capabilities() -> None:
    """Leave root's code with no capability, now or after any exec: without CAP_SYS_PTRACE it cannot
    read a non-dumpable process's /proc files (see hide_environment)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    with open("/proc/sys/kernel/cap_last_cap") as file:
        last = int(file.read())
    for capability in range(last + 1):
        libc.prctl(_PR_CAPBSET_DROP, capability, 0, 0, 0)  # an exec'd program's capabilities come from this set
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    no_capabilities = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; two 32-bit words
    libc.capset(header, no_capabilities)


def _supervise(config: _Config, argv: list[str]) -> NoReturn:
    parent = config.parent
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, PARENT_GONE):
        signal.signal(signum, lambda *_: None)  # they wake the loop below (set_wakeup_fd)
    if LINUX:
        prctl(PR_SET_PDEATHSIG, PARENT_GONE)
        prctl(_PR_SET_CHILD_SUBREAPER, 1)
    if os.getppid() != parent:  # it died before the request above took effect
        _leave(config)
    supervisor = os.getpid()
    program = os.fork()
    if program == 0:
        _start(config, argv, supervisor)
    # Hold no copy of the program's pipes and descriptors: their ends close when the program's do.
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.closerange(3, 1 << 16)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)

    tree = _Tree(program)
    limit = config.time_limit_s
    deadline = time.monotonic() + limit if limit is not None else float("inf")
    bounded = config.max_processes is not None or config.max_memory_bytes is not None
    why, stopping = "", False
    woken: set[int] = set()  # the signals that woke the last wait
    while True:
        tree.reap()
        if tree.status is not None:
            break
        if PARENT_GONE in woken or os.getppid() != parent:  # the signal: the starting thread ended
            tree.kill()
            _leave(config)
        if not stopping and woken & {signal.SIGTERM, signal.SIGHUP}:
            stopping = True
            _signal(program, signal.SIGTERM)
            deadline = min(deadline, time.monotonic() + STOP_GRACE_S)
        now = time.monotonic()
        if now >= deadline:
            why = "" if stopping else f"timed out after {limit:g} s"
            break
        if bounded:
            why = tree.over(config)
            if why:
                break
        wait_s = min(deadline - now, _LIMITS_CHECK_S if bounded else _CHECK_S)
        woken = set(os.read(wake_read, 512)) if select.select([wake_read], [], [], wait_s)[0] else set()
    tree.kill()
    if why and config.report is not None:
        try:
            with open(config.report, "w") as file:
                file.write(why)
        except OSError:  # the folder is gone: nobody reads it
            pass
    status = tree.status if tree.status is not None else signal.SIGKILL
    if os.WIFSIGNALED(status):
        end = os.WTERMSIG(status)
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        if end not in (signal.SIGKILL, signal.SIGSTOP):  # theirs cannot be set, nor need be
            signal.signal(end, signal.SIG_DFL)
        os.kill(os.getpid(), end)  # ends as the program did: the parent reads the same status
        os._exit(128 + end)
    os._exit(os.waitstatus_to_exitcode(status))


def _leave(config: _Config) -> NoReturn:
    """The parent is gone: nobody will read the scratch folder or clean it up."""
    if config.remove is not None:
        import shutil

        shutil.rmtree(config.remove, ignore_errors=True)
    os._exit(1)


if __name__ == "__main__":
    _supervise(_Config(sys.argv[1:11]), sys.argv[11:])
