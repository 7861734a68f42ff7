"""Everything rlcli starts dies with it (envs/subprocesses.py), and python_exec's limits hold.

The kill-and-inspect tests start a real process built from rlcli's own components, with every kind of
child rlcli starts alive at once (python_exec code with a setsid grandchild and a busy loop, in the
process itself and in an env worker; an env worker and its env's subprocess; an MCP server; an OpenEnv
server; Chromium), kill it with SIGKILL, SIGTERM or Ctrl-C, and check through /proc that none of its
descendants survives and that no scratch folder is left in its temporary folder.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from browser import chromium_executable
from helpers import alive
from rlcli.envs import python_exec as python_exec_module
from rlcli.envs.python_exec import MAX_CONCURRENT_CALLS, python_exec

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the guarantees are Linux's")


def _descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            children.setdefault(int(stat[stat.rindex(")") + 2 :].split()[1]), []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        below = children.get(todo.pop(), [])
        found.update(below)
        todo += below
    return found


def _command(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return "gone"


def _wait_until(check, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


# --- python_exec's own limits ---------------------------------------------------------------------

SETSID_CHILD = """
import subprocess
print(subprocess.Popen(["setsid", "sleep", "300"]).pid)
"""


def test_python_exec_kills_a_setsid_grandchild_at_the_end_of_a_normal_call():
    out = python_exec(SETSID_CHILD)
    pid = int(out.split()[0])
    assert _wait_until(lambda: not alive(pid), 10), f"python_exec's setsid grandchild {pid} outlived its call"


def test_python_exec_bounds_the_whole_process_tree(monkeypatch):
    monkeypatch.setattr(python_exec_module, "MAX_PROCESSES", 4)
    many = "import os, time\nfor _ in range(8):\n    if os.fork() == 0:\n        time.sleep(60)\ntime.sleep(60)\n"
    assert python_exec(many).endswith("[stopped: it ran more than 4 processes at once]")
    # Each child under the per-process address-space limit, together over the tree's memory bound.
    monkeypatch.setattr(python_exec_module, "MEMORY_LIMIT_BYTES", 200 << 20)
    big = (
        "import os, time\n"
        "for _ in range(3):\n"
        "    if os.fork() == 0:\n"
        "        block = bytearray(90 << 20)\n"
        "        block[::4096] = b'x' * len(block[::4096])\n"  # touched: resident, not only reserved
        "        time.sleep(60)\n"
        "time.sleep(60)\n"
    )
    assert python_exec(big).endswith("[stopped: its processes held more than 200 MiB of memory together]")


def test_python_exec_runs_few_calls_at_once(tmp_path):
    # Each call marks itself running in a shared folder, waits, and counts the calls running with it.
    code = (
        "import os, time, uuid\n"
        f"mark = os.path.join({str(tmp_path)!r}, uuid.uuid4().hex)\n"
        "open(mark, 'w').close()\n"
        "time.sleep(0.5)\n"
        f"print(len(os.listdir({str(tmp_path)!r})))\n"
        "os.remove(mark)\n"
    )
    outputs: list[str] = []
    threads = [
        threading.Thread(target=lambda: outputs.append(python_exec(code))) for _ in range(2 * MAX_CONCURRENT_CALLS)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(out.strip().isdigit() for out in outputs), outputs
    assert max(int(out) for out in outputs) <= MAX_CONCURRENT_CALLS, outputs


FIND_SECRET = """
import os
found = []
for pid in os.listdir("/proc"):
    if pid.isdigit():
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read()
        except OSError:
            continue
        if b"rlcli-test-secret" in environ:
            found.append(pid)
# The parent chain, named in the answer: the supervisor, then rlcli.
chain, pid = [], os.getppid()
while pid > 1:
    chain.append(pid)
    pid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
print("found", found, "chain", chain)
"""

RUN_CODE = """
import os, sys
from rlcli.envs.python_exec import python_exec
print(os.getpid())
print(python_exec(sys.argv[1]))
"""


def test_python_exec_code_cannot_read_rlclis_environment_through_proc(tmp_path):
    env = {**os.environ, "HF_TOKEN": "rlcli-test-secret", "WANDB_API_KEY": "rlcli-test-secret"}
    done = subprocess.run(
        [sys.executable, "-c", RUN_CODE, FIND_SECRET], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    rlcli, answer = done.stdout.split("\n", 1)
    assert "found [] chain" in answer, f"python_exec's code read rlcli's secret through /proc: {answer}"
    assert f", {rlcli}," in answer or f", {rlcli}]" in answer, (
        f"rlcli ({rlcli}) not in the code's parent chain: {answer}"
    )


# --- kill and inspect -----------------------------------------------------------------------------

BUSY_CODE = """
import os, subprocess
daemon = subprocess.Popen(["setsid", "sleep", "300"]).pid
with open(os.path.join({folder!r}, "{name}"), "w") as ready:
    ready.write(f"{{os.getpid()}} {{daemon}}")
while True:
    pass
"""

WORKER_ENV = """
import subprocess
from rlcli.envs.python_exec import python_exec

class WithChildAndCode:
    def reset(self, seed):
        self.child = subprocess.Popen(["sleep", "300"])
        return "Say anything.", {"task": {}}

    def step(self, action):
        return python_exec(action), 0.0, True, False, {}

def make_env():
    return WithChildAndCode()
"""

# Small stand-ins where the real ones take many seconds to import: a stdio MCP server, and an ASGI app
# that answers GET /health as an OpenEnv server does (rlcli's launcher serves it with uvicorn).
MCP_SERVER = """
from mcp.server.mcpserver import MCPServer

server = MCPServer("rlcli-test-supervision")


@server.tool()
def add(a: int, b: int) -> int:
    \"\"\"Add two integers.\"\"\"
    return a + b


server.run()
"""

HEALTH_APP = """
async def app(scope, receive, send):
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            done = {"lifespan.startup": "lifespan.startup.complete", "lifespan.shutdown": "lifespan.shutdown.complete"}
            await send({"type": done[message["type"]]})
            if message["type"] == "lifespan.shutdown":
                return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": b"{}"})
"""

# rlcli's own components, each started as rlcli starts it, the servers side by side (each keeps a
# thread of its own that lives as long as it does); the python_exec code last, as its 10 s limit runs.
DRIVER = """
import os, sys, threading, time
from pathlib import Path

kinds, marks, busy = sys.argv[1].split(","), Path(sys.argv[2]), sys.argv[3]
held = []  # what must not be collected while the driver waits
from rlcli.envs.workers import EnvWorkerPool

def say(kind, *pids):
    print(kind, *pids, flush=True)

def mcp_server():
    from rlcli.envs.tools import McpServerSpec, ToolBox, ToolsSpec
    held.append(ToolBox(ToolsSpec(mcp_servers=(McpServerSpec((sys.executable, "mcp_server.py")),), timeout_s=60)))

def openenv_server():
    from rlcli.envs.adapters.openenv import _LocalServer
    held.append(_LocalServer("health_app:app", os.getcwd(), 60))

def chromium():
    from rlcli.envs.browser import shared_chromium
    shared_chromium().run(lambda browser: browser.version, 60)

def env_worker():
    pool = EnvWorkerPool("worker_env.py", {}, 1, timeout_s=60, root=Path.cwd())
    pool.reset(0)
    assert pool.replies()[0].failure is None
    held.append(pool)

# The pool on the main thread, as rlcli has it: a worker dies with the thread that started it.
starts = [threading.Thread(target=globals()[kind]) for kind in kinds if kind not in ("python_exec", "env_worker")]
for start in starts:
    start.start()
if "env_worker" in kinds:
    env_worker()
for start in starts:
    start.join()
if "python_exec" in kinds:
    from rlcli.envs.python_exec import python_exec
    code = busy.format(folder=str(marks), name="main")
    threading.Thread(target=python_exec, args=(code,), daemon=True).start()
if "env_worker" in kinds:
    [pool] = [h for h in held if isinstance(h, EnvWorkerPool)]
    pool.step(0, busy.format(folder=str(marks), name="worker"))  # the key of its one env
    say("env_worker", pool.workers[0].process.pid)
deadline = time.monotonic() + 60
for name, kind in (("main", "python_exec"), ("worker", "env_worker")):
    while kind in kinds and not (marks / name).exists():
        if time.monotonic() > deadline:
            sys.exit(f"the python_exec code ({name}) did not start")
        time.sleep(0.02)
time.sleep(0.2)  # the marks are written whole
try:  # "ready" inside: the test's Ctrl-C may land while it is being written
    say("ready")
    time.sleep(3600)
finally:  # as rlcli's stages close theirs (`with env_host(...)`), on Ctrl-C too; the rest is left to exit
    for pool in held:
        if isinstance(pool, EnvWorkerPool):
            pool.close()
"""


def _kinds() -> list[str]:
    kinds = ["python_exec", "env_worker", "mcp_server", "openenv_server"]
    try:
        import playwright  # noqa: F401
    except ImportError:
        return kinds
    return kinds + (["chromium"] if chromium_executable() is not None else [])


@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM", "Ctrl-C"])
def test_nothing_rlcli_starts_outlives_it(tmp_path, how):
    (tmp_path / "worker_env.py").write_text(WORKER_ENV)
    (tmp_path / "mcp_server.py").write_text(MCP_SERVER)
    (tmp_path / "health_app.py").write_text(HEALTH_APP)
    marks, temporary = tmp_path / "marks", tmp_path / "tmp"
    marks.mkdir()
    temporary.mkdir()
    kinds = _kinds()
    env = {**os.environ, "TMPDIR": str(temporary)}
    rlcli = subprocess.Popen(
        [sys.executable, "-c", DRIVER, ",".join(kinds), str(marks), BUSY_CODE],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: Ctrl-C goes to the whole group, as a terminal's does
    )
    try:
        said = {}
        for line in rlcli.stdout:
            kind, *pids = line.split()
            said[kind] = [int(pid) for pid in pids]
            if kind == "ready":
                break
        assert "ready" in said, f"the driver did not start every kind of child: {said}"
        tree = _descendants(rlcli.pid)
        code = {name: [int(pid) for pid in (marks / name).read_text().split()] for name in os.listdir(marks)}
        expected = {"python_exec code and its setsid child": code.get("main", []), **said}
        expected["python_exec code in an env worker, and its setsid child"] = code.get("worker", [])
        for kind, pids in expected.items():
            assert set(pids) <= tree, f"{kind} {pids} is not below the driver: {tree}"
        commands = " | ".join(_command(pid) for pid in tree)
        for kind, command in (("mcp_server", "mcp_server.py"), ("openenv_server", "health_app:app")):
            assert command in commands or kind not in kinds, f"no {kind} below the driver"
        assert "--user-data-dir" in commands or "chromium" not in kinds, "no Chromium below the driver"
        if how == "SIGKILL":
            rlcli.kill()
        elif how == "SIGTERM":
            rlcli.terminate()
        else:
            os.killpg(rlcli.pid, signal.SIGINT)
        rlcli.wait(60)
    finally:
        if rlcli.poll() is None:
            rlcli.kill()
            rlcli.wait()
    assert _wait_until(lambda: not any(alive(pid) for pid in tree)), "survivors: " + ", ".join(
        f"{pid} ({_command(pid)[:120]})" for pid in tree if alive(pid)
    )

    # playwright's own driver (node, started by the playwright package) leaves an empty folder of its own.
    def left() -> list[str]:
        return [path.name for path in temporary.iterdir() if not path.name.startswith("playwright-artifacts-")]

    assert _wait_until(lambda: not left()), f"scratch folders left: {left()}"
