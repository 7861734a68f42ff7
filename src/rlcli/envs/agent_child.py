"""Runs one episode of an agent program in a process of its own: a callable given as
`agent:path/file.py:function` (or a module), or, in bubblewrap, a command.

`python -m rlcli.envs.agent_child [--proxy SOCKET] FILE-OR-MODULE FUNCTION` reads {"client": {base_url,
api_key, model}, "task": {...}} as one JSON object on stdin, calls FUNCTION(client, task) (awaiting it when
it is a coroutine function), and writes its return value as the last stdout line, {"result": value}: the
protocol of `agent-cmd` programs, so that both kinds of agent are run, timed and killed alike
(envs/agents.py). `... [--proxy SOCKET] --command PROGRAM ARGS...` runs an agent-cmd program instead.

--proxy: in bubblewrap the agent has no network but its own loopback, so the endpoint is reached through
its Unix socket (bound into the sandbox): a forwarder listens on the sandbox's 127.0.0.1 and the client's
base URL (and OPENAI_BASE_URL) point there. Only the standard library is imported here, so the agent's
process holds what the agent imports and nothing of rlcli's.

`--limits MEMORY_MB CPU_S` (after --proxy; "-" for none) sets env.worker_memory_mb and env.worker_cpu_s as the
process's own limits (RLIMIT_AS, RLIMIT_CPU), which the program it runs inherits; with --forks, a request's
"limits" are set in each episode's child instead.

`... --forks FILE-OR-MODULE FUNCTION` imports the callable once and forks every episode from that process
(envs/agents.py AgentForks): an episode then starts in milliseconds instead of a fresh interpreter's
second or so of imports (openai's alone is most of it). The protocol is one line each way, on stdin and
stdout: `{"id", "given", "env", "stdout", "stderr"}` in (run one episode), `{"kill": id}` in (its time is
up), `ID started PID` out when an episode's process is forked, and `ID ended RETURNCODE` when it has ended. Each episode is a child in a session of its own, with
its output in the files named; when it ends, whatever it left in its process group is killed before it
is reaped and reported. The server exits when its stdin closes (rlcli ended), killing the episodes left.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import math
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit


def main(argv: list[str]) -> int:
    proxy = None
    if argv[:1] == ["--proxy"]:
        proxy, argv = argv[1], argv[2:]
        os.environ["OPENAI_BASE_URL"] = _through(proxy, os.environ["OPENAI_BASE_URL"])
    if argv[:1] == ["--limits"]:
        _limit(argv[1], argv[2])
        argv = argv[3:]
    if argv[:1] == ["--command"]:
        code = subprocess.run(argv[1:]).returncode  # stdin, stdout and the environment are the program's
        if code < 0:  # killed by a signal (SIGXCPU past env.worker_cpu_s): end as it did, for rlcli to tell
            signal.signal(-code, signal.SIG_DFL)
            os.kill(os.getpid(), -code)
        return code
    if argv[:1] == ["--forks"]:
        # The protocol keeps stdout's pipe to itself; what the agent's module prints goes to stderr.
        protocol = os.dup(1)
        os.dup2(2, 1)
        return _serve_forks(_load(argv[1], argv[2]), protocol)
    fn = _load(argv[0], argv[1])
    given = json.loads(sys.stdin.read())
    if proxy is not None:
        given["client"]["base_url"] = os.environ["OPENAI_BASE_URL"]
    _play(fn, given)
    return 0


def _load(target: str, name: str) -> Callable[..., Any]:
    """The agent's function, from a .py file (its folder first on sys.path, as `python file.py` has it)
    or an importable module."""
    if target.endswith(".py"):
        path = Path(target)
        spec = importlib.util.spec_from_file_location(f"rlcli_agent_{path.stem}", path)
        if spec is None or spec.loader is None:
            print(f"{path} is not a Python file", file=sys.stderr)
            raise SystemExit(2)
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        sys.path.insert(0, str(path.resolve().parent))
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    return getattr(module, name)


def _play(fn: Callable[..., Any], given: dict) -> None:
    """One episode: the agent's return value as the last stdout line."""
    result = fn(given["client"], given["task"])
    if inspect.isawaitable(result):
        result = asyncio.run(_wait(result))
    sys.stdout.write("\n" + json.dumps({"result": result}) + "\n")
    sys.stdout.flush()


def _serve_forks(fn: Callable[..., Any], protocol: int) -> int:
    """Fork an episode per request line on stdin; report its end on the protocol's pipe (see the module
    docstring). One thread, woken by stdin or SIGCHLD, so that forking never copies a lock held elsewhere."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wake-up byte is written
    running: dict[int, int] = {}  # pid -> request id
    pending = b""
    while True:
        ready, _, _ = select.select([0, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 4096)
            _reap(running, protocol)
        if 0 not in ready:
            continue
        data = os.read(0, 1 << 16)
        if not data:  # rlcli is gone: so are its episodes
            for pid in running:
                _kill_group(pid)
            return 0
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            request = json.loads(line)
            if "kill" in request:
                for pid in [p for p, i in running.items() if i == request["kill"]]:
                    _kill_group(pid)
                continue
            pid = os.fork()
            if pid == 0:
                for fd in (wake_read, wake_write, protocol):
                    os.close(fd)
                _episode(fn, request)  # never returns
            running[pid] = request["id"]
            _report(protocol, f"{request['id']} started {pid}")


def _episode(fn: Callable[..., Any], request: dict) -> None:
    """In the forked child: a session of its own, the request's files as stdout and stderr, then the
    agent; exits as `python -m rlcli.envs.agent_child` would (1 on an exception, with its traceback)."""
    code = 0
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        if request.get("limits"):
            _limit(*request["limits"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        for fd, target in ((devnull, 0), (out, 1), (err, 2)):
            os.dup2(fd, target)
            os.close(fd)
        # New file objects over the new descriptors: the server's own may hold buffered bytes of its pipe.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 (the process ends with the episode)
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        os.environ.update(request["env"])
        _play(fn, request["given"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)


def _limit(memory_mb: str, cpu_s: str) -> None:
    """This process's limits ("-": none), as env workers have them (envs/workers.py; not imported here, where
    only the standard library is): address space in MiB, and CPU seconds (past them SIGXCPU, then SIGKILL)."""
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a killed agent leaves no core file about
    if memory_mb != "-":
        limit = int(memory_mb) * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    if cpu_s != "-":
        soft = math.ceil(float(cpu_s))
        resource.setrlimit(resource.RLIMIT_CPU, (soft, soft + 1))


def _reap(running: dict[int, int], protocol: int) -> None:
    """Report every episode that has ended, after killing what it left in its process group (the group
    still exists while its leader is unreaped, so its id cannot have been reused)."""
    while running:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None:
            return
        _kill_group(info.si_pid)
        _, status = os.waitpid(info.si_pid, 0)
        request_id = running.pop(info.si_pid, None)
        if request_id is not None:
            _report(protocol, f"{request_id} ended {os.waitstatus_to_exitcode(status)}")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _report(protocol: int, line: str) -> None:
    os.write(protocol, (line + "\n").encode())  # one short write: never interleaved


async def _wait(awaitable: object) -> object:
    return await awaitable  # type: ignore[misc]


def _through(unix_socket: str, base_url: str) -> str:
    """base_url with its host and port replaced by a forwarder's on 127.0.0.1, which relays each connection
    to the endpoint's Unix socket."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            client, _ = listener.accept()
            upstream = socket.socket(socket.AF_UNIX)
            try:
                upstream.connect(unix_socket)
            except OSError:
                client.close()
                continue
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=_relay, args=(source, sink), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    parts = urlsplit(base_url)
    return urlunsplit(parts._replace(netloc=f"127.0.0.1:{listener.getsockname()[1]}"))


def _relay(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(1 << 16):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
