"""Tools that a model calls during an episode: Python functions and the tools of MCP servers.

A recipe names them in env.tools (`python_exec`, `package.module:function`, `path/file.py:function`)
and env.mcp_servers (the argv of stdio MCP servers); an env may add callables of its own. A `ToolBox`
loads them all, gives the chat template their specs, and runs calls: a tool's fault (an unknown
name, bad arguments, a raise, a hang past env.tool_timeout_s, a result that is not JSON, a huge
result) becomes a `ToolResult` with its error set or its content cut, never an exception, so the
episode goes on and the model sees what went wrong. Bad configuration (an entry that names nothing,
a function the chat template cannot describe, a server that does not start) is a UsageError, found
before any stage by `check_tools`.

MCP servers: each ToolBox runs one asyncio event loop in a daemon thread, which holds every server's
stdio connection (the SDK is async); calls from any thread are submitted to it. A server is started
when the box is built and stays up until `close()` (an env worker keeps its box, so its servers, for
all its episodes: see `toolbox_for`). It is stopped as the SDK does: its stdin is closed, then after
a grace period its process group is terminated, then killed. When the process holding the box dies
without closing it (SIGKILL, the out-of-memory killer), the server's stdin reaches EOF, on which stdio
servers exit; one busy in a call that never returns would not, so on Linux each server is also
started with a parent-death signal (PR_SET_PDEATHSIG: SIGKILL), which the kernel sends it when the
thread that started it (the box's event loop) ends. Processes a server starts itself are its own to
stop. With env.sandbox (ToolsSpec.servers_in_bwrap) each server runs in bubblewrap (envs/sandbox.py),
seeing the folder it starts in read-only and only its own env entries.

A server whose process dies (a crash, the out-of-memory killer) is noticed by the call that finds its
connection closed: that call raises ToolServerLost, an env failure (the episode fails rather than being
trained on with its tools answering "Connection closed"), and the server is started again, with a warning
on stderr giving its exit code; calls meanwhile wait for it. After _MAX_RESTARTS restarts it is given up
on, and its calls fail the same way.

A Python function that hangs cannot be stopped from another thread: past the time-out its call is
reported as an error and its thread is left running (a daemon; the process exits all the same). Code
that may hang for good belongs in `python_exec` or an MCP server, which run in processes.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import importlib
import inspect
import json
import os
import shlex
import shutil
import threading
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from rlcli.envs.protocol import EnvFailure, run_in_thread
from rlcli.envs.python_exec import python_exec_tool
from rlcli.envs.sandbox import BASE_ENV, Sandbox, hidden_runs, sandboxed
from rlcli.envs.subprocesses import die_with_parent
from rlcli.errors import UsageError
from rlcli.usercode import import_file

if TYPE_CHECKING:
    from mcp import ClientSession

_T = TypeVar("_T")
# The built-in tools, each made for a ToolsSpec (python_exec: in bubblewrap or not).
BUILTIN_TOOLS: dict[str, Callable[[ToolsSpec], Callable[..., Any]]] = {
    "python_exec": lambda spec: python_exec_tool(spec.code_in_bwrap)
}
# Seconds to wait, past a call's own limit, for the event loop to report that it cancelled the call;
# only a loop stuck in a server's synchronous code would run this out.
_LOOP_GRACE_S = 5.0
# Seconds for closing a server: the SDK's bounded shutdown (close stdin, 2 s, SIGTERM, 2 s, SIGKILL,
# 2 s) with room to spare.
_CLOSE_WAIT_S = 15.0
# Lines of a server's stderr kept, to say why it did not start or why it died.
_STDERR_TAIL_LINES = 20
# How many times a server whose process dies is started again, over a box's life, before its calls fail
# for good: enough for a rare crash, few enough that a server crashing on every call stops being restarted.
_MAX_RESTARTS = 3


@dataclass(frozen=True)
class McpServerSpec:
    command: tuple[str, ...]  # argv of a stdio MCP server, e.g. ("python", "server.py")
    env: tuple[tuple[str, str], ...] = ()  # extra environment variables for it
    cwd: str | None = None  # relative to ToolsSpec.root; None: the root itself


@dataclass(frozen=True)
class ToolsSpec:
    """What tools an env's episodes get; picklable, as it travels to env worker processes."""

    functions: tuple[
        str, ...
    ] = ()  # env.tools entries: "python_exec", "package.module:function", "path/file.py:function"
    mcp_servers: tuple[McpServerSpec, ...] = ()
    root: str = "."  # where relative file.py paths and relative cwd resolve
    timeout_s: float = 30.0  # env.tool_timeout_s: a call past it is cancelled and reported
    max_result_chars: int = 4000  # a result longer than this is cut, saying how much was cut
    # env.code_sandbox and env.sandbox, each made a yes or no by sandbox.use_bwrap in the main process:
    code_in_bwrap: bool = False  # python_exec's code runs in bubblewrap
    servers_in_bwrap: bool = False  # the MCP servers run in bubblewrap


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str | None = None


@dataclass
class ToolResult:
    """One recorded call."""

    name: str
    arguments: dict[str, Any]
    content: str  # what goes back to the model (the error text when error is set)
    error: str | None  # None on success; a short sentence otherwise
    latency_s: float
    truncated_chars: int = 0  # characters cut from the result


class ToolError(Exception):
    """A call failed through the tool's fault; the message goes back to the model."""


class ToolServerLost(EnvFailure):
    """An MCP server's process is gone under a call: the tool box's failure, not the model's. It ends the
    episode as an env failure (kept out of training and of eval's success rate) instead of going back to
    the model, whose episode would otherwise be stored `ok` with every call answered "Connection closed"."""


class _Tool(Protocol):
    name: str
    spec: dict[str, Any]

    def call(self, arguments: dict[str, Any], timeout_s: float) -> Any: ...


def function_spec(name: str, description: str, parameters: dict[str, Any]) -> dict[str, Any]:
    """A tool as chat templates take it, in one form whatever its source: a function's (from
    get_json_schema) and an MCP server's (from its input schema) render the same prompt for the same
    tool. The parameters' keys in one order (the SDK reorders them in transit), and no return type
    (an MCP tool does not declare one the same way, and the model needs only the arguments)."""
    first = [key for key in ("type", "properties", "required") if key in parameters]
    ordered = {key: parameters[key] for key in [*first, *(k for k in parameters if k not in first)]}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": ordered}}


class FunctionTool:
    """A Python callable as a tool, described to the model from its type hints and docstring."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        from transformers.utils import get_json_schema

        try:
            described = get_json_schema(fn)["function"]
        except Exception as exc:  # transformers' TypeHintParsingException, DocstringParsingException
            raise UsageError(
                f"Tool function {_qualname(fn)} cannot be described to the model ({exc}): expected a type "
                "hint on every argument and a Google-style docstring with an Args: section."
            ) from None
        self.spec = function_spec(described["name"], described.get("description", ""), described["parameters"])
        self.name: str = described["name"]
        self.fn = fn

    def call(self, arguments: dict[str, Any], timeout_s: float) -> Any:
        """The function's return value; ToolError for bad arguments, a raise, or a call past timeout_s."""
        try:
            inspect.signature(self.fn).bind(**arguments)
        except TypeError as exc:
            raise ToolError(f"Bad arguments for {self.name}: {exc}.") from None
        status, value = run_in_thread(self.fn, timeout_s, **arguments)
        if status == "running":
            raise ToolError(f"{self.name} did not return within {timeout_s:g} s (env.tool_timeout_s).")
        if status == "error":  # the tool's own failure, reported to the model
            raise ToolError(f"{self.name} raised {type(value).__name__}: {value}")
        return value


class ToolBox:
    """The tools of one ToolsSpec (and an env's own callables), ready to call; close() stops its MCP servers."""

    def __init__(self, spec: ToolsSpec, extra: Sequence[Callable[..., Any]] = ()) -> None:
        self.spec = spec
        self._tools: dict[str, _Tool] = {}
        self._sources: dict[str, str] = {}
        self._loop: _EventLoop | None = None
        self._servers: list[_McpServer] = []
        self._closed = False
        try:
            for entry in spec.functions:
                self._add(FunctionTool(_resolve_function(entry, spec)), f"env.tools entry {entry!r}")
            for fn in extra:
                self._add(FunctionTool(fn), f"the env's own tool {_qualname(fn)}")
            if spec.mcp_servers:
                self._loop = _EventLoop()
                for server_spec in spec.mcp_servers:  # started together here, waited for in order below
                    self._servers.append(_McpServer(server_spec, spec, self._loop))
                for server in self._servers:
                    for tool in server.wait_ready():
                        self._add(tool, f"MCP server `{server.label}`")
        except BaseException:
            self.close()
            raise

    def _add(self, tool: _Tool, source: str) -> None:
        refuse_clashing_names(self._sources, {tool.name: source})
        self._tools[tool.name] = tool
        self._sources[tool.name] = source

    def specs(self) -> list[dict[str, Any]]:
        """The chat-template tool specs: env.tools in their order, the env's own, then each server's as it lists them."""
        return [tool.spec for tool in self._tools.values()]

    def names(self) -> list[str]:
        return list(self._tools)

    def sources(self) -> dict[str, str]:
        """Each tool's name, and where it comes from (an env.tools entry, the env's own, an MCP server)."""
        return dict(self._sources)

    def call(self, call: ToolCall) -> ToolResult:
        """Run one call; a tool's fault is the result's error, never an exception, but an MCP server whose
        process is gone raises ToolServerLost (the server is started again for later calls)."""
        start = time.monotonic()
        tool = self._tools.get(call.name)
        if self._closed:
            error = f"The tools are closed; {call.name} was not called."
        elif tool is None:
            error = f"Unknown tool {call.name!r}: the tools are {', '.join(self._tools) or 'none'}."
        elif not isinstance(call.arguments, dict):
            error = f"Arguments for {call.name} must be a JSON object, got {type(call.arguments).__name__}."
        else:
            return self._run(tool, call, start)
        return self._result(call, error, error, start)

    def _run(self, tool: _Tool, call: ToolCall, start: float) -> ToolResult:
        try:
            value = tool.call(call.arguments, self.spec.timeout_s)
        except ToolError as exc:
            return self._result(call, str(exc), _first_line(str(exc)), start)
        except ToolServerLost:
            raise
        except Exception as exc:  # past the tool's own code (the event loop, a pipe): still the call's failure
            error = f"{call.name} failed: {type(exc).__name__}: {_first_line(str(exc))}"
            return self._result(call, error, error, start)
        try:
            content = value if isinstance(value, str) else json.dumps(value, default=str)
        except Exception as exc:  # a circular structure, a dict key that is not a string, too deep
            error = f"{call.name} returned a value that cannot be sent as JSON: {type(exc).__name__}: {exc}."
            return self._result(call, error, error, start)
        return self._result(call, content, None, start)

    def _result(self, call: ToolCall, content: str, error: str | None, start: float) -> ToolResult:
        cut = max(0, len(content) - self.spec.max_result_chars)
        if cut:
            content = content[: self.spec.max_result_chars] + f"\n[... {cut} more characters cut]"
        arguments = call.arguments if isinstance(call.arguments, dict) else {}
        return ToolResult(call.name, arguments, content, error, time.monotonic() - start, cut)

    def close(self) -> None:
        """Stop the MCP servers (waiting for them) and the event loop; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        for server in self._servers:  # all at once: each may take the SDK's grace periods to stop
            server.request_stop()
        for server in self._servers:
            server.wait_stopped()
        if self._loop is not None:
            self._loop.stop()


def toolbox_for(spec: ToolsSpec) -> ToolBox:
    """This process's ToolBox for spec, built on first use and kept, so an env worker starts its MCP servers
    once for all its episodes; closed at exit or by close_toolboxes()."""
    with _registry_lock:
        box = _registry.get(spec)
        if box is None:
            if not _registry:
                atexit.register(close_toolboxes)  # registering twice would only close twice, which is harmless
            box = _registry[spec] = ToolBox(spec)
        return box


def close_toolboxes() -> None:
    """Close every box toolbox_for built in this process."""
    with _registry_lock:
        boxes = list(_registry.values())
        _registry.clear()
    for box in boxes:
        box.close()


def check_tools(spec: ToolsSpec) -> dict[str, str]:
    """Preflight, before any stage: build the tools (UsageError for bad ones), stop them, and return each
    one's name and where it comes from."""
    box = ToolBox(spec)
    try:
        return box.sources()
    finally:
        box.close()


def refuse_clashing_names(*named: Mapping[str, str]) -> None:
    """A UsageError for a tool name given twice among these (each: tool name -> where it comes from): one
    tool would silently answer the other's calls."""
    seen: dict[str, str] = {}
    for tools in named:
        for name, source in tools.items():
            if name in seen:
                raise UsageError(
                    f"Two tools are named {name!r}: {seen[name]} and {source}; "
                    "expected one tool per name (rename or drop one)."
                )
            seen[name] = source


_registry: dict[ToolsSpec, ToolBox] = {}
_registry_lock = threading.Lock()


def _forget_parents_boxes() -> None:
    """In a forked child, the parent's boxes are unusable (their event loop thread was not copied), and
    their servers are the parent's to stop: start afresh."""
    global _registry_lock
    _registry.clear()
    _registry_lock = threading.Lock()  # a lock another thread held at the fork would stay held


os.register_at_fork(after_in_child=_forget_parents_boxes)


def _resolve_function(entry: str, spec: ToolsSpec) -> Callable[..., Any]:
    if entry in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[entry](spec)
    root = Path(spec.root)
    target, sep, attr = entry.rpartition(":")
    if not sep or not target or not attr:
        builtins = ", ".join(BUILTIN_TOOLS)
        raise UsageError(
            f"Unknown env.tools entry {entry!r}: expected a built-in ({builtins}), package.module:function, "
            "or path/file.py:function."
        )
    if target.endswith(".py"):
        path = Path(target)
        module = import_file(path if path.is_absolute() else root / path)
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise UsageError(f"env.tools entry {entry!r}: cannot import {target} ({exc}).") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise UsageError(f"env.tools entry {entry!r}: {target} has no function {attr!r}.")
    return fn


def _in_sandbox(command: Sequence[str], env: Mapping[str, str], cwd: Path) -> list[str]:
    """An MCP server's argv in bubblewrap: it sees the folder it starts in read-only (but for rlcli's runs
    folder) and rlcli's own package, so that `python my_server.py` and `python -m rlcli.envs.search_server`
    both start."""
    shown = (str(cwd.resolve()), str(Path(__file__).resolve().parent.parent))  # the folder, and rlcli/
    sandbox = Sandbox(tuple(env.items()), cwd=shown[0], readable=shown, hidden=hidden_runs(shown))
    return sandboxed(command, sandbox)


def _qualname(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _first_line(text: str, limit: int = 300) -> str:
    line = text.strip().splitlines()[0] if text.strip() else text
    return line if len(line) <= limit else line[:limit] + "..."


class _EventLoop:
    """An asyncio event loop in a daemon thread, for the MCP SDK; submit() works from any thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="rlcli-mcp", daemon=True)
        self.thread.start()

    def submit(self, coroutine: Coroutine[Any, Any, _T]) -> concurrent.futures.Future[_T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(_CLOSE_WAIT_S)
        if not self.thread.is_alive():
            self.loop.close()


@dataclass
class _Connection:
    """One run of a server's process: its session, and the event that ends the run (stop(), or a call that
    found the process gone)."""

    session: ClientSession
    ended: asyncio.Event


class _McpServer:
    """One stdio MCP server: its process and session live in a task on the box's event loop. A server whose
    process dies is noticed by the call that finds its connection closed, and started again (see _serve)."""

    def __init__(self, spec: McpServerSpec, tools: ToolsSpec, loop: _EventLoop) -> None:
        if not spec.command:
            raise UsageError("env.mcp_servers has an empty command: expected the argv of a stdio MCP server.")
        self.label = shlex.join(spec.command)
        self.timeout_s = tools.timeout_s
        self.loop = loop
        self.cwd = Path(tools.root) / (spec.cwd or ".")
        if not self.cwd.is_dir():
            raise UsageError(f"MCP server `{self.label}`: its cwd {self.cwd} is not a folder.")
        # Unsandboxed, the parent's whole environment: the SDK would otherwise pass only HOME, PATH, SHELL,
        # TERM, USER and LOGNAME, and a server may need a virtualenv's variables, a proxy, or an API key of
        # the user's. In bubblewrap, none of rlcli's variables: only its own env entries.
        self.env = {**(BASE_ENV if tools.servers_in_bwrap else os.environ), **dict(spec.env)}
        program = spec.command[0]
        found = (
            shutil.which(str(self.cwd / program))
            if "/" in program
            else shutil.which(program, path=self.env.get("PATH"))
        )
        if found is None:
            raise UsageError(
                f"MCP server `{self.label}`: command {program!r} not found (expected a program on PATH or a path)."
            )
        command = _in_sandbox(spec.command, self.env, self.cwd) if tools.servers_in_bwrap else list(spec.command)
        self.argv = die_with_parent(command)  # on Linux, killed when the loop's thread ends
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self.stderr_reader: threading.Thread | None = None
        self.ready: concurrent.futures.Future[list[_McpTool]] = concurrent.futures.Future()  # the first start's
        # The running connection; while the server is started again, a pending future that calls wait on.
        # Replaced and resolved on the loop's thread only (other threads only read it), like the fields below.
        self.connection: concurrent.futures.Future[_Connection] = concurrent.futures.Future()
        self.current: _Connection | None = None
        self.stopping = False
        self.restarts = 0
        self.task = loop.submit(self._serve())

    async def _serve(self) -> None:
        """The server's life: started, its tools listed (reported through self.ready), its connection held
        until stop(). One whose process dies after its first start is started again, at most _MAX_RESTARTS
        times, each said on stderr with its exit code; after that its calls fail."""
        try:
            while True:
                failed: Exception | None = None
                try:
                    exit_code = await self._run_once()
                except Exception as exc:
                    if not self.ready.done():  # the first start: wait_ready says why
                        self.ready.set_exception(exc)
                        return
                    exit_code, failed = None, exc
                if self.stopping:
                    return
                if self.connection.done():  # the run ended without a call noticing: later calls wait
                    self.connection = concurrent.futures.Future()
                if self.stderr_reader is not None:  # its last words (a traceback) may still be in the pipe
                    await asyncio.to_thread(self.stderr_reader.join, _LOOP_GRACE_S)
                how = _how_it_ended(exit_code, failed)
                said = f"; its stderr ends: {self.stderr_tail[-1]!r}" if self.stderr_tail else ""
                if self.restarts == _MAX_RESTARTS:
                    _warn(
                        f"MCP server `{self.label}` {how}{said}; not started again (all {_MAX_RESTARTS} restarts used)."
                    )
                    self.connection.set_exception(
                        ToolServerLost(f"MCP server `{self.label}` {how} and is not started again")
                    )
                    return
                self.restarts += 1
                _warn(
                    f"MCP server `{self.label}` {how}{said}; starting it again "
                    f"(restart {self.restarts} of {_MAX_RESTARTS})."
                )
        except BaseException as exc:  # cancelled with the loop: reported to a first start still waited for
            if not self.ready.done():
                self.ready.set_exception(exc)
            raise
        finally:
            if not self.connection.done():  # stopped while (re)starting: calls waiting for it end now
                self.connection.set_exception(ToolServerLost(f"MCP server `{self.label}` is stopped"))

    async def _run_once(self) -> int | None:
        """One run of the server's process: started, initialized, its tools listed, its connection published
        and held until stop() or a call that finds the process gone. Its exit code (None: not known)."""
        import anyio
        from mcp import ClientSession, StdioServerParameters
        from mcp.client.stdio import stdio_client

        params = StdioServerParameters(command=self.argv[0], args=self.argv[1:], env=self.env, cwd=self.cwd)
        read_end, write_end = os.pipe()
        self.stderr_tail.clear()
        self.stderr_reader = threading.Thread(
            target=self._read_stderr, args=(read_end,), name="rlcli-mcp-stderr", daemon=True
        )
        self.stderr_reader.start()
        process = None
        with os.fdopen(write_end, "w") as errlog:
            transport = stdio_client(params, errlog=errlog)
            async with transport as (read, write), ClientSession(read, write) as session:
                errlog.close()  # the server holds its own copy: EOF reaches the reader when it exits
                process = _process_of(transport)
                with anyio.fail_after(self.timeout_s):
                    await session.initialize()
                    tools = []
                    cursor: str | None = None
                    while True:
                        listing = await session.list_tools(params=_page(cursor))
                        tools += [_McpTool(self, tool) for tool in listing.tools]
                        cursor = listing.next_cursor
                        if cursor is None:
                            break
                if not self.ready.done():
                    self.ready.set_result(tools)
                self.current = _Connection(session, asyncio.Event())
                self.connection.set_result(self.current)
                try:
                    if not self.stopping:
                        await self.current.ended.wait()
                finally:
                    self.current = None
        return None if process is None else process.returncode

    def _read_stderr(self, fd: int) -> None:
        with open(fd, encoding="utf-8", errors="replace") as stream:
            for line in stream:
                if line.strip():
                    self.stderr_tail.append(line.rstrip())

    def wait_ready(self) -> list[_McpTool]:
        """The server's tools, or a UsageError saying why it did not start."""
        try:
            return self.ready.result(self.timeout_s + _LOOP_GRACE_S)
        except (Exception, asyncio.CancelledError) as exc:
            error = _leaf(exc)
            if isinstance(error, (TimeoutError, concurrent.futures.TimeoutError)):
                why = f"did not answer initialize and tools/list within {self.timeout_s:g} s (env.tool_timeout_s)"
            else:
                why = f"failed to start ({type(error).__name__}: {_first_line(str(error)) or 'no message'})"
            self.request_stop()
            self.wait_stopped()
            if self.stderr_reader is not None:  # its last words (a traceback) may still be in the pipe
                self.stderr_reader.join(_CLOSE_WAIT_S)
            said = f"; its stderr ends: {self.stderr_tail[-1]!r}" if self.stderr_tail else ""
            raise UsageError(f"MCP server `{self.label}` {why}{said}.") from None

    def call(self, name: str, arguments: dict[str, Any], timeout_s: float) -> str:
        """The tool's text. ToolError for the tool's own failure or time-out (the model reads it);
        ToolServerLost when the server's process is gone (it exited under the call, or was not started again)."""
        deadline = time.monotonic() + timeout_s
        try:
            live = self.connection.result(timeout_s)  # waits while the server is started again
        except ToolServerLost as exc:
            raise ToolServerLost(f"{exc}; {name} was not called") from None
        except (TimeoutError, concurrent.futures.TimeoutError):
            raise ToolServerLost(
                f"MCP server `{self.label}` did not start again within {timeout_s:g} s (env.tool_timeout_s); "
                f"{name} was not called"
            ) from None
        future = self.loop.submit(self._call(live, name, arguments, deadline, timeout_s))
        try:
            return future.result(max(deadline - time.monotonic(), 0.0) + _LOOP_GRACE_S)
        except (TimeoutError, concurrent.futures.TimeoutError):
            future.cancel()
            raise ToolError(
                f"{name} did not return within {timeout_s:g} s (env.tool_timeout_s); it was cancelled."
            ) from None

    async def _call(
        self, live: _Connection, name: str, arguments: dict[str, Any], deadline: float, timeout_s: float
    ) -> str:
        import anyio
        import mcp_types

        try:
            with anyio.fail_after(max(deadline - time.monotonic(), 0.0)):  # the SDK tells the server it is cancelled
                result = await live.session.call_tool(name, arguments)
        except TimeoutError:
            raise ToolError(
                f"{name} did not return within {timeout_s:g} s (env.tool_timeout_s); it was cancelled."
            ) from None
        except Exception as exc:  # an error reply, or the connection closed under the call
            if await self._gone(live, exc):
                if self.current is live:  # the first call to find it: the run ends, later calls wait for the next
                    self.connection = concurrent.futures.Future()
                    live.ended.set()
                raise ToolServerLost(
                    f"MCP server `{self.label}` closed its connection during the call to {name} (its process ended)"
                ) from None
            raise ToolError(f"{name} failed on MCP server `{self.label}`: {type(exc).__name__}: {exc}") from None
        parts = [
            part.text if isinstance(part, mcp_types.TextContent) else f"[{part.type} content]"
            for part in result.content
        ]
        text = "\n".join(parts)
        if result.is_error:
            raise ToolError(text or f"{name} failed on MCP server `{self.label}` without a message.")
        return text

    async def _gone(self, live: _Connection, exc: Exception) -> bool:
        """Whether exc means the connection is closed: the SDK's code for that, which a live server may use
        for errors of its own too, so confirmed by a ping, which a closed connection refuses at once."""
        import anyio
        from mcp import MCPError
        from mcp_types import CONNECTION_CLOSED

        if not (isinstance(exc, MCPError) and exc.code == CONNECTION_CLOSED):
            return False
        try:
            with anyio.fail_after(self.timeout_s):
                await live.session.send_ping()
        except MCPError as refused:
            return refused.code == CONNECTION_CLOSED
        except Exception:  # no answer in time: alive, if busy
            return False
        return False

    def request_stop(self) -> None:
        """Close the connection; the SDK then stops the process (stdin closed, then SIGTERM, then SIGKILL)."""
        self.loop.loop.call_soon_threadsafe(self._stop)

    def _stop(self) -> None:
        self.stopping = True
        if self.current is not None:
            self.current.ended.set()

    def wait_stopped(self) -> None:
        with contextlib.suppress(Exception):  # a start that failed has reported its error already
            self.task.result(_CLOSE_WAIT_S)


class _McpTool:
    def __init__(self, server: _McpServer, tool: Any) -> None:
        self.server = server
        self.name: str = tool.name
        self.spec = function_spec(tool.name, tool.description or "", tool.input_schema)

    def call(self, arguments: dict[str, Any], timeout_s: float) -> str:
        return self.server.call(self.name, arguments, timeout_s)


def _page(cursor: str | None) -> Any:
    import mcp_types

    return None if cursor is None else mcp_types.PaginatedRequestParams(cursor=cursor)


def _process_of(transport: object) -> Any:
    """The server's process (for its exit code), which the SDK's stdio_client keeps to itself: read from
    its context manager's suspended generator; None if a later SDK holds it elsewhere."""
    frame = getattr(getattr(transport, "gen", None), "ag_frame", None)
    return None if frame is None else frame.f_locals.get("process")


def _how_it_ended(exit_code: int | None, failed: Exception | None) -> str:
    if failed is not None:
        return f"failed to start again ({type(failed).__name__}: {_first_line(str(failed)) or 'no message'})"
    if exit_code is None:
        return "closed its connection (exit code not known)"
    if exit_code < 0:
        return f"was killed by signal {-exit_code}"
    return f"exited with code {exit_code}"


def _warn(message: str) -> None:
    from rlcli.console import err_console

    err_console.print(f"warning: {message}", markup=False)


def _leaf(exc: BaseException) -> BaseException:
    """The first exception inside (nested) exception groups, which anyio's task groups raise."""
    while isinstance(getattr(exc, "exceptions", None), (list, tuple)) and exc.exceptions:  # type: ignore[attr-defined]
        exc = exc.exceptions[0]  # type: ignore[attr-defined]
    return exc
