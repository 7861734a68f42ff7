"""Where environments run: in the main process (env.workers: 0), or in worker processes.

The rollout engine talks to either through the same small interface, `EnvHost`: it asks for a
`reset`, a `step` or an `expert_step` of an env (named by a key the host gives out), collects the
`EnvReply`s as they come, and `release`s an env when its episode is over. Calls are asynchronous:
with workers, the main process samples the next turn of the episodes whose env has answered while
the other envs are still stepping (see engine/rollout.py).

Worker processes (`EnvWorkerPool`):
- are started with the `spawn` method (a forked copy of a process running torch threads can
  deadlock), and build the env themselves from the recipe's env.name and env.kwargs, with the main
  process's sys.path and working directory, so built-ins, files and modules load as in the main
  process;
- host several episodes' envs each and answer one message at a time, in order; a reply carries the
  time the call took in the worker, so a late answer counts as a time-out whatever the main process
  was doing meanwhile;
- are killed (with their process group, so an env's own subprocesses go too) and replaced when a
  call outlasts env.step_timeout_s: this stops a step stuck in C code, which a thread cannot. The
  other envs the worker hosted are lost with it (`EnvLost`): the rollout engine plays their
  episodes again from their start, in the same stage (engine/rollout.py);
- that die (a segfault, the out-of-memory killer) fail the episode whose call was running, with
  the signal in the error, and lose the others as above; the stage goes on;
- host several live envs each (env.isolation: worker), or one at a time (env.isolation: episode):
  then a reset waits for a worker without a live env, and a killed worker takes only its own
  episode's env with it;
- die with the main process: the kernel kills them when it dies (Linux), and they exit when their
  pipe to it closes;
- take their env's own subprocesses with them, however they end: each leads its own process group,
  killed as a whole on a time-out, and a watcher process forked into the group kills it when the
  worker dies (a crash, the kernel killing it with a kill -9'd main process), which a dying worker
  cannot do itself. A subprocess that starts a session or group of its own (setsid) is out of reach;
- may get limits: env.worker_memory_mb (address space, RLIMIT_AS: past it allocations fail with
  MemoryError) and env.worker_cpu_s (CPU seconds per call, RLIMIT_CPU: past it the kernel kills
  the worker);
- may run in bubblewrap (env.sandbox: `_SandboxedWorker`): no network, none of rlcli's processes or
  variables, the system, rlcli's Python, the folder rlcli runs in and the folders on its sys.path
  read-only (but the runs folder), a scratch folder of their own. multiprocessing cannot start a
  process through a wrapper, so such a worker is a command (bubblewrap under the supervisor of
  envs/subprocesses.py) that inherits its end of the pipe and reads its WorkerSpec from it; it dies
  with the main process through both. Its tools run inside its sandbox (a sandbox makes none inside).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

from rlcli.envs.protocol import EnvFailure, EnvTimeout, call_with_timeout
from rlcli.envs.sandbox import BASE_ENV, Sandbox, hidden_runs, program_returncode, sandboxed
from rlcli.envs.subprocesses import die_with_parent, exit_with_parent, kill_group_when_gone
from rlcli.envs.tool_use import ToolUseSpec
from rlcli.errors import UsageError


class EnvLost(EnvFailure):
    """The worker hosting this env was killed or died during another episode's call: the env's state
    is gone through no fault of its own, so playing the episode again may well succeed."""


@dataclass
class EnvReply:
    """The answer to one call: what the env returned, or how the call failed."""

    key: int
    op: str  # reset | step | expert_step
    value: Any = None  # reset: (what env.reset returned, env.tools); a step: what env.step returned
    failure: EnvFailure | None = None
    failed_in: str = ""  # create | expert | reset | step: the call that failed
    env_time_s: float = 0.0  # the reset or step itself
    action: str = ""  # expert_step: the expert's action
    expert_time_s: float = 0.0


class EnvHost(Protocol):
    """Where a stage's envs live; `reset` gives out the key that names an env in the other calls."""

    def reset(self, seed: int) -> int: ...

    def step(self, key: int, action: str) -> None: ...

    def expert_step(self, key: int) -> None: ...

    def replies(self, timeout: float | None = None) -> list[EnvReply]: ...

    def release(self, key: int) -> None: ...

    def __enter__(self) -> EnvHost: ...

    def __exit__(self, *exc: object) -> None: ...


class InProcessEnvs:
    """env.workers: 0: every call runs now, in this process, under call_with_timeout's thread."""

    def __init__(self, factory: Callable[[], Any], timeout_s: float):
        self.factory, self.timeout_s = factory, timeout_s
        self.envs: dict[int, Any] = {}
        self.answered: list[EnvReply] = []
        self.next_key = 0

    def __enter__(self) -> InProcessEnvs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.envs.clear()

    def reset(self, seed: int) -> int:
        key, self.next_key = self.next_key, self.next_key + 1
        try:
            env = self.factory()
        except UsageError:  # a recipe mistake (a game id, a kwarg): stop the stage with one sentence
            raise
        except Exception as exc:
            self.answered.append(EnvReply(key, "reset", failure=_failure(exc), failed_in="create"))
            return key
        self.envs[key] = env
        self.answered.append(self._call(key, "reset", env.reset, seed, lambda raw: (raw, getattr(env, "tools", None))))
        return key

    def step(self, key: int, action: str) -> None:
        self.answered.append(self._call(key, "step", self.envs[key].step, action))

    def expert_step(self, key: int) -> None:
        start = time.perf_counter()
        try:
            action = self.envs[key].expert_action()
        except Exception as exc:
            reply = EnvReply(key, "expert_step", failure=_failure(exc), failed_in="expert")
        else:
            expert_time = time.perf_counter() - start
            reply = self._call(key, "expert_step", self.envs[key].step, action)
            reply.action, reply.expert_time_s = action, expert_time
        self.answered.append(reply)

    def replies(self, timeout: float | None = None) -> list[EnvReply]:
        """Every call has been answered already: there is never anything to wait for."""
        out, self.answered = self.answered, []
        return out

    def release(self, key: int) -> None:
        self.envs.pop(key, None)

    def _call(self, key: int, op: str, fn: Callable, arg: Any, wrap: Callable = lambda raw: raw) -> EnvReply:
        start = time.perf_counter()
        try:
            value = wrap(call_with_timeout(fn, self.timeout_s, arg))
        except EnvFailure as exc:
            failed_in = "reset" if op == "reset" else "step"
            return EnvReply(key, op, failure=exc, failed_in=failed_in, env_time_s=time.perf_counter() - start)
        return EnvReply(key, op, value=value, env_time_s=time.perf_counter() - start)


def _failure(exc: BaseException) -> EnvFailure:
    return EnvFailure(f"{type(exc).__name__}: {exc}")


# --- worker processes --------------------------------------------------------------


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build envs as the main process would."""

    env_name: str
    env_kwargs: dict
    root: str  # the main process's working directory: env files are found from it
    sys_path: list[str]
    parent_pid: int
    memory_mb: int | None = None
    cpu_s: float | None = None
    tools: ToolUseSpec | None = None  # the recipe's tools: the worker's envs answer tool calls
    in_bwrap: bool = False  # env.sandbox made a yes or no (sandbox.use_bwrap): the worker runs in bubblewrap


@dataclass
class _Request:
    key: int
    op: str


@dataclass
class _Worker:
    slot: int
    process: Any
    conn: Connection
    ready: bool = False
    queue: deque[_Request] = field(default_factory=deque)  # sent and not answered yet, oldest first
    deadline: float | None = None  # when the oldest request must be answered by
    hosted: set[int] = field(default_factory=set)  # keys of the live envs it holds


class Slot(Protocol):
    """What `RemoteEnvs` reads of a backend's slot (a worker process, a Ray actor)."""

    slot: int  # its place among the slots, which its replacement takes
    queue: deque[Any]  # the calls it was asked and has not answered yet, oldest first
    deadline: float | None  # when the oldest call must be answered by
    hosted: set[int]  # keys of the live envs it holds


_S = TypeVar("_S", bound=Slot)
_Hosts = TypeVar("_Hosts", bound="RemoteEnvs[Any]")


class RemoteEnvs(Generic[_S]):
    """What the two remote backends (worker processes, Ray actors) share: which slot hosts which env,
    the resets waiting for a slot, the envs lost with a replaced slot, the answers waiting to be read,
    how an answer or a replacement becomes replies, and the loop that waits for answers, expires
    calls that outlast env.step_timeout_s and replaces their slots (`replies`).

    A backend keeps its slots in `slots()` (the list itself: a replacement takes its slot's place in
    it) and says how to start one (`_start`), send it a call (`_send`), drop an env (`_close`), take in
    what it has answered and notice its death (`_read`), wait until one may have answered (`_wait`),
    list the calls it was asked (`_asked`) and stop it for good (`_stop`)."""

    timeout_s: float

    def __init__(self, isolation: str = "worker") -> None:
        # episode: a slot hosts one live env at a time, so that killing it loses no other episode's env.
        self.one_per_slot = isolation == "episode"
        self.waiting: deque[tuple[int, int]] = deque()  # (key, seed) of resets not sent to a slot yet
        self.lost: dict[int, str] = {}  # key -> why its env is gone, told at the next call for it
        self.answered: list[EnvReply] = []
        self.next_key = 0

    def __enter__(self: _Hosts) -> _Hosts:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def slots(self) -> list[_S]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def _start(self, slot: int) -> _S:
        raise NotImplementedError

    def _send(self, slot: _S, request: _Request, arg: Any) -> None:
        raise NotImplementedError

    def _close(self, slot: _S, key: int) -> None:
        raise NotImplementedError

    def _read(self, slot: _S) -> None:
        raise NotImplementedError

    def _wait(self, timeout: float | None) -> None:
        raise NotImplementedError

    def _asked(self, slot: _S) -> list[_Request]:
        raise NotImplementedError

    def _stop(self, slot: _S) -> None:
        raise NotImplementedError

    def replies(self, timeout: float | None = None) -> list[EnvReply]:
        """The replies that have come. With none yet, wait for one up to `timeout` seconds (None: as
        long as it takes, unless nothing is asked)."""
        until = None if timeout is None else time.monotonic() + timeout
        while True:
            for slot in list(self.slots()):
                self._read(slot)
            self._expire()
            now = time.monotonic()
            if self.answered or not any(s.queue for s in self.slots()) or (until is not None and now >= until):
                out, self.answered = self.answered, []
                return out
            wake = [s.deadline for s in self.slots() if s.deadline is not None] + ([until] if until else [])
            self._wait(max(min(wake) - now, 0) if wake else None)

    def reset(self, seed: int) -> int:
        key, self.next_key = self.next_key, self.next_key + 1
        self.waiting.append((key, seed))
        self._place()
        return key

    def step(self, key: int, action: str) -> None:
        self._call(key, "step", action)

    def expert_step(self, key: int) -> None:
        self._call(key, "expert_step", None)

    def release(self, key: int) -> None:
        self.lost.pop(key, None)
        for slot in self.slots():
            if key in slot.hosted:
                slot.hosted.discard(key)
                self._close(slot, key)
        self._place()

    def _place(self) -> None:
        """Send the waiting resets to the slots hosting the fewest envs (with isolation episode, to
        slots hosting none: the others wait for a release or a replacement)."""
        while self.waiting:
            free = [s for s in self.slots() if not (self.one_per_slot and s.hosted)]
            if not free:
                return
            slot = min(free, key=lambda s: (len(s.hosted), s.slot))
            key, seed = self.waiting.popleft()
            slot.hosted.add(key)
            self._send(slot, _Request(key, "reset"), seed)

    def _call(self, key: int, op: str, arg: Any) -> None:
        if key in self.lost:
            self.answered.append(EnvReply(key, op, failure=EnvLost(self.lost.pop(key)), failed_in="step"))
            return
        [slot] = [s for s in self.slots() if key in s.hosted]
        self._send(slot, _Request(key, op), arg)

    def _answer(self, request: _Request, message: tuple) -> None:
        key, status, value, failed_in, env_time, action, expert_time = message
        assert request.key == key, "an env worker answered out of order"
        reply = EnvReply(key, request.op, env_time_s=env_time, action=action, expert_time_s=expert_time)
        if status == "ok" and env_time > self.timeout_s:
            # It answered, but later than the limit: a time-out, as in the main process.
            verb = "reset" if request.op == "reset" else "step"
            reply.failure, reply.failed_in = EnvTimeout(_over_time(verb, self.timeout_s)), verb
        elif status == "ok":
            reply.value = value
        else:
            reply.failure, reply.failed_in = EnvFailure(value), failed_in
        self.answered.append(reply)

    def _expire(self) -> None:
        """Replace the slots whose running call has outlasted env.step_timeout_s."""
        now = time.monotonic()
        for slot in list(self.slots()):
            if slot.deadline is not None and now >= slot.deadline:
                request = self._asked(slot)[0]
                verb = "reset" if request.op == "reset" else "step"
                timed_out = EnvTimeout(f"{_over_time(verb, self.timeout_s)} (its env worker was killed)")
                self._replace(slot, timed_out, "timed out")

    def _replace(self, slot: _S, failure: EnvFailure, what: str) -> None:
        """Stop a slot, fail the call it was running, lose its other envs, start a fresh one in its place."""
        self._stop(slot)
        self._fail_queued(self._asked(slot), slot.hosted, failure, what)
        slots = self.slots()
        slots[slots.index(slot)] = self._start(slot.slot)
        self._place()

    def _fail_queued(self, asked: list[_Request], hosted: set[int], failure: EnvFailure, what: str) -> None:
        """A replaced slot's calls fail: the running one with `failure`, the queued ones and the
        other envs it held as lost."""
        lost = f"its env worker was replaced after another episode's call {what}; the env's state was lost"
        for i, request in enumerate(asked):
            verb = "reset" if request.op == "reset" else "step"
            reply = EnvReply(request.key, request.op, failure=failure if i == 0 else EnvLost(lost), failed_in=verb)
            self.answered.append(reply)
        keys = {r.key for r in asked}
        self.lost.update({key: lost for key in hosted - keys})


class EnvWorkerPool(RemoteEnvs[_Worker]):
    """env.workers: N: envs in N worker processes, each call a message (see the module docstring).

    Use a pool from the thread that made it: Linux kills a worker when the thread that started it
    ends, which is how workers die with a killed main process.
    """

    def __init__(
        self,
        env_name: str,
        env_kwargs: dict,
        workers: int,
        timeout_s: float,
        memory_mb: int | None = None,
        cpu_s: float | None = None,
        root: Path | None = None,
        isolation: str = "worker",
        tools: ToolUseSpec | None = None,
        in_bwrap: bool = False,
    ):
        if in_bwrap and tools is not None:  # already in the worker's sandbox, where none can be made
            inside = dataclasses.replace(tools.tools, code_in_bwrap=False, servers_in_bwrap=False)
            tools = dataclasses.replace(tools, tools=inside)
        self.spec = WorkerSpec(
            env_name,
            dict(env_kwargs),
            str(root or Path.cwd()),
            list(sys.path),
            os.getpid(),
            memory_mb,
            cpu_s,
            tools,
            in_bwrap,
        )
        super().__init__(isolation)
        self.timeout_s = timeout_s
        self.context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        try:
            for slot in range(workers):
                self.workers.append(self._start(slot))
        except BaseException:
            self.close()
            raise

    def slots(self) -> list[_Worker]:
        return self.workers

    def close(self) -> None:
        for worker in self.workers:
            _kill(worker)
        self.workers = []

    # --- plumbing ---------------------------------------------------------------

    def _start(self, slot: int) -> _Worker:
        mine, theirs = self.context.Pipe()
        process: Any
        if self.spec.in_bwrap:
            process = _SandboxedWorker(theirs, self.spec)
            mine.send(self.spec)
        else:
            process = self.context.Process(target=serve, args=(theirs, self.spec), name=f"rlcli-env-{slot}")
            process.start()
        theirs.close()  # only the worker holds its end now: its death reads as EOF here
        return _Worker(slot, process, mine)

    def _wait(self, timeout: float | None) -> None:
        """Until a worker sends something or dies, or `timeout` seconds."""
        wait([w.conn for w in self.workers] + [w.process.sentinel for w in self.workers], timeout)

    def _asked(self, worker: _Worker) -> list[_Request]:
        return list(worker.queue)

    def _stop(self, worker: _Worker) -> None:
        _kill(worker)

    def _close(self, worker: _Worker, key: int) -> None:
        with contextlib.suppress(OSError):  # a dead worker: the next read notices
            worker.conn.send(("close", key, None))  # no answer: the worker just drops the env

    def _send(self, worker: _Worker, request: _Request, arg: Any) -> None:
        if worker.ready and not worker.queue:
            worker.deadline = time.monotonic() + self.timeout_s
        worker.queue.append(request)
        with contextlib.suppress(OSError):  # a dead worker: the next read notices and fails the request
            worker.conn.send((request.op, request.key, arg))

    def _read(self, worker: _Worker) -> None:
        """Take in every message the worker has sent; notice if it died."""
        while True:
            try:
                if not worker.conn.poll():
                    if worker.process.is_alive():
                        return
                    message = None  # died without closing its pipe first (it cannot have: belt and braces)
                else:
                    message = worker.conn.recv()
            except (EOFError, OSError):
                message = None
            if message is None:
                failure = _death(worker, self.spec)
                # A worker is asked nothing with a deadline before it is ready, so only its death can
                # end it then: it could not build the env factory, which no episode would fix.
                if not worker.ready:
                    _kill(worker)
                    raise UsageError(
                        f"an env worker for env.name {self.spec.env_name!r} stopped before it was ready: {failure} "
                        "(is env.worker_memory_mb too low?)"
                    )
                self._replace(worker, failure, "crashed")
                return
            if message[0] == "ready":
                worker.ready = True
                if worker.queue:
                    worker.deadline = time.monotonic() + self.timeout_s
            elif message[0] == "usage":  # the env cannot be loaded or built there: a recipe mistake
                raise UsageError(message[1])
            else:
                request = worker.queue.popleft()
                worker.deadline = time.monotonic() + self.timeout_s if worker.queue else None
                self._answer(request, message)


class _SandboxedWorker:
    """A worker in bubblewrap (env.sandbox), with what the pool reads of a multiprocessing Process: the
    command `serve_inherited`, under the supervisor, given `conn`'s descriptor; its WorkerSpec is the first
    message on the pipe. It sees the spec's root (where env files are found), the folder of an env file
    named elsewhere, and this process's Python path. Killing it kills the supervisor, whose death kills
    bubblewrap and, with it, every process of the sandbox (--die-with-parent and the PID namespace)."""

    def __init__(self, conn: Connection, spec: WorkerSpec) -> None:
        root = spec.root
        target = spec.env_name.partition(":")[0]
        env_file = [str((Path(root) / target).resolve().parent)] if target.endswith(".py") else []
        package = str(Path(__file__).resolve().parent.parent)  # where this process imports rlcli from
        python_path = [path for path in sys.path if os.path.isabs(path) and os.path.isdir(path)]
        shown = list(dict.fromkeys([root, *env_file, *python_path, package]))
        sandbox = Sandbox(tuple(BASE_ENV.items()), cwd=root, readable=tuple(shown), hidden=hidden_runs(shown))
        code = f"from rlcli.envs.workers import serve_inherited; serve_inherited({conn.fileno()})"
        # Its own session, as a multiprocessing worker ignores Ctrl-C: the main process handles it.
        self.popen = subprocess.Popen(
            die_with_parent(sandboxed([sys.executable, "-c", code], sandbox)),
            pass_fds=(conn.fileno(),),
            stdin=subprocess.DEVNULL,
            env=BASE_ENV,
            start_new_session=True,
        )
        self.pid = self.popen.pid
        self.sentinel = os.pidfd_open(self.pid)  # readable once it has ended: multiprocessing's wait takes it

    @property
    def exitcode(self) -> int | None:
        code = self.popen.poll()
        return None if code is None else program_returncode(code)

    def is_alive(self) -> bool:
        return self.popen.poll() is None

    def kill(self) -> None:
        self.popen.kill()

    def join(self, timeout: float | None = None) -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.popen.wait(timeout)
        if self.popen.returncode is not None and self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


def _over_time(verb: str, timeout_s: float) -> str:
    return f"{verb} exceeded the {timeout_s:g}s step time limit"


def _death(worker: _Worker, spec: WorkerSpec) -> EnvFailure:
    worker.process.join(5)
    code = worker.process.exitcode
    if code is not None and code < 0:
        name = signal.Signals(-code).name
        how = f"was killed by {name}"
        if -code == signal.SIGKILL:
            how += " (the out-of-memory killer does this)"
        elif -code == getattr(signal, "SIGXCPU", None):
            how += f" (it used more than env.worker_cpu_s={spec.cpu_s:g} CPU seconds)"
    else:
        how = f"exited with status {code}"
    return EnvFailure(f"its env worker {how}")


def _kill(worker: _Worker) -> None:
    if worker.process.is_alive():
        # The worker leads its own process group, so an env's subprocesses go with it (unless it has
        # only just started and does not lead one yet).
        with contextlib.suppress(OSError):
            os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.kill()
    worker.process.join()
    worker.conn.close()


# --- inside a worker ---------------------------------------------------------------


def serve_inherited(fd: int) -> None:
    """A sandboxed worker's life (env.sandbox): the pipe is the inherited descriptor fd, its first message
    the WorkerSpec."""
    conn = Connection(fd)
    serve(conn, conn.recv())


def serve(conn: Connection, spec: WorkerSpec) -> None:
    """A worker's life: build the env factory, then answer calls in order until the pipe closes."""
    if not spec.in_bwrap:  # in bubblewrap its parent is not the main process, and bubblewrap ties them instead
        exit_with_parent(spec.parent_pid)
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the main process's to handle
    kill_group_when_gone()
    _limit(spec)
    sys.path[:] = spec.sys_path
    os.chdir(spec.root)
    from rlcli.envs.loading import load_env

    try:
        factory = load_env(spec.env_name, spec.env_kwargs, Path(spec.root), spec.tools)
    except UsageError as exc:
        conn.send(("usage", str(exc)))
        return
    conn.send(("ready",))
    envs: dict[int, Any] = {}
    while True:
        try:
            op, key, arg = conn.recv()
        except EOFError:  # the main process is gone
            return
        if op == "close":
            envs.pop(key, None)
            continue
        try:
            reply = _handle(envs, factory, spec.cpu_s, op, key, arg)
        except UsageError as exc:
            conn.send(("usage", str(exc)))
            return
        try:
            conn.send(reply)
        except Exception as exc:  # the env returned something pickle cannot carry
            failed_in = "reset" if op == "reset" else "step"
            error = f"its result cannot be sent from the env worker: {_text(exc)}"
            conn.send((key, "error", error, failed_in, 0.0, "", 0.0))


def _handle(envs: dict, factory: Callable, cpu_s: float | None, op: str, key: int, arg: Any) -> tuple:
    """(key, ok | error, value or error text, the call that failed, env seconds, the expert's
    action, expert seconds)."""
    if op == "reset":
        try:
            envs[key] = factory()
        except UsageError:
            raise
        except Exception as exc:
            return key, "error", _text(exc), "create", 0.0, "", 0.0
        env = envs[key]
        status, value, elapsed = _timed(env.reset, (arg,), cpu_s)
        value = (value, getattr(env, "tools", None)) if status == "ok" else value
        return key, status, value, "reset", elapsed, "", 0.0
    env = envs[key]
    action, expert_time = arg, 0.0
    if op == "expert_step":
        status, action, expert_time = _timed(env.expert_action, (), cpu_s)
        if status != "ok":
            return key, status, action, "expert", 0.0, "", expert_time
    status, value, elapsed = _timed(env.step, (action,), cpu_s)
    return key, status, value, "step", elapsed, action if op == "expert_step" else "", expert_time


def _timed(fn: Callable, args: tuple, cpu_s: float | None) -> tuple[str, Any, float]:
    if cpu_s is not None:
        _arm_cpu_limit(cpu_s)
    start = time.perf_counter()
    try:
        value = fn(*args)
    except BaseException as exc:  # sys.exit() in an env fails its call, as it does in the main process
        return "error", _text(exc), time.perf_counter() - start
    return "ok", value, time.perf_counter() - start


def _text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _limit(spec: WorkerSpec) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a crashing env leaves no core files about
    if spec.memory_mb is not None:
        limit = spec.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _arm_cpu_limit(cpu_s: float) -> None:
    """RLIMIT_CPU counts the process's whole life: set it to what is used so far plus one call's share."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + cpu_s)
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
