"""Agent programs as environments: `env.name: agent:path/file.py:function` or `agent:package.module:function`
(a Python callable) or
`env.name: agent-cmd` with `env.command: [program, args...]` (any program).

Either runs once per episode in a process of its own, in a new session (so that the whole process
group is killed at the episode's end or time limit), with OPENAI_BASE_URL (the episode's own base URL
on rlcli's endpoint), OPENAI_API_KEY and OPENAI_MODEL set and one JSON object on stdin. A callable is
run by envs/agent_child.py, which calls it with the client settings and the task and prints its return
value; a command reads the task from stdin itself and prints a JSON object with `reward` (and optionally
`success`) as its last stdout line. The episode's turns are the calls the endpoint recorded for its
base URL (engine/agent_runner.py).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.envs.sandbox import BASE_ENV, Sandbox, hidden_runs, sandboxed
from rlcli.errors import UsageError
from rlcli.recipe import AGENT_CMD, AGENT_PREFIX
from rlcli.usercode import import_file

API_KEY = "rlcli"  # the endpoint accepts any key; clients refuse to start without one
_CHILD = [sys.executable, "-m", "rlcli.envs.agent_child"]  # runs an episode (envs/agent_child.py)


@dataclass(frozen=True)
class AgentProgram:
    env_name: str
    argv: list[str]  # what runs one episode
    callable: bool  # agent:file.py:function (its return value is the result) or agent-cmd (its last line)


def agent_program(env_name: str, command: list[str] | None, root: Path) -> AgentProgram:
    """The program an agent env runs, checked (the file imports and has the callable; the command's program
    exists); a UsageError naming what is missing otherwise."""
    if env_name == AGENT_CMD:
        if not command:
            raise UsageError("env.name agent-cmd runs env.command, which is empty; expected [program, args...].")
        program = shutil.which(command[0]) or shutil.which(str(root / command[0]))
        if program is None:
            raise UsageError(f"env.command: no program {command[0]!r} (not on PATH, nor an executable file in {root}).")
        return AgentProgram(env_name, [program, *command[1:]], callable=False)
    if command:
        raise UsageError(f"env.command is set, but env.name is {env_name!r}; expected env.name agent-cmd to run it.")
    target, _, name = env_name[len(AGENT_PREFIX) :].rpartition(":")
    if not target or not name:
        raise UsageError(
            f"env.name {env_name!r}: expected agent:path/file.py:function or agent:package.module:function."
        )
    if target.endswith(".py"):
        path = Path(target)
        path = path if path.is_absolute() else root / path
        if not path.is_file():
            raise UsageError(f"env.name {env_name!r}: no file {path}.")
        module, where = import_file(path), str(path)
    else:  # an importable module: an installed package's, or the recipe's shipped agents (rlcli.builtin_envs)
        try:
            module, where = importlib.import_module(target), target
        except ImportError as exc:
            raise UsageError(f"env.name {env_name!r}: module {target!r} cannot be imported ({exc}).") from None
    if not callable(getattr(module, name, None)):
        raise UsageError(f"env.name {env_name!r}: {where} defines no function {name!r}.")
    return AgentProgram(env_name, [*_CHILD, where, name], callable=True)


@dataclass
class AgentOutcome:
    reward: float | None = None  # None: the recipe's reward functions score the transcript
    success: bool | None = None
    error: str | None = None  # why the episode failed
    timed_out: bool = False
    lost: bool = False  # ended by rlcli's side (the forks server died), not by the agent: played again


@dataclass(frozen=True)
class AgentLimits:
    """env.worker_memory_mb and env.worker_cpu_s, set on each episode's process (envs/agent_child.py), as env
    workers have them: its address space in MiB, and the CPU seconds each process of the episode may use."""

    memory_mb: int | None = None
    cpu_s: float | None = None

    def args(self) -> list[str]:
        """agent_child's --limits arguments ("-": none); nothing without limits."""
        if self.memory_mb is None and self.cpu_s is None:
            return []
        return ["--limits", *("-" if v is None else str(v) for v in (self.memory_mb, self.cpu_s))]


@dataclass(frozen=True)
class AgentSandbox:
    """Where a sandboxed agent (env.sandbox) finds the endpoint, and the folder it runs in (read-only)."""

    unix_socket: str  # the endpoint's, in a folder of its own that the sandbox shows
    root: Path


@dataclass
class _Ended:
    """How an agent's process ended: its exit code (None: killed at its time limit) and its output."""

    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    lost: bool = False  # the process it was forked from died under it: not the episode's doing


class AgentForks:
    """A process that imports an agent callable once and forks each episode from it (envs/agent_child.py
    `--forks`), so that an episode starts in milliseconds rather than a fresh interpreter's second of
    imports. Each episode still runs in a process and a session of its own, killed with everything it
    started at its end or time limit, as run_agent's own processes are. `run` may be called from any
    thread; the server ends with close(), or by itself when rlcli's end closes its stdin. Should the server die
    (killed from outside, out of memory), the episodes it was running are killed and reported lost, for
    their pass to play them again, as an env worker's are."""

    def __init__(self, program: AgentProgram):
        if not program.callable:
            raise ValueError("only a callable agent (agent:...) is forked; agent-cmd runs its own program")
        self.folder = tempfile.TemporaryDirectory(prefix="rlcli-agents-")
        self.errors = open(os.path.join(self.folder.name, "server.err"), "w+")  # noqa: SIM115 (closed in close)
        argv = [*_CHILD, "--forks", *program.argv[3:]]
        self.process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.errors, start_new_session=True
        )
        self.lock = threading.Lock()
        self.next_id = 0
        self.ended: dict[int, int] = {}  # request id -> exit code
        self.started: dict[int, int] = {}  # request id -> its episode's pid, while it runs
        self.changed = threading.Condition(self.lock)
        self.reader = threading.Thread(target=self._read, name="rlcli-agent-forks", daemon=True)
        self.reader.start()

    def __enter__(self) -> AgentForks:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the server: closing its stdin makes it kill the episodes still running and exit."""
        with contextlib.suppress(OSError):
            self.process.stdin.close()  # type: ignore[union-attr]
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            _kill_group(self.process)
            self.process.wait()
        self.reader.join()
        self.errors.close()
        self.folder.cleanup()

    def run(self, given: dict[str, Any], env: dict[str, str], time_limit_s: float, limits: AgentLimits) -> _Ended:
        with self.lock:
            request_id, self.next_id = self.next_id, self.next_id + 1
        out, err = (os.path.join(self.folder.name, f"{request_id}.{name}") for name in ("out", "err"))
        request = {"id": request_id, "given": given, "env": env, "stdout": out, "stderr": err}
        if limits.args():
            request["limits"] = limits.args()[1:]
        self._send(request)
        with self.lock:
            done = self.changed.wait_for(lambda: request_id in self.ended or self._gone(), time_limit_s)
            if not done:
                self._send({"kill": request_id})
                self.changed.wait_for(lambda: request_id in self.ended or self._gone())
            returncode = self.ended.pop(request_id, None)
            pid = self.started.pop(request_id, None)
        if returncode is None:  # the server died under the episode: its process group goes with it
            if pid is not None:
                _kill_group_of(pid)
            self.errors.seek(0)
            tail = (self.errors.read().strip().splitlines() or ["no message on stderr"])[-1]
            code = self.process.wait()
            return _Ended(None, stderr=f"exit code {code}: {tail}", lost=True)
        return _Ended(returncode if done else None, _read_and_remove(out), _read_and_remove(err))

    def _send(self, message: dict[str, Any]) -> None:
        with contextlib.suppress(OSError, ValueError):  # a server that is gone answers nothing: _gone says so
            self.process.stdin.write((json.dumps(message) + "\n").encode())  # type: ignore[union-attr]
            self.process.stdin.flush()  # type: ignore[union-attr]

    def _gone(self) -> bool:
        return not self.reader.is_alive() or self.process.poll() is not None

    def _read(self) -> None:
        for line in self.process.stdout:  # type: ignore[union-attr]
            request_id, what, number = line.decode().split()
            with self.lock:
                if what == "started":
                    self.started[int(request_id)] = int(number)
                else:
                    self.ended[int(request_id)] = int(number)
                    self.started.pop(int(request_id), None)
                self.changed.notify_all()
        with self.lock:
            self.changed.notify_all()


def _read_and_remove(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""
    finally:
        with contextlib.suppress(OSError):
            os.remove(path)


def run_agent(
    program: AgentProgram,
    base_url: str,
    model: str,
    task: dict[str, Any],
    time_limit_s: float,
    sandbox: AgentSandbox | None = None,
    forks: AgentForks | None = None,
    limits: AgentLimits = AgentLimits(),
) -> AgentOutcome:
    """Run one episode of the program to its end (or kill it, with its process group, at the time limit):
    forked from `forks` when given, else in a process started for it."""
    client = {"base_url": base_url, "api_key": API_KEY, "model": model}
    given = {"client": client, "task": task} if program.callable else task
    openai = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": model}
    if forks is not None:
        ended = forks.run(given, openai, time_limit_s, limits)
    else:
        ended = _run_process(program, json.dumps(given), openai, time_limit_s, sandbox, limits)
    if ended.lost:
        return AgentOutcome(error=f"the process the agent's episodes are forked from ended ({ended.stderr})", lost=True)
    if ended.returncode is None:
        return AgentOutcome(
            error=f"the agent ran past env.step_timeout_s ({time_limit_s:g} s) and was stopped", timed_out=True
        )
    if ended.returncode in (-signal.SIGXCPU, -signal.SIGKILL) and limits.cpu_s is not None:
        return AgentOutcome(
            error=f"the agent used more than env.worker_cpu_s={limits.cpu_s:g} CPU seconds and was stopped"
        )
    if ended.returncode != 0:
        tail = ended.stderr.strip().splitlines()[-1] if ended.stderr.strip() else "no message on stderr"
        if tail.startswith("MemoryError") and limits.memory_mb is not None:
            tail += f" (env.worker_memory_mb={limits.memory_mb} MiB of address space)"
        return AgentOutcome(error=f"the agent exited with code {ended.returncode}: {tail}")
    return _outcome(program, ended.stdout)


def _run_process(
    program: AgentProgram,
    stdin: str,
    openai: dict[str, str],
    time_limit_s: float,
    sandbox: AgentSandbox | None,
    limits: AgentLimits,
) -> _Ended:
    env = {**os.environ, **openai}
    if sandbox is not None:
        argv, env = _in_bubblewrap(program, sandbox, openai, limits), BASE_ENV
    elif program.callable:  # python -m rlcli.envs.agent_child [--limits ...] FILE FUNCTION
        argv = [*_CHILD, *limits.args(), *program.argv[3:]]
    else:  # a command runs under agent_child only where it sets limits for it
        argv = [*_CHILD, *limits.args(), "--command", *program.argv] if limits.args() else program.argv
    # Files, not pipes: a process the agent leaves behind would hold a pipe open, and the episode would
    # wait for it; the episode ends when the agent's own process does.
    with (
        tempfile.TemporaryFile("w+") as given,
        tempfile.TemporaryFile("w+") as out,
        tempfile.TemporaryFile("w+") as err,
    ):
        given.write(stdin)
        given.seek(0)
        proc = subprocess.Popen(argv, stdin=given, stdout=out, stderr=err, env=env, start_new_session=True)
        try:
            proc.wait(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            return _Ended(None)
        finally:
            _kill_group(proc)  # with whatever it started: nothing of the episode's outlives it
            proc.wait()
        out.seek(0)
        err.seek(0)
        return _Ended(proc.returncode, out.read(), err.read())


def _in_bubblewrap(
    program: AgentProgram, sandbox: AgentSandbox, openai: dict[str, str], limits: AgentLimits
) -> list[str]:
    """The program's command line in bubblewrap (envs/sandbox.py): no network but the endpoint's socket
    (agent_child forwards to it), the folder rlcli runs in, the agent's own folder (a command's program
    and the files its arguments name by absolute path) and the Python path read-only (the runs folder
    hidden), and only the OPENAI_* variables of rlcli's environment."""
    inner = program.argv[3:] if program.callable else ["--command", *program.argv]
    argv = [*_CHILD, "--proxy", sandbox.unix_socket, *limits.args(), *inner]
    own = [str(Path(inner[0]).resolve().parent)] if program.callable and inner[0].endswith(".py") else []
    if not program.callable:  # the program, and files its arguments name (python /path/agent.py)
        own += [str(Path(a).resolve().parent) for a in program.argv if os.path.isabs(a) and os.path.isfile(a)]
    import rlcli.builtin_envs

    packages = [str(Path(rlcli.__file__).resolve().parent.parent), str(Path(rlcli.builtin_envs.__file__).parent)]
    python_path = [path for path in sys.path if os.path.isabs(path) and os.path.isdir(path)]
    socket_folder = str(Path(sandbox.unix_socket).parent)
    shown = list(dict.fromkeys([str(sandbox.root), *own, *python_path, *packages, socket_folder]))
    env = tuple({**BASE_ENV, **openai}.items())
    return sandboxed(argv, Sandbox(env, cwd=str(sandbox.root), readable=tuple(shown), hidden=hidden_runs(shown)))


def _kill_group(proc: subprocess.Popen) -> None:
    _kill_group_of(proc.pid)


def _kill_group_of(pid: int) -> None:
    """SIGKILL the process group that `pid` leads (each agent's process leads a session of its own)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _outcome(program: AgentProgram, out: str) -> AgentOutcome:
    lines = out.strip().splitlines()
    try:
        last = json.loads(lines[-1]) if lines else None
    except ValueError:
        last = None
    expected = "a reward (a number), a dict with reward and optionally success, or None"
    if program.callable:
        if not isinstance(last, dict) or "result" not in last:
            return AgentOutcome(error="the agent's process ended without reporting its return value")
        result = last["result"]
        if result is None:
            return AgentOutcome()
        if isinstance(result, (int, float)) and not isinstance(result, bool):
            return AgentOutcome(reward=float(result))
        if not isinstance(result, dict):
            return AgentOutcome(error=f"the agent returned {result!r}; expected {expected}")
    else:
        if not isinstance(last, dict):
            return AgentOutcome(error="the agent's last stdout line is not a JSON object with reward")
        result = last
    reward, success = result.get("reward"), result.get("success")
    if reward is not None and (not isinstance(reward, (int, float)) or isinstance(reward, bool)):
        return AgentOutcome(error=f"the agent's reward is {reward!r}; expected a number or null")
    if success is not None and not isinstance(success, bool):
        return AgentOutcome(error=f"the agent's success is {success!r}; expected true, false or null")
    return AgentOutcome(reward=None if reward is None else float(reward), success=success)
