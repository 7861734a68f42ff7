"""openenv:<url-or-module> - an OpenEnv environment server (HTTP and websocket) as an rlcli env.

Where the server is:
- `openenv:http://host:port` (https://, ws:// and wss:// too, with the path prefix of a server that
  sits under one): a server already running. make_factory checks, before any stage, that it answers
  GET /health and reads its action and observation types from GET /schema.
- `openenv:package.module[:attr]`: an installed module whose `attr` (default `app`) is the FastAPI app
  that OpenEnv's create_app made: what an OpenEnv env package ships as `server.app:app` (e.g.
  openenv:echo_env.server.app; rlcli.envs.openenv_guess is a small one). rlcli serves it itself:
  uvicorn in a subprocess on 127.0.0.1, on a port the OS picks, one server per rlcli process that
  plays episodes (the main process with env.workers 0, else each env worker), started when the
  process first loads the env and waited for on GET /health (up to START_TIMEOUT_S). It has rlcli's
  working directory and Python path. It dies with that process: stopped at exit, killed by the
  kernel when the process is killed -9 (PR_SET_PDEATHSIG, see envs/subprocesses.py), and with an
  env worker's process group. A server that dies fails the episodes it was playing and is replaced
  at the next reset.

Sessions: every episode is a websocket session (/ws) of its own, as with OpenEnv's EnvClient: the
server keeps one Environment instance per session, so the episodes that a rollout plays side by side
share no state (its HTTP /reset and /step build a fresh instance per request, which no episode of
several steps survives). The session ends with the episode (done) or when rlcli drops its env. A
server holds as many sessions at once as its app allows (create_app's max_concurrent_envs, 1 by
default): when every server rlcli started is full, it starts another; a server at a URL refuses the
extra sessions, and their episodes fail with a sentence saying so.

Actions: the reply, exactly as sampled, goes into the action's one string field (any field of type
str other than the base class's metadata; a Literal of strings counts, a const discriminator does
not); the action's other fields must have defaults. With several string fields, `action_field` (an
adapter option in env.kwargs) names the one, else the one of them that is required is taken. Refused: actions whose required fields are not all that
one string (a number, a tool call's arguments: MCP envs), and actions with no string field. A reply
the server's validation rejects (a Literal, a length limit) gets the error as feedback, without a
step, and the reward `invalid_action_reward` (default -1, as for gymnasium:).

Observations: OpenEnv sends an observation's fields without reward, done and metadata. The agent
reads one string field: `observation_field` if given, else the only string field, else the first of
TEXT_FIELDS that is one; otherwise all the fields written as JSON. `system_prompt` (an option) puts
a system message before the first observation.

Rewards and ends: a step's reward is the server's (none counts 0) and `done` terminates the episode.
info["success"] at done is the observation's boolean `success` field where it has one (OpenEnv's
servers drop an observation's metadata, so a field is the way to say it), else whether the last
reward is positive. reset sends the seed (an env whose reset takes none ignores it, and then a seed
does not pin the task) and the other env.kwargs, as reset arguments: OpenEnv passes those that the
env's reset accepts and drops the rest. info["task"] holds the env, the seed and the first
observation's fields; each step's info has the observation's fields.

Failures fail the episode, with the server's message: a session refused, a server that died or
closed the connection, an error raised by the env (env.step_timeout_s bounds every call). Refused
before any stage (UsageError): a URL where no server answers, a module that is not installed (with
the pip command), a server that does not start, an action that is not one string, and a reset that
fails: make_factory resets task 0 once per process, in a session of its own, with the recipe's reset
arguments. No expert, no tools.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import importlib.machinery
import inspect
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import ClientConnection, connect

from rlcli.envs.subprocesses import die_with_parent
from rlcli.errors import UsageError

START_TIMEOUT_S = 120.0  # a server's start: importing openenv alone takes seconds (it imports gradio)
HTTP_TIMEOUT_S = 10.0  # GET /health and /schema
MAX_MESSAGE_BYTES = 100 * 2**20  # as OpenEnv's EnvClient: observations may carry screenshots
TEXT_FIELDS = ("text", "message", "prompt", "observation", "content", "feedback")
_NOT_FIELDS = {"metadata"}  # the base classes' field that is no part of an action
_WIRE_DROPS = {"reward", "done", "metadata"}  # observation fields OpenEnv sends apart or not at all
_MODULE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?")
_SERVER_MARK = "rlcli-openenv-server"  # in the server's command line, and before its last words
_TAIL_LINES = 20
# websockets 17.1 asks a connection held beyond one `with` block to say so (legacy=True); older ones
# have no such argument.
_DIRECT: dict[str, Any] = {"legacy": True} if "legacy" in inspect.signature(connect).parameters else {}
# The server process: import the app, serve it on the socket rlcli bound (so the port is known and
# free), quietly. Its argv: MARK, the socket's fd, module:attr.
_LAUNCHER = """
import importlib, socket, sys
mark, fd, target = sys.argv[1], int(sys.argv[2]), sys.argv[3]
module, _, attr = target.partition(":")
try:
    app = getattr(importlib.import_module(module), attr or "app")
except Exception as exc:
    sys.exit(f"{mark}: cannot load {module}:{attr or 'app'}: {type(exc).__name__}: {exc}")
if isinstance(app, type) or not callable(app):
    what = "a class" if isinstance(app, type) else type(app).__name__
    sys.exit(f"{mark}: {module}:{attr or 'app'} is {what}, not an ASGI app: name the FastAPI app that "
             "create_app(Environment, Action, Observation) made (module:app)")
import uvicorn
server = uvicorn.Server(uvicorn.Config(app, log_level="warning", ws_max_size=100 * 2**20))
server.run(sockets=[socket.socket(fileno=fd)])
"""


# --- the types the server speaks -------------------------------------------------------------


def _kind(prop: dict[str, Any]) -> str:
    """A JSON-schema property's type in a word: string, integer, object, ..."""
    if "const" in prop:
        return "const"
    if "type" in prop:
        return str(prop["type"])
    options = [_kind(p) for p in prop.get("anyOf", []) if p.get("type") != "null"]
    if len(options) == 1:
        return options[0]
    return "object" if "$ref" in prop or "allOf" in prop else " | ".join(options) or "any"


class TextMapping:
    """How text becomes the env's action and its observation becomes text, read off GET /schema."""

    def __init__(
        self, name: str, schema: dict[str, Any], action_field: str | None, observation_field: str | None
    ) -> None:
        action, observation = schema.get("action"), schema.get("observation")
        if not isinstance(action, dict) or not isinstance(observation, dict):
            raise UsageError(f"{name}: its GET /schema has no action and observation schemas (not an OpenEnv server).")
        self.action_field = self._action_field(name, action, action_field)
        fields = {k: v for k, v in observation.get("properties", {}).items() if k not in _WIRE_DROPS}
        texts = [k for k, v in fields.items() if _kind(v) == "string"]
        if observation_field is not None:
            if observation_field not in fields:
                raise UsageError(
                    f"{name}: env.kwargs.observation_field {observation_field!r} is not a field of its "
                    f"observation {observation.get('title', '')} (fields: {', '.join(fields) or 'none'})."
                )
            self.text_field: str | None = observation_field
        elif len(texts) == 1:
            self.text_field = texts[0]
        else:
            self.text_field = next((f for f in TEXT_FIELDS if f in texts), None)

    @staticmethod
    def _action_field(name: str, action: dict[str, Any], chosen: str | None) -> str:
        props = {k: v for k, v in action.get("properties", {}).items() if k not in _NOT_FIELDS}
        required = [k for k in action.get("required", []) if k not in _NOT_FIELDS]
        title = action.get("title", "its action")
        described = ", ".join(f"{k} ({_kind(v)})" for k, v in props.items()) or "none"
        if props.get("type", {}).get("const") in ("call_tool", "list_tools"):
            raise UsageError(
                f"{name} is an MCP tool env: its actions ({title}: {described}) are tool calls, while rlcli's "
                "openenv adapter sends the reply as the action's one string field."
            )
        texts = [k for k, v in props.items() if _kind(v) == "string"]
        if chosen is not None:
            if chosen not in texts:
                raise UsageError(
                    f"{name}: env.kwargs.action_field {chosen!r} is not a string field of {title} (fields: {described})."
                )
            field = chosen
        elif len(texts) == 1:
            field = texts[0]
        elif len(required) == 1 and required[0] in texts:
            field = required[0]
        else:
            why = "has no string field" if not texts else f"has {len(texts)} string fields"
            hint = "" if not texts else " (name one with env.kwargs.action_field)"
            raise UsageError(
                f"{name}: {title} {why} (fields: {described}); rlcli puts the reply into the action's one "
                f"string field{hint}."
            )
        others = [k for k in required if k != field]
        if others:
            raise UsageError(
                f"{name}: {title} requires {', '.join(f'{k} ({_kind(props[k])})' for k in others)} besides "
                f"{field}, which a text reply cannot give; rlcli fills one string field and leaves the others "
                "to their defaults."
            )
        return field

    def text(self, fields: dict[str, Any]) -> str:
        if self.text_field is not None:
            value = fields.get(self.text_field)
            if value is None:
                return ""
            return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, default=str)
        return json.dumps(fields, ensure_ascii=False, default=str)


# --- servers -----------------------------------------------------------------------------------


class _Refused(RuntimeError):
    """A server at its limit of sessions refused one."""


class _Server:
    """A server episodes open sessions on; counts this process's sessions and learns its capacity."""

    local = False

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.ws_url = re.sub(r"^http", "ws", self.base_url) + "/ws"
        self.sessions = 0  # this process's open (or opening) sessions
        self.capacity: int | None = None  # learnt when the server refuses one

    def get(self, path: str) -> Any:
        """GET a JSON endpoint (no proxy for a local server)."""
        handlers = [urllib.request.ProxyHandler({})] if self.local else []
        with urllib.request.build_opener(*handlers).open(self.base_url + path, timeout=HTTP_TIMEOUT_S) as answer:
            return json.loads(answer.read())

    def connect(self) -> ClientConnection:
        try:
            return connect(
                self.ws_url,
                max_size=MAX_MESSAGE_BYTES,
                open_timeout=HTTP_TIMEOUT_S,
                close_timeout=2,
                proxy=None if self.local else True,
                **_DIRECT,
            )
        except (OSError, InvalidHandshake, TimeoutError) as exc:
            raise RuntimeError(
                self.lost(f"cannot open a session at {self.ws_url}: {type(exc).__name__}: {exc}")
            ) from None

    def lost(self, what: str) -> str:
        """Why a session failed: `what`, or what became of a local server."""
        return f"the OpenEnv server at {self.base_url}: {what}"


class _LocalServer(_Server):
    """`module:attr` served by uvicorn in a subprocess of this process (see the module's docstring)."""

    local = True

    def __init__(self, target: str, cwd: str, start_timeout_s: float) -> None:
        self.target = target
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", 0))
        super().__init__(f"http://127.0.0.1:{listener.getsockname()[1]}")
        paths = [p or cwd for p in sys.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(dict.fromkeys(paths))}
        argv = die_with_parent([sys.executable, "-c", _LAUNCHER, _SERVER_MARK, str(listener.fileno()), target])
        self.tail: collections.deque[str] = collections.deque(maxlen=_TAIL_LINES)
        self.proc: subprocess.Popen[bytes] | None = None
        started = threading.Event()
        failure: list[BaseException] = []

        def keep() -> None:
            """Start the server and read its output until it ends: the kernel's parent-death signal
            is tied to the thread that started it, so this thread lives as long as the server."""
            try:
                self.proc = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    pass_fds=(listener.fileno(),),
                )
            except BaseException as exc:  # reported to the caller below
                failure.append(exc)
                return
            finally:
                started.set()
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                text = line.decode(errors="replace").rstrip()
                if text:
                    self.tail.append(text)
            self.proc.wait()

        self.keeper = threading.Thread(target=keep, name="rlcli-openenv-server", daemon=True)
        self.keeper.start()
        started.wait()
        listener.close()  # the server holds its own copy
        if failure:
            raise failure[0]
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline, pause = time.monotonic() + timeout_s, 0.05
        while True:
            if not self.alive():
                raise RuntimeError(self.last_words())
            try:
                self.get("/health")
                return
            except urllib.error.HTTPError as exc:  # it serves, but not OpenEnv's endpoints
                self.stop()
                raise RuntimeError(f"it answered GET /health with HTTP {exc.code}: not an OpenEnv app") from None
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"it did not answer GET /health within {timeout_s:g} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.5)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def last_words(self) -> str:
        """Why the server ended: its own sentence (the launcher's), or its exit status and last line."""
        assert self.proc is not None
        self.keeper.join(5)  # the server has ended: its output is read to the end
        own = [line.partition(": ")[2] for line in self.tail if line.startswith(_SERVER_MARK + ": ")]
        if own:
            return own[-1]
        status = self.proc.returncode
        how = f"was killed by signal {-status}" if status < 0 else f"exited with status {status}"
        return f"it {how}" + (f" ({self.tail[-1]})" if self.tail else "")

    def lost(self, what: str) -> str:
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(1)  # a dropped connection is often its server's death, seen a moment later
        if self.proc is not None and self.proc.poll() is not None:
            return f"the OpenEnv server for {self.target} (pid {self.proc.pid}) ended: {self.last_words()}"
        return f"the OpenEnv server for {self.target} at {self.base_url}: {what}"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class _Servers:
    """Where an env's episodes open sessions: one server at a URL, or this process's local servers of
    a module, more of them started when all are full (or dead)."""

    def __init__(self, name: str, url: str | None = None, target: str | None = None, cwd: str = ".") -> None:
        self.name, self.target, self.cwd = name, target, cwd
        self.lock = threading.Lock()
        self.servers: list[_Server] = [_Server(url)] if url is not None else []
        self.schema: dict[str, Any] | None = None
        self.probed: set[str] = set()  # the reset arguments a first reset has taken

    def start(self) -> _LocalServer:
        assert self.target is not None
        server = _LocalServer(self.target, self.cwd, START_TIMEOUT_S)
        self.servers.append(server)
        return server

    def open(self, reset: dict[str, Any]) -> tuple[ClientConnection, _Server, dict[str, Any]]:
        """A new session, reset with `reset`: its connection, its server and the reset's answer."""
        waits = 0
        while True:
            with self.lock:
                server = self._pick()
                server.sessions += 1  # taken now, so that no other thread counts it free
            try:
                ws = server.connect()
                answer = _exchange(ws, server, {"type": "reset", "data": reset})
            except BaseException:
                with self.lock:
                    server.sessions -= 1
                raise
            if _code(answer) != "CAPACITY_REACHED":
                return ws, server, answer
            _close_quietly(ws)
            with self.lock:
                server.sessions -= 1
                mine = server.sessions
                if mine > 0:
                    server.capacity = mine  # full with this process's sessions
            data = answer.get("data", {})
            if mine == 0 and waits < 20:  # full with sessions that are closing (or another client's)
                waits += 1
                time.sleep(0.1)
                continue
            if not server.local or mine == 0:
                raise _Refused(
                    f"{server.lost('it refused a session')}; it holds at most {data.get('max_sessions', '?')} at "
                    f"once (its create_app's max_concurrent_envs) and {data.get('active_sessions', '?')} are open, "
                    f"{mine} of them this process's; rlcli opens one per episode in play, so raise "
                    "max_concurrent_envs or lower rollout.batch_size."
                )

    def _pick(self) -> _Server:
        """A server with room for one more session (under self.lock); a local one is started if none has."""
        if self.target is None:
            return self.servers[0]
        self.servers = [s for s in self.servers if isinstance(s, _LocalServer) and s.alive()]
        for server in self.servers:
            if server.capacity is None or server.sessions < server.capacity:
                return server
        return self.start()

    def release(self, server: _Server) -> None:
        with self.lock:
            server.sessions -= 1

    def stop(self) -> None:
        for server in self.servers:
            if isinstance(server, _LocalServer):
                server.stop()


# This process's servers: (module:attr, working directory) -> the servers it started; (URL, "") -> a server.
_pools: dict[tuple[str, str], _Servers] = {}
_pools_lock = threading.Lock()


def close_servers() -> None:
    """Stop every server this process started (at exit; tests call it too)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.stop()


def _forget_parents_servers() -> None:
    """A forked child does not own its parent's servers (nor their reader threads): start afresh."""
    global _pools_lock
    _pools.clear()
    _pools_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_parents_servers)
atexit.register(close_servers)


# --- the env -------------------------------------------------------------------------------------


def _code(answer: dict[str, Any]) -> str | None:
    return answer.get("data", {}).get("code") if answer.get("type") == "error" else None


def _exchange(ws: ClientConnection, server: _Server, message: dict[str, Any]) -> dict[str, Any]:
    """Send one message of OpenEnv's websocket protocol and read the answer."""
    with contextlib.suppress(ConnectionClosed):  # then read what it said before it closed (a refusal)
        ws.send(json.dumps(message))
    try:
        answer = json.loads(ws.recv())
    except ConnectionClosed as exc:
        raise RuntimeError(server.lost(f"it closed the session ({exc})")) from None
    if not isinstance(answer, dict):
        raise RuntimeError(server.lost(f"it answered {type(answer).__name__}, not a message"))
    return answer


def _close_quietly(ws: ClientConnection) -> None:
    with contextlib.suppress(Exception):
        ws.send(json.dumps({"type": "close"}))
    with contextlib.suppress(Exception):
        ws.close()


class OpenEnvEnv:
    """One episode: a websocket session of its own on an OpenEnv server (see the module's docstring)."""

    def __init__(
        self,
        name: str,
        servers: _Servers,
        mapping: TextMapping,
        reset_kwargs: dict[str, Any],
        system_prompt: str | None,
        invalid_action_reward: float,
    ) -> None:
        self.name, self.servers, self.mapping = name, servers, mapping
        self.reset_kwargs, self.system_prompt = reset_kwargs, system_prompt
        self.invalid_action_reward = invalid_action_reward
        self._ws: ClientConnection | None = None
        self._server: _Server | None = None
        self._lock = threading.Lock()

    def reset(self, seed: int) -> tuple[str | list[dict[str, str]], dict[str, Any]]:
        self.close()
        ws, server, answer = self.servers.open({"seed": seed, **self.reset_kwargs})
        with self._lock:
            self._ws, self._server = ws, server
        fields, _, done = self._observation(answer, "reset")
        if done:
            self.close()
            raise RuntimeError(f"{self.name} ended the episode at its reset (done: true)")
        text = self.mapping.text(fields)
        task = {"env": self.name, "seed": seed, "observation": fields}
        if self.system_prompt is None:
            return text, {"task": task}
        messages = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": text}]
        return messages, {"task": task}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        ws, server = self._ws, self._server
        if ws is None or server is None:
            raise RuntimeError(f"{self.name}: step without a session (call reset first; a done episode has none)")
        answer = _exchange(ws, server, {"type": "step", "data": {self.mapping.action_field: action}})
        if _code(answer) == "VALIDATION_ERROR":
            errors = answer["data"].get("errors") or [{}]
            first = errors[0] if isinstance(errors[0], dict) else {}
            where = ".".join(str(part) for part in first.get("loc", ()))
            why = first.get("msg") or answer["data"].get("message", "invalid")
            feedback = f"Invalid action ({where}: {why})." if where else f"Invalid action ({why})."
            return feedback, self.invalid_action_reward, False, False, {"valid": False, "error": why}
        fields, reward, done = self._observation(answer, "step")
        info: dict[str, Any] = {"valid": True, "observation": fields}
        if done:
            success = fields.get("success")
            info["success"] = success if isinstance(success, bool) else reward > 0
            self.close()
        return self.mapping.text(fields), reward, done, False, info

    def _observation(self, answer: dict[str, Any], call: str) -> tuple[dict[str, Any], float, bool]:
        if answer.get("type") == "error":
            data = answer.get("data", {})
            raise RuntimeError(f"{self.name} failed its {call}: {data.get('message')} ({data.get('code')})")
        data = answer.get("data")
        if answer.get("type") != "observation" or not isinstance(data, dict):
            raise RuntimeError(f"{self.name} answered its {call} with a {answer.get('type')!r} message")
        fields = data.get("observation")
        reward = data.get("reward")
        if not isinstance(fields, dict) or not (reward is None or isinstance(reward, (int, float))):
            raise RuntimeError(f"{self.name} answered its {call} with a malformed observation: {data}")
        return fields, float(reward or 0.0), bool(data.get("done"))

    def close(self) -> None:
        """End the session (the server drops the episode's Environment); the env is done with."""
        with self._lock:
            ws, server = self._ws, self._server
            self._ws = self._server = None
        if ws is not None and server is not None:
            _close_quietly(ws)
            self.servers.release(server)

    def __del__(self) -> None:  # rlcli drops an env when its episode ends, done or not
        with contextlib.suppress(Exception):
            self.close()


# --- loading -------------------------------------------------------------------------------------


def make_factory(
    rest: str,
    action_field: str | None = None,
    observation_field: str | None = None,
    system_prompt: str | None = None,
    invalid_action_reward: float = -1.0,
    **reset_kwargs: Any,
) -> Callable[[], OpenEnvEnv]:
    """Check the server (starting it for a module) once per process; a fresh session per episode."""
    name = f"openenv:{rest}"
    for option, value in (
        ("action_field", action_field),
        ("observation_field", observation_field),
        ("system_prompt", system_prompt),
    ):
        if value is not None and not isinstance(value, str):
            raise UsageError(f"env.kwargs.{option}: expected a string, got {value!r}.")
    if isinstance(invalid_action_reward, bool) or not isinstance(invalid_action_reward, (int, float)):
        raise UsageError(f"env.kwargs.invalid_action_reward: expected a number, got {invalid_action_reward!r}.")
    taken = sorted(set(reset_kwargs) & {"seed", "episode_id"})
    if taken:
        raise UsageError(f"env.kwargs.{taken[0]}: rlcli sends each episode's own to the env's reset; drop it.")
    try:
        json.dumps(reset_kwargs)
    except TypeError as exc:
        raise UsageError(f"env.kwargs for {name} go to the env's reset as JSON, and cannot: {exc}.") from None
    servers = _servers_for(name, rest)
    if servers.schema is None:
        try:
            servers.schema = servers.servers[0].get("/schema")
        except (OSError, ValueError) as exc:
            _drop(servers)
            raise UsageError(f"{name}: GET /schema failed ({exc}), so it is not an OpenEnv server.") from None
    try:
        mapping = TextMapping(name, servers.schema or {}, action_field, observation_field)
        _probe(name, servers, reset_kwargs)
    except UsageError:
        _drop(servers)  # a server rlcli cannot use is not kept running
        raise
    reward = float(invalid_action_reward)
    return lambda: OpenEnvEnv(name, servers, mapping, reset_kwargs, system_prompt, reward)


def _probe(name: str, servers: _Servers, reset_kwargs: dict[str, Any]) -> None:
    """Reset task 0 once, in a session of its own, so that an env refusing the recipe's reset arguments
    (or a websocket endpoint that does not answer) stops the recipe now rather than failing every episode."""
    key = json.dumps(reset_kwargs, sort_keys=True)
    if key in servers.probed:
        return
    try:
        ws, server, answer = servers.open({"seed": 0, **reset_kwargs})
    except _Refused:
        return  # busy with other sessions: the episodes will see
    except RuntimeError as exc:
        raise UsageError(f"{name}: {exc}.") from None
    try:
        if answer.get("type") == "error":
            data = answer.get("data", {})
            given = f" with env.kwargs {reset_kwargs}" if reset_kwargs else ""
            raise UsageError(f"{name}: its reset{given} failed: {data.get('message')} ({data.get('code')}).")
    finally:
        _close_quietly(ws)
        servers.release(server)
    servers.probed.add(key)


def _drop(servers: _Servers) -> None:
    with _pools_lock:
        for key in [k for k, v in _pools.items() if v is servers]:
            del _pools[key]
    servers.stop()


def _servers_for(name: str, rest: str) -> _Servers:
    if "://" in rest:
        scheme = rest.partition("://")[0].lower()
        if scheme not in ("http", "https", "ws", "wss"):
            raise UsageError(f"{name}: expected an http://, https://, ws:// or wss:// URL, got {scheme}://.")
        url = re.sub(r"^ws", "http", rest, flags=re.I)
        with _pools_lock:
            servers = _pools.setdefault((url, ""), _Servers(name, url=url))
        try:
            servers.servers[0].get("/health")
        except urllib.error.URLError as exc:
            raise UsageError(f"{name}: no OpenEnv server answers at {url} (GET /health: {exc.reason}).") from None
        except (OSError, ValueError) as exc:
            raise UsageError(f"{name}: no OpenEnv server answers at {url} (GET /health: {exc}).") from None
        return servers
    if not _MODULE.fullmatch(rest):
        raise UsageError(
            f"{name}: expected a URL (http://host:port) or an installed module naming the server's app "
            "(package.module[:app], e.g. openenv:echo_env.server.app)."
        )
    cwd = os.getcwd()
    top = rest.partition(":")[0].split(".")[0]
    if importlib.machinery.PathFinder.find_spec(top, [cwd, *sys.path]) is None and top not in sys.modules:
        raise UsageError(
            f"{name}: the module {top!r} is not installed; install the env's package first, e.g. pip install "
            f"openenv-{top.replace('_', '-')} (OpenEnv publishes env packages as openenv-<name>)."
        )
    key = (rest, cwd)
    with _pools_lock:
        found = _pools.get(key)
        if found is not None:
            return found
        servers = _Servers(name, target=rest, cwd=cwd)
        try:
            servers.start()
        except (RuntimeError, OSError) as exc:
            raise UsageError(f"{name}: its server did not start: {exc}.") from None
        _pools[key] = servers
        return servers
