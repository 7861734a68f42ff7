"""env.workers_backend: ray: the env workers of envs/workers.py as Ray actors, on this machine or a cluster.

Same contract as `EnvWorkerPool` (see envs/workers.py), so the rollout engine does not know which
one it talks to:
- each of env.workers actors builds the envs itself from the recipe's env.name and env.kwargs, with
  the main process's sys.path entries and working directory where they exist on its node (on a
  cluster, ship the env's files with `ray job submit --working-dir .` or install its package there);
- every reset and step is a remote method call; an actor gets its calls one at a time, in order:
  the next is sent when the last has answered, because Ray may lose the answer of a finished call
  when its actor dies right after, and a crash must fail the call that crashed, not the one before;
- a call that outlasts env.step_timeout_s gets its actor killed (`ray.kill`) and replaced, and
  the episode ends env_timeout; the actor's other envs are lost (`EnvLost`): the rollout engine
  plays their episodes again from their start, in the same stage, on whichever actor is free;
- env.isolation: episode gives each live env an actor of its own, as with worker processes;
- an actor that dies (a segfault, os._exit, the node going away) fails the episode whose call was
  running and loses its other envs; the stage goes on.

Ray is started here (a local Ray with env.workers CPUs, or a connection to env.ray_address or
RAY_ADDRESS) only when nothing in the process has started it yet. It then stays up for the
following stages of the run (starting it takes seconds) and is shut down when the process exits.
Ray is an optional dependency: `pip install 'rlcli[ray]'`.
"""

from __future__ import annotations

import atexit
import os
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from rlcli.envs.protocol import EnvFactory, EnvFailure
from rlcli.envs.tool_use import ToolUseSpec
from rlcli.envs.workers import RemoteEnvs, WorkerSpec, _handle, _Request, _text
from rlcli.errors import UsageError

START_TIMEOUT_S = 300.0  # how long the first actors may take to be placed and to build their env factory


def import_ray() -> ModuleType:
    """Ray, or one sentence saying how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise UsageError(
            f"env.workers_backend: ray needs Ray, which is not installed ({exc}): pip install 'rlcli[ray]'"
        ) from None
    return ray


class EnvActor:
    """One env worker, as a Ray actor: builds an env factory, then hosts envs by key."""

    def __init__(self, spec: WorkerSpec):
        # The main process's import paths and folder, where this node has them (a local Ray always
        # does); Ray's own paths stay, after them.
        mine = [p for p in spec.sys_path if p == "" or os.path.isdir(p)]
        sys.path[:] = mine + [p for p in sys.path if p not in mine]
        root = Path(spec.root)
        if root.is_dir():
            os.chdir(root)
        from rlcli.envs.loading import load_env

        self.cpu_s = spec.cpu_s
        self.envs: dict[int, Any] = {}
        self.factory: EnvFactory | None = None
        self.usage: str | None = None  # why the factory could not be built
        try:
            self.factory = load_env(spec.env_name, spec.env_kwargs, Path.cwd(), spec.tools)
        except UsageError as exc:
            self.usage = str(exc)

    def ready(self) -> str | None:
        """None, or why the env cannot be loaded here (a recipe mistake)."""
        return self.usage

    def call(self, op: str, key: int, arg: Any) -> tuple:
        """What `_handle` answers in a worker process, or ("usage", why)."""
        if self.factory is None:
            return ("usage", self.usage)
        try:
            return _handle(self.envs, self.factory, self.cpu_s, op, key, arg)
        except UsageError as exc:
            return ("usage", str(exc))

    def close(self, key: int) -> None:
        self.envs.pop(key, None)


@dataclass
class _Pending:
    request: _Request
    arg: Any
    ref: Any = None  # its remote call, once sent


@dataclass
class _Actor:
    slot: int
    handle: Any
    ready_ref: Any  # the pending `ready` call; None once it has answered
    queue: deque[_Pending] = field(default_factory=deque)  # asked and not answered yet, oldest first
    deadline: float | None = None  # when the call sent (the oldest) must be answered by
    hosted: set[int] = field(default_factory=set)


class RayEnvHost(RemoteEnvs[_Actor]):
    """env.workers_backend: ray: envs in env.workers Ray actors (see the module docstring)."""

    def __init__(
        self,
        env_name: str,
        env_kwargs: dict,
        workers: int,
        timeout_s: float,
        address: str | None = None,
        cpu_s: float | None = None,
        root: Path | None = None,
        isolation: str = "worker",
        tools: ToolUseSpec | None = None,
    ):
        super().__init__(isolation)
        self.ray = import_ray()
        _start_ray(self.ray, address, workers)
        self.spec = WorkerSpec(
            env_name, dict(env_kwargs), str(root or Path.cwd()), list(sys.path), os.getpid(), None, cpu_s, tools
        )
        self.timeout_s = timeout_s
        # One CPU each, so that Ray spreads the actors over free cores; no restarts and no retries:
        # a dead actor is replaced here, and its calls fail as in a worker process.
        self.actor_class = self.ray.remote(num_cpus=1, max_restarts=0, max_task_retries=0)(EnvActor)
        self.actors: list[_Actor] = []
        try:
            self.actors = [self._start(slot) for slot in range(workers)]
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def slots(self) -> list[_Actor]:
        return self.actors

    def close(self) -> None:
        for actor in self.actors:
            self.ray.kill(actor.handle, no_restart=True)
        self.actors = []

    # --- plumbing ---------------------------------------------------------------

    def _start(self, slot: int) -> _Actor:
        handle = self.actor_class.remote(self.spec)
        return _Actor(slot, handle, handle.ready.remote())

    def _wait_ready(self) -> None:
        """Wait for the first actors: a cluster without free CPUs for them, or an env that cannot be
        loaded, is a clear error now rather than a stage that hangs."""
        refs = [a.ready_ref for a in self.actors]
        _, pending = self.ray.wait(refs, num_returns=len(refs), timeout=START_TIMEOUT_S)
        if pending:
            raise UsageError(
                f"{len(pending)} of env.workers={len(refs)} Ray actors did not start within {START_TIMEOUT_S:g}s: "
                "does the Ray cluster have a free CPU for each?"
            )
        for actor in self.actors:
            self._check_ready(actor)

    def _check_ready(self, actor: _Actor) -> None:
        try:
            usage = self.ray.get(actor.ready_ref)
        except self.ray.exceptions.RayError as exc:
            raise UsageError(
                f"a Ray env actor for env.name {self.spec.env_name!r} stopped before it was ready: {_short(exc)}"
            ) from None
        if usage is not None:
            raise UsageError(usage)
        actor.ready_ref = None
        self._send_next(actor)

    def _wait(self, timeout: float | None) -> None:
        """Until an actor with calls answers its running one (or its `ready`), or `timeout` seconds."""
        refs = [a.ready_ref if a.ready_ref is not None else a.queue[0].ref for a in self.actors if a.queue]
        self.ray.wait(refs, num_returns=1, timeout=timeout)

    def _asked(self, actor: _Actor) -> list[_Request]:
        return [p.request for p in actor.queue]

    def _stop(self, actor: _Actor) -> None:
        self.ray.kill(actor.handle, no_restart=True)

    def _close(self, actor: _Actor, key: int) -> None:
        actor.handle.close.remote(key)  # no answer needed; a dead actor just drops it

    def _send(self, actor: _Actor, request: _Request, arg: Any) -> None:
        actor.queue.append(_Pending(request, arg))
        self._send_next(actor)

    def _send_next(self, actor: _Actor) -> None:
        """Send the oldest call unless one is running (or the actor is not ready yet)."""
        if actor.ready_ref is None and actor.queue and actor.queue[0].ref is None:
            head = actor.queue[0]
            head.ref = actor.handle.call.remote(head.request.op, head.request.key, head.arg)
            actor.deadline = time.monotonic() + self.timeout_s

    def _read(self, actor: _Actor) -> None:
        """Take in every answer the actor has given, in order; notice if it died."""
        if actor.ready_ref is not None:
            if not self.ray.wait([actor.ready_ref], timeout=0)[0]:
                return
            self._check_ready(actor)
        while actor.queue and self.ray.wait([actor.queue[0].ref], timeout=0)[0]:
            request = actor.queue[0].request
            try:
                message = self.ray.get(actor.queue[0].ref)
            except self.ray.exceptions.RayActorError as exc:
                why = f"its env worker (a Ray actor) died: {_short(exc)}"
                if self.spec.cpu_s is not None:  # Ray does not say which signal: name the likely one
                    why += f" (a crash, or more than env.worker_cpu_s={self.spec.cpu_s:g} CPU seconds)"
                self._replace(actor, EnvFailure(why), "crashed")
                return
            except self.ray.exceptions.RayError as exc:  # the answer could not be carried back
                verb = "reset" if request.op == "reset" else "step"
                message = (request.key, "error", f"its result cannot be sent from the env worker: {_text(exc)}")
                message += (verb, 0.0, "", 0.0)
            if message[0] == "usage":
                raise UsageError(message[1])
            actor.queue.popleft()
            actor.deadline = None
            self._send_next(actor)
            self._answer(request, message)


def _start_ray(ray: ModuleType, address: str | None, workers: int) -> None:
    """Start or join Ray unless this process already has (a caller's own ray.init comes first)."""
    if ray.is_initialized():
        return
    # Joining a cluster: it has its CPUs already. A local Ray: CPUs for the actors, however many cores.
    local = address is None and not os.environ.get("RAY_ADDRESS")
    try:
        ray.init(
            address=address,
            # Two logical CPUs per actor: a replaced actor's CPU is freed some time after the kill,
            # and its replacement must not wait for it.
            num_cpus=2 * workers if local else None,
            include_dashboard=False,
            log_to_driver=False,
        )
    except ConnectionError as exc:
        raise UsageError(f"cannot connect to the Ray cluster at env.ray_address {address!r}: {exc}") from None
    atexit.register(ray.shutdown)


def _short(exc: BaseException) -> str:
    """Ray's errors run to many lines of cluster detail: the first one says what happened."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
