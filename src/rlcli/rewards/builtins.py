"""The built-in rewards that recipes name (fn: numeric_match), and how they read answers.

Each factory takes the spec's kwargs (validated by pydantic) and returns a scorer: episodes -> values.
The model-based ones, judge, judge_group and reward_model, live in judge.py.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Literal

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveInt, validate_call

from rlcli.envs.parsing import find_numbers, parse_answer_tag
from rlcli.errors import UsageError
from rlcli.rewards.episodes import EpisodeDict, Scorer
from rlcli.rewards.judge import judge, judge_group, reward_model


def parse_answer(text: str, parse: str) -> str | None:
    """The answer in a completion: the last <answer>...</answer>, the last number, or the whole text.

    None when there is no answer to find.
    """
    if parse == "answer_tag":
        return parse_answer_tag(text)
    if parse == "last_number":
        numbers = find_numbers(text)
        return numbers[-1] if numbers else None
    return text


def normalise(text: str) -> str:
    """Case and spacing do not count: 'Paris ' matches 'paris'."""
    return " ".join(text.split()).casefold()


def _task_value(episode: EpisodeDict, field: str) -> Any:
    task = episode["task"]
    if field not in task:
        raise ValueError(f"episode {episode['id']}'s task has no field {field!r} (it has: {', '.join(task) or 'none'})")
    return task[field]


@validate_call
def _env_return() -> Scorer:
    return lambda episodes: [ep["env_return"] for ep in episodes]


@validate_call
def _exact_match(
    *, field: str = "answer", parse: Literal["answer_tag", "last_number", "strip"] = "answer_tag"
) -> Scorer:
    def score(episodes: list[EpisodeDict]) -> list[float]:
        values = []
        for ep in episodes:
            expected = normalise(str(_task_value(ep, field)))
            answer = parse_answer(ep["completion"], parse)
            values.append(1.0 if answer is not None and normalise(answer) == expected else 0.0)
        return values

    return score


@validate_call
def _numeric_match(
    *, field: str = "answer", parse: Literal["answer_tag", "last_number"] = "last_number", tol: NonNegativeFloat = 1e-6
) -> Scorer:
    def score(episodes: list[EpisodeDict]) -> list[float]:
        values = []
        for ep in episodes:
            expected = _task_value(ep, field)
            try:
                expected = float(str(expected).replace(",", ""))
            except ValueError:
                raise ValueError(f"episode {ep['id']}'s task field {field!r} is {expected!r}, not a number") from None
            numbers = find_numbers(parse_answer(ep["completion"], parse) or "")  # answer_tag: the last number inside
            values.append(1.0 if numbers and abs(float(numbers[-1]) - expected) <= tol else 0.0)
        return values

    return score


@validate_call
def _format(*, pattern: str, all_turns: bool = False, fullmatch: bool = True) -> Scorer:
    try:
        # DOTALL: completions span lines, and a format like <think>.*</think> should too.
        regex = re.compile(pattern, re.DOTALL)
    except re.error as exc:
        raise UsageError(f"kwargs.pattern is not a valid regular expression: {exc}.") from None
    # Surrounding whitespace (a trailing newline) is not part of a format.
    matches = (lambda text: regex.fullmatch(text.strip())) if fullmatch else regex.search

    def score(episodes: list[EpisodeDict]) -> list[float]:
        values = []
        for ep in episodes:
            texts = ep["completions"] if all_turns else [ep["completion"]]
            values.append(1.0 if texts and all(matches(text) for text in texts) else 0.0)
        return values

    return score


@validate_call
def _length_penalty(*, max_tokens: PositiveInt, cache: PositiveInt) -> Scorer:
    """DAPO's soft overlong punishment: 0 up to max_tokens - cache, then linear down to -1 at max_tokens."""
    if cache > max_tokens:
        raise UsageError(f"kwargs.cache ({cache}) must not exceed kwargs.max_tokens ({max_tokens}).")
    free = max_tokens - cache

    def score(episodes: list[EpisodeDict]) -> list[float]:
        return [max(-1.0, (free - ep["num_tokens"]) / cache) if ep["num_tokens"] > free else 0.0 for ep in episodes]

    return score


@validate_call
def _tool_budget(*, budget: NonNegativeInt, penalty: NonNegativeFloat = 1.0) -> Scorer:
    def score(episodes: list[EpisodeDict]) -> list[float]:
        return [penalty * (budget - ep["tool_calls"]) if ep["tool_calls"] > budget else 0.0 for ep in episodes]

    return score


@validate_call
def _turn_budget(*, budget: NonNegativeInt, penalty: NonNegativeFloat = 0.1) -> Scorer:
    """-penalty per agent turn beyond budget: of two episodes that end alike, the shorter scores higher,
    so a group whose episodes all succeed (or all fail) still has a contrast when their lengths differ."""

    def score(episodes: list[EpisodeDict]) -> list[float]:
        return [penalty * (budget - ep["num_turns"]) if ep["num_turns"] > budget else 0.0 for ep in episodes]

    return score


@validate_call
def _verifiers(*, reward: str | None = None) -> Scorer:
    """A verifiers env's rubric, re-scored from the stored conversation (envs/adapters/verifiers.py)."""
    try:
        from rlcli.envs.adapters.verifiers import rubric_scorer
    except ModuleNotFoundError as exc:
        raise UsageError(
            f"The verifiers reward needs the {exc.name!r} package: pip install 'rlcli[verifiers]'."
        ) from None
    return rubric_scorer(reward)


BUILTINS: dict[str, Callable[..., Scorer]] = {
    "env_return": _env_return,
    "exact_match": _exact_match,
    "numeric_match": _numeric_match,
    "format": _format,
    "length_penalty": _length_penalty,
    "tool_budget": _tool_budget,
    "turn_budget": _turn_budget,
    "judge": judge,
    "judge_group": judge_group,
    "reward_model": reward_model,
    "verifiers": _verifiers,
}
