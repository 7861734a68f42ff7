"""The tool layer (rlcli.envs.tools): Python functions, python_exec, and real stdio MCP server processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rlcli.envs import python_exec as python_exec_module
from rlcli.envs import tools as tools_module
from rlcli.envs.protocol import EnvFailure
from rlcli.envs.python_exec import python_exec
from rlcli.envs.tools import (
    McpServerSpec,
    ToolBox,
    ToolCall,
    ToolServerLost,
    ToolsSpec,
    check_tools,
    close_toolboxes,
    toolbox_for,
)
from rlcli.errors import UsageError

SERVER = '''
import asyncio
import os
import time

from mcp.server.mcpserver import MCPServer

server = MCPServer("test-tools")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@server.tool()
def getenv(name: str) -> str:
    """An environment variable of the server."""
    return os.environ.get(name, "(unset)")


@server.tool()
def pid() -> int:
    """This server's process id."""
    return os.getpid()


@server.tool()
async def sleep_forever() -> str:
    """Never returns (until cancelled)."""
    await asyncio.sleep(3600)
    return "woke up"


@server.tool()
def block_forever() -> str:
    """Blocks a thread for an hour: no cancellation reaches it, and the server does not exit on EOF meanwhile."""
    time.sleep(3600)
    return "woke up"


@server.tool()
def fail() -> str:
    """Always raises."""
    raise RuntimeError("out of cheese")


if __name__ == "__main__":
    server.run()
'''

# Long enough for a server to start on a loaded machine, short enough for the time-out test.
TIMEOUT_S = 3.0


def one_sentence(message: str) -> bool:
    return message.endswith(".") and "\n" not in message


@pytest.fixture
def server_file(tmp_path: Path) -> Path:
    path = tmp_path / "server.py"
    path.write_text(SERVER)
    return path


def test_mcp_server_tools_are_listed_and_called(server_file, monkeypatch):
    monkeypatch.setenv("RLCLI_TEST_PARENT_VAR", "inherited")
    server = McpServerSpec((sys.executable, str(server_file)), env=(("RLCLI_TEST_SPEC_VAR", "given"),))
    box = ToolBox(ToolsSpec(mcp_servers=(server,), timeout_s=TIMEOUT_S))
    try:
        assert box.names() == ["add", "getenv", "pid", "sleep_forever", "block_forever", "fail"]
        add_spec = box.specs()[0]
        assert add_spec["type"] == "function"
        assert add_spec["function"]["name"] == "add"
        assert add_spec["function"]["description"] == "Add two integers."
        assert set(add_spec["function"]["parameters"]["properties"]) == {"a", "b"}

        results = [box.call(ToolCall("add", {"a": i, "b": 10})) for i in range(5)]
        assert [(r.content, r.error) for r in results] == [(str(i + 10), None) for i in range(5)]

        failed = box.call(ToolCall("fail", {}))
        assert failed.error and "fail" in failed.error and failed.content

        hung = box.call(ToolCall("sleep_forever", {}))
        assert (
            hung.error == f"sleep_forever did not return within {TIMEOUT_S:g} s (env.tool_timeout_s); it was cancelled."
        )
        assert hung.latency_s >= TIMEOUT_S * 0.9

        # Still usable after the time-out, from other threads too.
        answers: list[str] = []
        threads = [
            threading.Thread(target=lambda i=i: answers.append(box.call(ToolCall("add", {"a": i, "b": i})).content))
            for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(answers) == ["0", "2", "4", "6"]

        bad = box.call(ToolCall("add", {"a": "x"}))
        assert bad.error and bad.content
        unknown = box.call(ToolCall("nope", {"q": 1}))
        assert (
            unknown.error == "Unknown tool 'nope': the tools are add, getenv, pid, sleep_forever, block_forever, fail."
        )
        # The server gets this process's environment (not only the SDK's few variables), plus its own.
        for name, value in [("RLCLI_TEST_PARENT_VAR", "inherited"), ("RLCLI_TEST_SPEC_VAR", "given")]:
            assert box.call(ToolCall("getenv", {"name": name})).content == value
        assert unknown.arguments == {"q": 1}
    finally:
        box.close()
    box.close()  # idempotent
    assert box.call(ToolCall("add", {"a": 1, "b": 2})).error == "The tools are closed; add was not called."


CRASHING_SERVER = """
import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("crashing")


@server.tool()
def pid() -> int:
    \"\"\"This server's process id.\"\"\"
    return os.getpid()


@server.tool()
def crash() -> str:
    \"\"\"Ends the server's process at once, as a crash does.\"\"\"
    print("about to crash", file=sys.stderr, flush=True)
    os._exit(3)


if __name__ == "__main__":
    server.run()
"""


def test_a_server_that_dies_is_started_again_and_the_call_it_lost_is_an_env_failure(tmp_path, monkeypatch, capfd):
    monkeypatch.setattr(tools_module, "_MAX_RESTARTS", 1)  # one restart, then given up on
    path = tmp_path / "crashing.py"
    path.write_text(CRASHING_SERVER)
    command = (sys.executable, str(path))
    label = " ".join(command)
    # A call waits up to the time-out for the restart: generous, for a loaded machine (none is tested here).
    box = ToolBox(ToolsSpec(mcp_servers=(McpServerSpec(command),), timeout_s=60.0))
    try:
        first = int(box.call(ToolCall("pid", {})).content)
        # The call the crash lost is the tool box's failure (an env failure), not a result the model reads.
        with pytest.raises(ToolServerLost, match="closed its connection during the call to crash") as lost:
            box.call(ToolCall("crash", {}))
        assert isinstance(lost.value, EnvFailure)
        again = box.call(ToolCall("pid", {}))  # waits for the restart
        assert again.error is None and int(again.content) != first
        assert gone(first)
        warned = capfd.readouterr().err
        assert (
            f"warning: MCP server `{label}` exited with code 3; its stderr ends: 'about to crash'; "
            "starting it again (restart 1 of 1)." in warned
        )
        # Past its restarts, each call fails the same way, without waiting.
        with pytest.raises(ToolServerLost):
            box.call(ToolCall("crash", {}))
        with pytest.raises(ToolServerLost, match="exited with code 3 and is not started again; pid was not called"):
            box.call(ToolCall("pid", {}))
        assert "not started again (all 1 restarts used)." in capfd.readouterr().err
    finally:
        box.close()


@pytest.mark.parametrize(
    ("command", "expected"),
    [
        (
            ("rlcli-no-such-server-xyz",),
            "MCP server `rlcli-no-such-server-xyz`: command 'rlcli-no-such-server-xyz' not found",
        ),
        # The end of its stderr says why it stopped.
        ((sys.executable, "-c", "raise SystemExit('missing config file')"), "its stderr ends: 'missing config file'"),
        ((sys.executable, "-c", "import sys; sys.stdin.read()"), "did not answer initialize and tools/list within 1 s"),
    ],
    ids=["not-found", "exits-at-once", "never-answers"],
)
def test_a_server_that_does_not_start_is_a_usage_error(command, expected):
    with pytest.raises(UsageError) as raised:
        check_tools(ToolsSpec(mcp_servers=(McpServerSpec(command),), timeout_s=1.0))
    message = str(raised.value)
    assert expected in message
    assert one_sentence(message), message


def test_two_tools_of_one_name_are_a_usage_error(server_file, tmp_path):
    (tmp_path / "mine.py").write_text(
        textwrap.dedent('''
        def add(a: int, b: int) -> int:
            """Add.

            Args:
                a: One.
                b: Two.
            """
            return a + b
        ''')
    )
    spec = ToolsSpec(
        functions=("mine.py:add",),
        mcp_servers=(McpServerSpec((sys.executable, "server.py")),),  # relative to root, which is its cwd
        root=str(tmp_path),
        timeout_s=TIMEOUT_S,
    )
    with pytest.raises(UsageError) as raised:
        ToolBox(spec)
    message = str(raised.value)
    assert message.startswith("Two tools are named 'add': env.tools entry 'mine.py:add' and MCP server `")
    assert one_sentence(message)

    with pytest.raises(UsageError, match="Two tools are named 'python_exec'"):
        ToolBox(ToolsSpec(functions=("python_exec",)), extra=[python_exec])


def test_function_entries_from_files_and_modules(tmp_path):
    folder = tmp_path / "tools"
    folder.mkdir()
    (folder / "lookup.py").write_text(
        textwrap.dedent('''
        import threading


        class Opaque:
            def __str__(self) -> str:
                return "<opaque>"


        def lookup(key: str, default: int = 0) -> dict:
            """Look a key up.

            Args:
                key: The key.
                default: What a missing key gives.
            """
            return {"key": key, "value": {"a": 1}.get(key, default)}


        def huge() -> str:
            """Ten megabytes of text."""
            return "x" * 10_000_000


        def opaque() -> object:
            """An object json cannot encode."""
            return {"thing": Opaque(), "numbers": {1, 2}}


        def circular() -> list:
            """A list that holds itself."""
            loop = []
            loop.append(loop)
            return loop


        def crash(reason: str) -> str:
            """Raise.

            Args:
                reason: Why.
            """
            raise ValueError(reason)


        def hang() -> str:
            """Wait forever."""
            threading.Event().wait()
            return "never"
        ''')
    )
    names = ["lookup", "huge", "opaque", "circular", "crash", "hang"]
    spec = ToolsSpec(
        functions=tuple(f"tools/lookup.py:{name}" for name in names) + ("rlcli.envs.python_exec:python_exec",),
        root=str(tmp_path),
        timeout_s=0.5,
        max_result_chars=100,
    )
    box = ToolBox(spec)
    try:
        assert box.names() == names + ["python_exec"]
        assert box.specs()[0]["function"]["parameters"]["required"] == ["key"]

        assert box.call(ToolCall("lookup", {"key": "a"})).content == '{"key": "a", "value": 1}'
        huge = box.call(ToolCall("huge", {}))
        assert huge.error is None
        assert huge.truncated_chars == 10_000_000 - 100
        assert huge.content == "x" * 100 + f"\n[... {10_000_000 - 100} more characters cut]"

        opaque = box.call(ToolCall("opaque", {}))
        assert (opaque.content, opaque.error) == ('{"thing": "<opaque>", "numbers": "{1, 2}"}', None)
        circular = box.call(ToolCall("circular", {}))
        assert (
            circular.error
            == "circular returned a value that cannot be sent as JSON: ValueError: Circular reference detected."
        )

        crash = box.call(ToolCall("crash", {"reason": "no"}))
        assert crash.error == "crash raised ValueError: no" == crash.content
        bad = box.call(ToolCall("lookup", {"nope": 1}))
        assert bad.error and bad.error.startswith("Bad arguments for lookup:")
        not_a_dict = box.call(ToolCall("lookup", "a"))  # type: ignore[arg-type]
        assert not_a_dict.error == "Arguments for lookup must be a JSON object, got str."

        hang = box.call(ToolCall("hang", {}))
        assert hang.error == "hang did not return within 0.5 s (env.tool_timeout_s)."
        assert box.call(ToolCall("lookup", {"key": "b", "default": 7})).content == '{"key": "b", "value": 7}'
    finally:
        box.close()


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        (
            "calculator",
            "Unknown env.tools entry 'calculator': expected a built-in (python_exec), package.module:function, or path/file.py:function.",
        ),
        (
            "rlcli_no_such_module_xyz:f",
            "env.tools entry 'rlcli_no_such_module_xyz:f': cannot import rlcli_no_such_module_xyz",
        ),
        (
            "rlcli.envs.python_exec:nothing",
            "env.tools entry 'rlcli.envs.python_exec:nothing': rlcli.envs.python_exec has no function 'nothing'.",
        ),
        ("missing.py:f", "missing.py does not exist."),
    ],
)
def test_an_entry_that_names_nothing_is_a_usage_error(entry, expected, tmp_path):
    with pytest.raises(UsageError) as raised:
        check_tools(ToolsSpec(functions=(entry,), root=str(tmp_path)))
    assert expected in str(raised.value)
    assert one_sentence(str(raised.value))


def test_a_function_without_type_hints_is_a_usage_error():
    def untyped(x):  # noqa: ANN001, ANN202 (the point of the test)
        """Echo.

        Args:
            x: Anything.
        """
        return x

    with pytest.raises(UsageError) as raised:
        ToolBox(ToolsSpec(), extra=[untyped])
    message = str(raised.value)
    assert message.startswith(
        "Tool function test_tools.test_a_function_without_type_hints_is_a_usage_error.<locals>.untyped"
    )
    assert "expected a type hint on every argument and a Google-style docstring with an Args: section" in message
    assert one_sentence(message)


def test_python_exec_runs_code_in_a_clean_process(monkeypatch):
    monkeypatch.setenv("SECRET_TOKEN", "hunter2")
    out = python_exec("import os, sys\nprint(6 * 7)\nprint(os.environ.get('SECRET_TOKEN'), sys.flags.isolated)")
    assert out == "42\nNone 1\n"
    assert python_exec("import sys\nprint('bad', file=sys.stderr)\nsys.exit(3)") == "bad\n\n[exit status 3]"
    assert python_exec("x = bytearray(4 << 30)").endswith("MemoryError\n\n[exit status 1]")
    # The limits its docstring tells the model are the ones it applies.
    assert f"{python_exec_module.TIME_LIMIT_S:g} seconds" in (python_exec.__doc__ or "")
    assert f"{python_exec_module.OUTPUT_LIMIT_CHARS} characters" in (python_exec.__doc__ or "")


def test_python_exec_stops_an_endless_loop(monkeypatch):
    monkeypatch.setattr(python_exec_module, "TIME_LIMIT_S", 1.0)
    out = python_exec("print('started', flush=True)\nwhile True:\n    pass")
    assert out == "started\n\n[timed out after 1 s]"


def test_toolbox_for_keeps_one_box_per_spec():
    spec = ToolsSpec(functions=("python_exec",))
    try:
        box = toolbox_for(spec)
        assert toolbox_for(ToolsSpec(functions=("python_exec",))) is box
        other = toolbox_for(ToolsSpec(functions=("python_exec",), timeout_s=5.0))
        assert other is not box
        assert box.call(ToolCall("python_exec", {"code": "print('hi')"})).content == "hi\n"
    finally:
        close_toolboxes()
    assert (
        box.call(ToolCall("python_exec", {"code": "print('hi')"})).error
        == "The tools are closed; python_exec was not called."
    )
    assert toolbox_for(spec) is not box
    close_toolboxes()


HOLDER = """
import sys, threading, time
from rlcli.envs.tools import McpServerSpec, ToolBox, ToolCall, ToolsSpec

box = ToolBox(ToolsSpec(mcp_servers=(McpServerSpec((sys.executable, sys.argv[1])),), timeout_s=600))
print(box.call(ToolCall("pid", {})).content, flush=True)
# A call in flight that the server cannot cancel: its stdin's EOF alone would not end it.
threading.Thread(target=box.call, args=(ToolCall("block_forever", {}),), daemon=True).start()
time.sleep(0.5)
print("calling", flush=True)
time.sleep(3600)
"""


def gone(pid: int) -> bool:
    """Exited: no process, or a zombie its new parent has yet to reap."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the parent-death signal is Linux's")
def test_a_server_dies_with_a_sigkilled_holder(server_file):
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(server_file)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    server_pid = None
    try:
        assert holder.stdout is not None
        server_pid = int(holder.stdout.readline())
        assert holder.stdout.readline() == "calling\n", holder.stderr.read() if holder.stderr else ""
        assert not gone(server_pid)
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
        deadline = time.monotonic() + 30  # generous: it takes milliseconds
        while not gone(server_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(server_pid)
    finally:
        holder.kill()
        holder.wait()
        if server_pid is not None and not gone(server_pid):  # a failure leaves no server behind
            os.kill(server_pid, signal.SIGKILL)
