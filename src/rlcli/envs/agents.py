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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlcli.envs.sandbox import BASE_ENV, Sandbox, hidden_runs, sandboxed
from rlcli.errors import UsageError
from rlcli.usercode import import_file

AGENT_PREFIX = "agent:"
AGENT_CMD = "agent-cmd"
API_KEY = "rlcli"  # the endpoint accepts any key; clients refuse to start without one


def is_agent(env_name: str) -> bool:
    return env_name.startswith(AGENT_PREFIX) or env_name == AGENT_CMD


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
    return AgentProgram(env_name, [sys.executable, "-m", "rlcli.envs.agent_child", where, name], callable=True)


@dataclass
class AgentOutcome:
    reward: float | None = None  # None: the recipe's reward functions score the transcript
    success: bool | None = None
    error: str | None = None  # why the episode failed
    timed_out: bool = False


@dataclass(frozen=True)
class AgentSandbox:
    """Where a sandboxed agent (env.sandbox) finds the endpoint, and the folder it runs in (read-only)."""

    unix_socket: str  # the endpoint's, in a folder of its own that the sandbox shows
    root: Path


def run_agent(
    program: AgentProgram,
    base_url: str,
    model: str,
    task: dict[str, Any],
    time_limit_s: float,
    sandbox: AgentSandbox | None = None,
) -> AgentOutcome:
    """Run one episode of the program to its end (or kill it, with its process group, at the time limit)."""
    client = {"base_url": base_url, "api_key": API_KEY, "model": model}
    stdin = json.dumps({"client": client, "task": task} if program.callable else task)
    openai = {"OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": model}
    env = {**os.environ, **openai}
    argv = program.argv
    if sandbox is not None:
        argv, env = _in_bubblewrap(program, sandbox, openai), BASE_ENV
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
            return AgentOutcome(
                error=f"the agent ran past env.step_timeout_s ({time_limit_s:g} s) and was stopped", timed_out=True
            )
        finally:
            _kill_group(proc)  # with whatever it started: nothing of the episode's outlives it
            proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if proc.returncode != 0:
        tail = stderr.strip().splitlines()[-1] if stderr.strip() else "no message on stderr"
        return AgentOutcome(error=f"the agent exited with code {proc.returncode}: {tail}")
    return _outcome(program, stdout)


def _in_bubblewrap(program: AgentProgram, sandbox: AgentSandbox, openai: dict[str, str]) -> list[str]:
    """The program's command line in bubblewrap (envs/sandbox.py): no network but the endpoint's socket
    (agent_child forwards to it), the folder rlcli runs in, the agent's own folder (a command's program
    and the files its arguments name by absolute path) and the Python path read-only (the runs folder
    hidden), and only the OPENAI_* variables of rlcli's environment."""
    inner = program.argv[3:] if program.callable else ["--command", *program.argv]
    argv = [sys.executable, "-m", "rlcli.envs.agent_child", "--proxy", sandbox.unix_socket, *inner]
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
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


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
