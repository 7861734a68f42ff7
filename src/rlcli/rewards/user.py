"""A user's own reward function (path.py:function or module:function), called with TRL's arguments.

So reward functions written for TRL work unchanged: see docs/rewards.md for what they receive.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from rlcli.errors import UsageError
from rlcli.recipe import RewardSpec
from rlcli.rewards.episodes import EpisodeDict, Scorer
from rlcli.usercode import import_file

# Keyword arguments rlcli itself passes to user functions; a recipe's kwargs may not reuse them.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "episodes")


def user_function(spec: RewardSpec, base: Path) -> Scorer:
    """The scorer for spec.fn = target:name, with the recipe's kwargs as constants; user code is found from base."""
    target, _, name = spec.fn.rpartition(":")
    module = import_file(base / target) if target.endswith(".py") else _import_module(target, base)
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UsageError(f"{target} has no function {name!r}.")

    constants = dict(spec.kwargs)
    conversational = constants.pop("conversational", False)
    if not isinstance(conversational, bool):
        raise UsageError(f"kwargs.conversational must be true or false, got {conversational!r}.")
    reserved = sorted(set(constants) & set(TRL_ARGUMENTS))
    if reserved:
        raise UsageError(f"kwargs {', '.join(reserved)} are passed by rlcli itself; rename them.")

    # TRL requires **kwargs; a function without it still works here: it gets only the arguments it names.
    parameters = inspect.signature(fn).parameters.values()
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters)
    names = {p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if not takes_any:
        unknown = sorted({"completions", *constants} - names)
        if unknown:
            raise UsageError(f"{name} takes no argument {', '.join(unknown)}; add it or **kwargs to its signature.")

    def score(episodes: list[EpisodeDict]) -> Any:
        arguments = {
            **_task_columns(episodes),
            "prompts": [ep["prompt"] for ep in episodes],
            "completions": [_completion(ep, conversational) for ep in episodes],
            "completion_ids": None,  # rewards see text; episodes[i]["num_tokens"] gives lengths
            "trainer_state": None,  # labelling is not tied to a trainer step (relabelling happens later)
            "log_extra": _ignore,
            "log_metric": _ignore,
            "episodes": episodes,
            **constants,
        }
        if not takes_any:
            arguments = {key: value for key, value in arguments.items() if key in names}
        return fn(**arguments)

    return score


def _import_module(target: str, base: Path) -> ModuleType:
    # A console script does not put the working directory on sys.path, yet a project's own reward
    # modules should import. Appended, so a local file never shadows an installed package.
    if str(base) not in sys.path:
        sys.path.append(str(base))
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise UsageError(f"cannot import module {target}: {type(exc).__name__}: {exc}") from exc


def _task_columns(episodes: list[EpisodeDict]) -> dict[str, list[Any]]:
    """Task fields as TRL's dataset columns: one list per field, None where an episode's task lacks it."""
    fields = dict.fromkeys(key for ep in episodes for key in ep["task"])
    return {key: [ep["task"].get(key) for ep in episodes] for key in fields}


def _completion(episode: EpisodeDict, conversational: bool) -> Any:
    # TRL's conversational completions are the messages after the prompt (several for tool use).
    return episode["messages"][len(episode["prompt"]) :] if conversational else episode["completion"]


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Stands in for TRL's log_extra/log_metric so functions that log still run; labels are stored, logs are not."""
