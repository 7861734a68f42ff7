"""Scoring episodes with a recipe's rewards: one component per reward, plus their weighted total.

Every reward is called once per batch with all the episodes, the shape TRL uses, so a judge or a
reward model batches its forward passes.
"""

from __future__ import annotations

import contextlib
import difflib
import inspect
import math
import reprlib
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rlcli.errors import RlcliError, UsageError
from rlcli.recipe import RewardSpec
from rlcli.rewards.builtins import BUILTINS
from rlcli.rewards.episodes import EpisodeDict, Scorer
from rlcli.rewards.user import user_function


class RewardTimeout(RlcliError):
    """A reward function's call outlasted its timeout_s."""


@dataclass
class RewardFn:
    """One resolved reward component: call it with a batch of episodes, get one finite float per episode."""

    component: str
    fn: str
    weight: float
    scorer: Scorer
    timeout_s: float | None = None  # the recipe's rewards[i].timeout_s; None: no limit

    @property
    def label(self) -> str:
        return _label(self.component, self.fn)

    @property
    def failures(self) -> dict[int, str]:
        """Episode id -> why the last call could not score that episode (it was scored 0.0 instead).

        Only the judge records failures (replies without a usable score); other rewards fail loudly.
        """
        return getattr(self.scorer, "failures", {})

    def __call__(self, episodes: list[EpisodeDict]) -> list[float]:
        try:
            values = self._call(episodes)
        except RewardTimeout:
            raise
        except Exception as exc:
            raise RlcliError(f"Reward {self.label} failed on {_ids(episodes)}: {type(exc).__name__}: {exc}") from exc
        if values is None or isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
            raise RlcliError(
                f"Reward {self.label} returned {reprlib.repr(values)} for {_ids(episodes)}; "
                f"expected a list of {len(episodes)} numbers."
            )
        values = list(values)
        if len(values) != len(episodes):
            raise RlcliError(
                f"Reward {self.label} returned the wrong number of values for {_ids(episodes)}: "
                f"expected {len(episodes)}, got {len(values)}."
            )
        return [self._finite(value, episode) for value, episode in zip(values, episodes)]

    def _call(self, episodes: list[EpisodeDict]) -> Any:
        """The scorer's answer, within timeout_s: a late call fails as a raising one does. Python cannot
        stop a thread, so the late call runs on, in a daemon thread, until the command exits."""
        if self.timeout_s is None:
            return self.scorer(episodes)
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                outcome["value"] = self.scorer(episodes)
            except BaseException as exc:  # re-raised below, in the caller's thread
                outcome["error"] = exc

        thread = threading.Thread(target=target, name=f"reward-{self.component}", daemon=True)
        thread.start()
        thread.join(self.timeout_s)
        if thread.is_alive():
            raise RewardTimeout(
                f"Reward {self.label} exceeded its {self.timeout_s:g}s time limit on {_ids(episodes)} "
                "(rewards[].timeout_s); make it faster, or raise its timeout_s (null: no limit)."
            )
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _finite(self, value: Any, episode: EpisodeDict) -> float:
        # None, strings and NaN are errors, not "no reward": a silent hole in the total would skew every
        # advantage in the group. (TRL reads None as "not applicable"; here that is a bug to fix.)
        number = None
        if value is not None and not isinstance(value, (str, bytes)):
            with contextlib.suppress(TypeError, ValueError):
                number = float(value)
        if number is None or not math.isfinite(number):
            raise RlcliError(
                f"Reward {self.label} returned {reprlib.repr(value)} for episode {episode['id']}; "
                "expected a finite number (None, strings, NaN and inf are errors)."
            )
        return number


def build_reward_fns(specs: list[RewardSpec], root: Path | None = None, device: str = "auto") -> list[RewardFn]:
    """Resolve every reward of a recipe once: import user code, load models, check kwargs.

    User files (path.py:function) and modules (module:function) are found relative to root, or to the
    working directory when root is None. Model-based rewards load on device (the recipe's model.device)
    unless their kwargs name one. Anything wrong is a UsageError naming the reward.
    """
    base = Path(root) if root is not None else Path.cwd()
    fns = []
    for spec in specs:
        label = _label(spec.component, spec.fn)
        if spec.component == "total":
            raise UsageError(f"Reward {label}: the name total is kept for the weighted sum; give it another name:.")
        try:
            scorer = _resolve(spec, base, device)
        except UsageError as exc:
            raise UsageError(f"Reward {label}: {exc}") from exc.__cause__
        fns.append(RewardFn(spec.component, spec.fn, spec.weight, scorer, spec.timeout_s))
    return fns


def check_reward_fns(specs: list[RewardSpec], root: Path | None = None) -> None:
    """Resolve every reward that needs no model (a name, user code, kwargs), as build_reward_fns
    would: a misspelt one is refused before a command writes anything. Loading a judge or reward
    model is the stage's work; those are checked when the stage builds them."""
    build_reward_fns([s for s in specs if not _loads_a_model(s)], root)


def _loads_a_model(spec: RewardSpec) -> bool:
    return spec.fn in BUILTINS and "device" in inspect.signature(BUILTINS[spec.fn]).parameters


def label_episodes(fns: list[RewardFn], episodes: list[EpisodeDict]) -> list[dict[str, float]]:
    """For each episode, every component's value and their weighted sum under "total".

    Each reward is called once with the whole batch. After the call, `fn.failures` lists the
    episodes a reward could not score (see RewardFn.failures).
    """
    if not episodes:  # TRL never calls reward functions with an empty batch; user code may rely on that
        return []
    columns = {fn.component: fn(episodes) for fn in fns}
    labels = []
    for i in range(len(episodes)):
        values = {component: column[i] for component, column in columns.items()}
        values["total"] = sum(fn.weight * values[fn.component] for fn in fns)
        labels.append(values)
    return labels


def _resolve(spec: RewardSpec, base: Path, device: str) -> Scorer:
    if spec.fn in BUILTINS:
        factory = BUILTINS[spec.fn]
        kwargs = spec.kwargs
        if "device" in inspect.signature(factory).parameters:
            kwargs = {"device": device, **kwargs}
        try:
            return factory(**kwargs)
        except ValidationError as exc:
            raise UsageError(_explain(exc, factory)) from None
    if ":" not in spec.fn:
        close = difflib.get_close_matches(spec.fn, BUILTINS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(
            f"unknown reward function{hint}; use one of {', '.join(BUILTINS)}, "
            "or your own as module:function or path.py:function."
        )
    return user_function(spec, base)


def _explain(exc: ValidationError, factory: Callable) -> str:
    accepted = ", ".join(inspect.signature(factory).parameters) or "none"
    messages = []
    for err in exc.errors():
        name = ".".join(str(part) for part in err["loc"])
        if err["type"] == "unexpected_keyword_argument":
            messages.append(f"unknown kwarg {name} (accepted: {accepted})")
        elif err["type"].startswith("missing"):
            messages.append(f"kwargs.{name} is required")
        else:
            messages.append(f"kwargs.{name}: {err['msg']}, got {err['input']!r}")
    return "; ".join(messages) + "."


def _label(component: str, fn: str) -> str:
    return repr(component) if component == fn else f"{component!r} ({fn})"


def _ids(episodes: list[EpisodeDict]) -> str:
    ids = [str(ep["id"]) for ep in episodes]
    if len(ids) == 1:
        return f"episode {ids[0]}"
    shown = ", ".join(ids[:5])
    return f"episodes {shown}" + (f", ... ({len(ids)} in all)" if len(ids) > 5 else "")
