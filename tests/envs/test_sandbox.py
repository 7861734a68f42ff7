"""The sandbox for model-written code (envs/sandbox.py, env.code_sandbox; issue 55).

Each escape is a real python_exec call through a ToolBox, as an episode makes it, once with the limits
alone (`none`), where the escape succeeds, and once in bubblewrap (`bwrap`), where it is stopped; after
each, the same box answers its next call (the episode goes on). A rollout stage plays escapes under
bwrap and finishes; `bwrap` where bubblewrap cannot run is refused before anything is written, and
`auto` says which it took. Env workers and MCP servers under env.sandbox bwrap see no more than the
code does. The bwrap cases skip, saying why, only where bubblewrap cannot run.
"""

from __future__ import annotations

import json
import os
import pwd
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from contextlib import closing
from pathlib import Path

import pytest

from helpers import REPO, run_in_process, write_env_file, write_recipe
from rlcli.envs import python_exec as python_exec_module
from rlcli.envs import sandbox
from rlcli.envs.sandbox import Sandbox, bwrap_problem, sandboxed
from rlcli.envs.subprocesses import die_with_parent
from rlcli.envs.tools import McpServerSpec, ToolBox, ToolCall, ToolsSpec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="bubblewrap and /proc are Linux's")


@pytest.fixture(params=["none", "bwrap"])
def mode(request) -> str:
    if request.param == "bwrap" and (problem := bwrap_problem()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {problem}")
    return request.param


def toolbox(mode: str, **spec) -> ToolBox:
    return ToolBox(ToolsSpec(functions=("python_exec",), code_in_bwrap=mode == "bwrap", **spec))


@pytest.fixture
def box(mode):
    box = toolbox(mode)
    yield box
    box.close()


def run_code(box: ToolBox, code: str) -> str:
    result = box.call(ToolCall("python_exec", {"code": code}))
    assert result.error is None, result.error
    return result.content


def goes_on(box: ToolBox) -> None:
    """The episode goes on after an escape: the same tool answers the next call."""
    assert run_code(box, "print(6 * 7)") == "42\n"


def marked(marker: str) -> list[int]:
    """This machine's processes whose command line holds `marker`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                command = Path(f"/proc/{entry}/cmdline").read_bytes()
            except OSError:  # it ended meanwhile
                continue
            if marker.encode() in command and int(entry) != os.getpid():
                found.append(int(entry))
    return found


def kill_marked(marker: str) -> None:
    """Kill them, until none has been seen for half a second: an escaped fork bomb may still be forking."""
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 0.5:
        for pid in marked(marker):
            quiet_since = time.monotonic()
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
        time.sleep(0.05)


def descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:  # it ended meanwhile
                continue
            children.setdefault(int(stat.rpartition(")")[2].split()[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def wait_until(check, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.fixture
def planted() -> Path:
    """A file in the user's real home folder (whatever HOME the tests set)."""
    path = Path(pwd.getpwuid(os.getuid()).pw_dir) / f".rlcli-sandbox-test-{uuid.uuid4().hex}"
    path.write_text("planted secret")
    yield path
    path.unlink()


@pytest.fixture
def host_port() -> int:
    """A port on this machine's 127.0.0.1 that answers every connection with "hello from the host"."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(120)  # a bound on the thread below

    def answer() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # closed, or timed out
                return
            with connection:
                connection.sendall(b"hello from the host")

    threading.Thread(target=answer, daemon=True).start()
    yield server.getsockname()[1]
    server.close()


# --- the escapes ----------------------------------------------------------------------------------


def test_reading_a_file_planted_in_the_home_folder(box, mode, planted):
    out = run_code(box, f"print(open({str(planted)!r}).read())")
    assert ("planted secret" in out) == (mode == "none"), out
    goes_on(box)


def test_writing_outside_the_scratch_folder(box, mode, tmp_path):
    target = tmp_path / "escaped.txt"
    out = run_code(box, f"open({str(target)!r}, 'w').write('out')\nprint('written')")
    assert target.exists() == (mode == "none"), out
    goes_on(box)


def test_connecting_to_a_port_opened_on_localhost(box, mode, host_port):
    code = (
        "import socket\n"
        "try:\n"
        f"    print(socket.create_connection(('127.0.0.1', {host_port}), timeout=5).recv(100).decode())\n"
        "except OSError as exc:\n"
        "    print('no connection:', exc)\n"
    )
    out = run_code(box, code)
    assert ("hello from the host" in out) == (mode == "none"), out
    goes_on(box)


# A program rlcli starts (an MCP or OpenEnv server, Chromium) runs under its supervisor with rlcli's
# environment. As root, it first gives up its capabilities, as every process of a user who is not root
# holds none: code without capabilities (python_exec's, as root) cannot read a process that holds some.
SERVER = """
import ctypes, os, time
if os.geteuid() == 0:
    ctypes.CDLL(None).capset((ctypes.c_uint32 * 2)(0x20080522, 0), (ctypes.c_uint32 * 6)())
print("up", flush=True)
time.sleep(120)
"""

FIND_VARIABLE = """
import os
found = os.environ.get("RLCLI_TEST_API_KEY")
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            for entry in open(f"/proc/{pid}/environ", "rb").read().split(b"\\0"):
                if entry.startswith(b"RLCLI_TEST_API_KEY="):
                    found = entry.partition(b"=")[2].decode()
        except OSError:
            continue
print("found", found)
"""


def test_reading_an_rlcli_environment_variable(box, mode, monkeypatch):
    secret = f"key-{uuid.uuid4().hex}"
    monkeypatch.setenv("RLCLI_TEST_API_KEY", secret)  # in rlcli's environment, as an API key would be
    server = subprocess.Popen(die_with_parent([sys.executable, "-c", SERVER]), stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdout.readline() == "up\n"
        out = run_code(box, FIND_VARIABLE)
    finally:
        server.kill()
        server.wait()
    assert (secret in out) == (mode == "none"), out
    goes_on(box)


def test_seeing_rlclis_processes_in_proc(box, mode):
    rlcli = os.getpid()
    command = Path(f"/proc/{rlcli}/cmdline").read_bytes()
    code = (
        "try:\n"
        f"    print('sees rlcli:', open('/proc/{rlcli}/cmdline', 'rb').read() == {command!r})\n"
        "except OSError:\n"
        "    print('sees rlcli: False')\n"
    )
    out = run_code(box, code)
    assert ("sees rlcli: True" in out) == (mode == "none"), out
    goes_on(box)


# The code kills its supervisor, which would kill what it started when the call ends, and leaves a
# process of its own session behind.
SURVIVOR = """
import os, signal, subprocess, sys, time
subprocess.Popen([sys.executable, "-S", "-c", "import time; time.sleep(120)", {marker!r}], start_new_session=True)
os.kill(os.getppid(), signal.SIGKILL)
time.sleep(1)
print("the call ended")
"""


def test_leaving_a_process_running_after_the_call(box, mode):
    marker = f"rlcli-survivor-{uuid.uuid4().hex}"
    try:
        out = run_code(box, SURVIVOR.format(marker=marker))
        if mode == "none":
            assert marked(marker), out
        else:
            assert wait_until(lambda: not marked(marker)), f"{marked(marker)} outlived the call: {out}"
        goes_on(box)
    finally:
        kill_marked(marker)


# A fork bomb, bounded so that it cannot hurt the machine: a child kills the supervisor, which counts
# the call's processes, then starts more processes than python_exec allows.
BOMB = """
import os, signal, sys, time
supervisor = os.getppid()
if os.fork() == 0:
    os.kill(supervisor, signal.SIGKILL)
    for _ in range({count}):
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-S", "-c", "import time; time.sleep(120)", {marker!r}])
    os._exit(0)
time.sleep(10)
"""


def test_a_fork_bomb(box, mode):
    marker, allowed = f"rlcli-bomb-{uuid.uuid4().hex}", python_exec_module.MAX_PROCESSES
    try:
        out = run_code(box, BOMB.format(count=allowed + 8, marker=marker))
        if mode == "none":
            assert wait_until(lambda: len(marked(marker)) > allowed), f"{len(marked(marker))} processes: {out}"
        else:
            assert out.endswith(f"[stopped: it ran more than {allowed} processes at once]"), out
            assert wait_until(lambda: not marked(marker)), f"{marked(marker)} outlived the call: {out}"
        goes_on(box)
    finally:
        kill_marked(marker)


FILL = """
import os
written = 0
for place in (".", os.environ["TMPDIR"], "/dev/shm"):
    for i in range(6):
        try:
            with open(os.path.join(place, f"fill{{i}}"), "wb") as file:
                file.write(b"x" * {chunk})
        except OSError as exc:
            print(place, exc)
            break
        written += {chunk}
print("written", written)
"""


def test_filling_the_disk_past_the_limit(box, mode, monkeypatch):
    limit = 16 << 20  # lowered from python_exec's 256 MiB, to write little
    monkeypatch.setattr(python_exec_module, "DISK_LIMIT_BYTES", limit)
    out = run_code(box, FILL.format(chunk=limit // 4))
    written = int(out.rpartition("written ")[2].split()[0])
    # Six files per place, 1.5 times the limit; in bubblewrap each place is full after fewer than four.
    assert (written > 2 * limit) == (mode == "none"), out
    goes_on(box)


# --- a stage goes on ------------------------------------------------------------------------------

ESCAPES_ENV = '''
ESCAPES = {escapes!r}


class Escapes:
    """Task i: one python_exec call with escape i, then an answer."""

    def reset(self, seed):
        self.seed, self.turn = seed, 0
        return f"Escape {{seed}}.", {{"task": {{"seed": seed}}}}

    def step(self, action):
        return "ok", 1.0, True, False, {{"success": True}}

    def expert_action(self):
        self.turn += 1
        if self.turn == 1:
            call = {{"name": "python_exec", "arguments": {{"code": ESCAPES[self.seed % len(ESCAPES)]}}}}
            return "<tool_call>" + __import__("json").dumps(call) + "</tool_call>"
        return "done"
'''


def test_a_rollout_stage_goes_on_after_every_escape(tmp_path):
    if (problem := bwrap_problem()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {problem}")
    marker = f"rlcli-stage-{uuid.uuid4().hex}"
    escapes = [
        SURVIVOR.format(marker=marker),
        BOMB.format(count=python_exec_module.MAX_PROCESSES + 8, marker=marker),
        f"open({str(tmp_path / 'escaped.txt')!r}, 'w').write('out')",
        "import socket; socket.create_connection(('127.0.0.1', 22), timeout=5)",
    ]
    env_file = write_env_file(tmp_path / "escapes.py", ESCAPES_ENV.format(escapes=escapes))
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "tools": ["python_exec"], "code_sandbox": "bwrap", "max_turns": 3},
        rollout={"tasks": len(escapes), "group_size": 1, "batch_size": 2},
    )
    try:
        result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
        assert result.returncode == 0, result.stderr
        with closing(sqlite3.connect(tmp_path / "runs" / "rlcli.db")) as conn:
            rows = conn.execute("select status, messages from episodes order by task_index").fetchall()
        assert [status for status, _ in rows] == ["ok"] * len(escapes)
        results = [next(m["content"] for m in json.loads(messages) if m["role"] == "tool") for _, messages in rows]
        assert results[0] == "the call ended\n", results
        assert results[1].endswith("processes at once]"), results
        assert "Errno 2" in results[2] and not (tmp_path / "escaped.txt").exists(), results
        assert "Errno 111" in results[3] or "Errno 101" in results[3], results  # refused or unreachable
        assert wait_until(lambda: not marked(marker)), f"{marked(marker)} outlived the stage"
    finally:
        kill_marked(marker)


# --- the setting ----------------------------------------------------------------------------------


@pytest.fixture
def no_bwrap(monkeypatch):
    """A machine without bubblewrap: a PATH on which there is no bwrap (the answer is kept per process)."""
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))
    monkeypatch.setattr(sandbox, "_said", set())
    bwrap_problem.cache_clear()
    yield
    bwrap_problem.cache_clear()


def _no_runs(runs: Path) -> bool:
    if not (runs / "rlcli.db").exists():
        return True
    with closing(sqlite3.connect(runs / "rlcli.db")) as conn:
        return not conn.execute("select name from runs").fetchall()


def test_bwrap_where_it_cannot_run_is_refused_in_one_sentence_before_anything_is_written(tmp_path, no_bwrap):
    recipe = write_recipe(tmp_path / "r.yaml", env={"tools": ["python_exec"], "code_sandbox": "bwrap"})
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())  # the console's wrapping undone
    assert "env.code_sandbox is bwrap, but bwrap is not installed" in message, message
    assert message.endswith("expected a Linux machine with bubblewrap (or set none).") and "Traceback" not in message
    assert _no_runs(tmp_path / "runs")


def test_auto_says_in_one_line_which_it_took(tmp_path, no_bwrap):
    recipe = write_recipe(tmp_path / "r.yaml", env={"tools": ["python_exec"]})  # env.code_sandbox: auto
    result = run_in_process(["recipes", "validate", str(recipe)], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 0, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("env.code_sandbox auto:")]
    assert said == [
        "env.code_sandbox auto: runs with its limits only: bwrap is not installed (apt-get install "
        "bubblewrap, or make install)."
    ], result.stderr


# --- other programs in the sandbox ----------------------------------------------------------------

PROBE_SERVER = """
import os
from mcp.server.mcpserver import MCPServer

server = MCPServer("rlcli-test-sandboxed-server")


@server.tool()
def look(path: str) -> str:
    \"\"\"What the server sees.

    Args:
        path: A path to read.
    \"\"\"
    try:
        seen = open(path).read()
    except OSError as exc:
        seen = type(exc).__name__
    return f"{seen} {os.environ.get('RLCLI_TEST_API_KEY')} {sorted(int(p) for p in os.listdir('/proc') if p.isdigit())}"


server.run()
"""


def test_an_mcp_server_runs_in_the_sandbox_with_env_sandbox_bwrap(tmp_path, monkeypatch):
    if (problem := bwrap_problem()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {problem}")
    monkeypatch.setenv("RLCLI_TEST_API_KEY", "rlcli's own")
    (tmp_path / "server.py").write_text(PROBE_SERVER)
    (tmp_path / "data.txt").write_text("its own folder")
    outside = tmp_path.parent / f"outside-{uuid.uuid4().hex}.txt"
    outside.write_text("beside its folder")
    spec = McpServerSpec((sys.executable, "server.py"), (("RLCLI_TEST_API_KEY", "its own"),))
    box = ToolBox(ToolsSpec(mcp_servers=(spec,), root=str(tmp_path), timeout_s=60, servers_in_bwrap=True))
    try:
        assert box.call(ToolCall("look", {"path": "data.txt"})).content == "its own folder its own [1, 2]"
        assert box.call(ToolCall("look", {"path": str(outside)})).content == "FileNotFoundError its own [1, 2]"
    finally:
        box.close()
        outside.unlink()


def test_a_sandboxed_program_sees_only_what_it_is_given(tmp_path):
    if (problem := bwrap_problem()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {problem}")
    (tmp_path / "shown").mkdir()
    (tmp_path / "shown" / "a.txt").write_text("shown")
    (tmp_path / "shown" / "runs").mkdir()
    (tmp_path / "shown" / "runs" / "rlcli.db").write_text("hidden")
    code = (
        "import os, socket\n"
        f"print(open({str(tmp_path / 'shown' / 'a.txt')!r}).read(), os.listdir({str(tmp_path / 'shown' / 'runs')!r}),"
        " socket.gethostname(), os.getcwd(), os.environ['HOME'], sorted(os.environ))\n"
    )
    shown = Sandbox(
        (("LANG", "C.UTF-8"),), readable=(str(tmp_path / "shown"),), hidden=(str(tmp_path / "shown" / "runs"),)
    )
    done = subprocess.run(
        die_with_parent(sandboxed([sys.executable, "-I", "-c", code], shown)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == "shown [] sandbox /tmp/scratch /tmp/scratch ['HOME', 'LANG', 'PWD', 'TMPDIR']\n"


# --- env workers in the sandbox (env.sandbox) -----------------------------------------------------

PROBE_ENV = '''
import json, os, socket, time


class Probe:
    """Its reset says what its worker sees; a step of "hang" never returns."""

    def reset(self, seed):
        seen = {{"pid": os.getpid()}}
        try:
            seen["home"] = open({planted!r}).read()
        except OSError as exc:
            seen["home"] = type(exc).__name__
        try:
            seen["port"] = socket.create_connection(("127.0.0.1", {port}), timeout=5).recv(100).decode()
        except OSError as exc:
            seen["port"] = type(exc).__name__
        seen["variable"] = os.environ.get("RLCLI_TEST_API_KEY")
        seen["rlcli"] = os.path.exists("/proc/{rlcli}/cmdline") and open("/proc/{rlcli}/cmdline", "rb").read() == {command!r}
        return json.dumps(seen), {{"task": {{}}}}

    def step(self, action):
        if action == "hang":
            time.sleep(600)
        return "ok", 1.0, True, False, {{}}

    def expert_action(self):
        return "done"


def make_env():
    return Probe()
'''


def probe_env(path: Path, planted: Path, port: int) -> Path:
    command = Path(f"/proc/{os.getpid()}/cmdline").read_bytes()
    return write_env_file(path, PROBE_ENV.format(planted=str(planted), port=port, rlcli=os.getpid(), command=command))


ESCAPED = {"home": "planted secret", "port": "hello from the host", "variable": "rlcli's own", "rlcli": True}


def test_an_env_worker_runs_in_the_sandbox_with_env_sandbox_bwrap(mode, tmp_path, monkeypatch, planted, host_port):
    from rlcli.envs.workers import EnvWorkerPool

    monkeypatch.setenv("RLCLI_TEST_API_KEY", "rlcli's own")
    env_file = probe_env(tmp_path / "probe.py", planted, host_port)
    with EnvWorkerPool(str(env_file), {}, 1, timeout_s=60, root=tmp_path, in_bwrap=mode == "bwrap") as pool:
        key = pool.reset(0)
        [reply] = pool.replies()
        assert reply.failure is None, reply.failure
        seen = json.loads(reply.value[0][0])
        # A step that hangs: the worker (in bubblewrap, its whole sandbox) is killed and replaced.
        first = pool.workers[0].process.pid
        stuck = [first, *descendants(first)]
        pool.timeout_s = 2
        pool.step(key, "hang")
        [reply] = pool.replies()
        assert "time limit" in str(reply.failure), reply.failure
        assert wait_until(lambda: not any(Path(f"/proc/{pid}").exists() for pid in stuck)), stuck
        pool.timeout_s = 60
        key = pool.reset(1)
        [reply] = pool.replies()
        assert reply.failure is None, reply.failure
    for what, value in ESCAPED.items():
        assert (seen[what] == value) == (mode == "none"), seen


def test_a_rollout_with_env_sandbox_bwrap_runs_its_env_workers_in_the_sandbox(
    tmp_path, monkeypatch, planted, host_port
):
    if (problem := bwrap_problem()) is not None:
        pytest.skip(f"bubblewrap cannot run here: {problem}")
    monkeypatch.setenv("RLCLI_TEST_API_KEY", "rlcli's own")
    env_file = probe_env(tmp_path / "probe.py", planted, host_port)
    recipe = write_recipe(
        tmp_path / "r.yaml",
        env={"name": str(env_file), "workers": 1, "sandbox": "bwrap", "max_turns": 1},
        rollout={"tasks": 2, "group_size": 1, "batch_size": 2},
    )
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 0, result.stderr
    with closing(sqlite3.connect(tmp_path / "runs" / "rlcli.db")) as conn:
        rows = conn.execute("select status, messages from episodes order by task_index").fetchall()
    assert [status for status, _ in rows] == ["ok", "ok"]
    for _, messages in rows:
        seen = json.loads(next(m["content"] for m in json.loads(messages) if m["role"] == "user"))
        assert not any(seen[what] == value for what, value in ESCAPED.items()), seen


def test_env_sandbox_with_ray_actors_is_refused_in_one_sentence_before_anything_is_written(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", env={"workers": 1, "workers_backend": "ray", "sandbox": "bwrap"})
    result = run_in_process(["rollout", "-r", str(recipe), "--policy", "expert"], tmp_path / "runs", cwd=REPO)
    assert result.returncode == 2, result.stderr
    message = " ".join(result.stderr.split())
    assert (
        "env.sandbox is bwrap, but Ray actors cannot run in bubblewrap; expected env.workers_backend process" in message
    )
    assert "Traceback" not in message and _no_runs(tmp_path / "runs")
