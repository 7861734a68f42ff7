"""The environment contract, and how the rollout engine holds an env to it.

An environment is any object with
    reset(seed) -> (observation, info)
    step(action_text) -> (observation, reward, terminated, truncated, info)
in the spirit of gymnasium. An observation is chat content: a string (one user message) or a
list of message dicts ({"role": "system" | "user" | "tool", "content": ...}). `info["task"]`
from reset carries the task fields that reward functions read; `info["success"]` from step is
the episode's verdict. Optional: `tools` (function specs for the chat template),
`expert_action()` (a scripted action that solves the task, for demonstrations).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from rlcli.errors import UsageError


class Env(Protocol):
    """What every environment provides; the optional `tools` and `expert_action()` are looked up with getattr."""

    def reset(self, seed: int) -> tuple[Any, dict]: ...

    def step(self, action: str) -> tuple[Any, float, bool, bool, dict]: ...


EnvFactory = Callable[[], Env]  # makes a fresh env for each episode


class EnvFailure(Exception):
    """An environment raised, returned garbage, or took too long; the episode fails, the stage goes on."""


class EnvTimeout(EnvFailure):
    """An env call outlasted env.step_timeout_s. Under load this need not happen again, so a resumed
    stage plays the episode again (see engine/rollout.py)."""


def as_messages(observation: Any) -> list[dict]:
    if observation is None:
        return []
    if isinstance(observation, str):
        return [{"role": "user", "content": observation}]
    if isinstance(observation, dict):
        observation = [observation]
    if isinstance(observation, list) and all(isinstance(m, dict) and "role" in m for m in observation):
        return [dict(m) for m in observation]
    raise EnvFailure(f"observation must be a string or a list of chat messages, got {type(observation).__name__}")


def run_in_thread(fn: Callable[..., Any], timeout_s: float, /, *args: Any, **kwargs: Any) -> tuple[str, Any]:
    """fn(*args, **kwargs) in a daemon thread, waited for up to timeout_s: ("value", what it returned),
    ("error", what it raised), or ("running", None) past the limit: the thread goes on, since Python
    cannot stop one."""
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # the callee's own failure, for the caller to report
            outcome["error"] = exc

    worker = threading.Thread(target=target, name=getattr(fn, "__name__", "call"), daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        return "running", None
    return ("error", outcome["error"]) if "error" in outcome else ("value", outcome["value"])


def call_with_timeout(fn: Callable, timeout_s: float, *args: Any) -> Any:
    """Run an env call in a worker thread; a raise or a time-out becomes EnvFailure."""
    status, value = run_in_thread(fn, timeout_s, *args)
    if status == "running":
        raise EnvTimeout(f"{getattr(fn, '__name__', 'env call')} exceeded the {timeout_s:g}s step time limit")
    if status == "error":
        raise EnvFailure(f"{type(value).__name__}: {value}")
    return value


def task_seed(split: str, index: int, eval_seed_start: int = 1_000_000) -> int:
    """Train tasks use seeds [0, eval_seed_start), eval tasks [eval_seed_start, ...): disjoint by construction."""
    if split == "train":
        if index >= eval_seed_start:
            raise UsageError(f"Train task {index} would reach the eval seeds (env.eval_seed_start={eval_seed_start}).")
        return index
    if split == "eval":
        return eval_seed_start + index
    raise UsageError(f"Unknown task split {split!r}: expected train or eval.")
