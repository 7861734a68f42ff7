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
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit


def main(argv: list[str]) -> int:
    proxy = None
    if argv[:1] == ["--proxy"]:
        proxy, argv = argv[1], argv[2:]
        os.environ["OPENAI_BASE_URL"] = _through(proxy, os.environ["OPENAI_BASE_URL"])
    if argv[:1] == ["--command"]:
        return subprocess.run(argv[1:]).returncode  # stdin, stdout and the environment are the program's
    target, name = argv[0], argv[1]
    if target.endswith(".py"):
        path = Path(target)
        spec = importlib.util.spec_from_file_location(f"rlcli_agent_{path.stem}", path)
        if spec is None or spec.loader is None:
            print(f"{path} is not a Python file", file=sys.stderr)
            return 2
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        sys.path.insert(
            0, str(path.resolve().parent)
        )  # the agent's own modules beside it, as `python file.py` finds them
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(target)
    given = json.loads(sys.stdin.read())
    if proxy is not None:
        given["client"]["base_url"] = os.environ["OPENAI_BASE_URL"]
    fn = getattr(module, name)
    result = fn(given["client"], given["task"])
    if inspect.isawaitable(result):
        result = asyncio.run(_wait(result))
    sys.stdout.write("\n" + json.dumps({"result": result}) + "\n")
    return 0


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
