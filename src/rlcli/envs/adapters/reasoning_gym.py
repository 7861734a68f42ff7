"""reasoning_gym:<dataset> - a reasoning-gym procedural task as a single-turn env, scored by its own verifier.

The task for seed s is item 0 of `reasoning_gym.create_dataset(dataset, seed=s, size=1, **kwargs)`:
deterministic, cheap, and different for every seed, so rlcli's train/eval seed split carries over.
The prompt is the dataset's question, with a system prompt asking for the answer in
<answer>...</answer> tags (`system_prompt`: a name from reasoning_gym.utils.SYSTEM_PROMPTS, or your
own text). The reply's last <answer> block is scored with the dataset's `score_answer`; reward =
that score in [0, 1], success = a full score. One turn ends the episode. `expert_action()` returns
the dataset's reference answer in tags.

Two guards against rewarding replies that only look like answers (both adapter options in env.kwargs):
- `strict_format` (default true): a reply without <answer> tags scores 0 and its feedback says why.
  false scores the whole reply instead, as rlcli 0.1 did - and reasoning-gym's verifiers then give
  credit to a reply that merely contains the answer among other text.
- `substring_credit` (default false): the generic verifier that a third of the datasets use (those
  that do not define their own) gives len(answer)/len(reply) when the reference answer is a
  substring of the reply: "25, 5" scores 0.2 for the answer 5, so echoing the question's numbers
  earns reward. rlcli scores those datasets 1 for the exact answer and 0 otherwise; true restores
  the fraction. Datasets with their own verifier keep its scores, partial credit included.

kwargs other than these go to the dataset's config (e.g. min_terms, max_digits for
basic_arithmetic); `seed` and `size` are set by the adapter. Limits: datasets whose items have no
single reference answer (answer None, e.g. rubiks_cube, boxnet) are scored fine but have no expert;
`composite` needs a list of datasets in its config and is best built as your own env file.
"""

from __future__ import annotations

import difflib
from typing import Any

import reasoning_gym
from reasoning_gym.dataset import ProceduralDataset
from reasoning_gym.factory import DATASETS
from reasoning_gym.utils import SYSTEM_PROMPTS

from rlcli.envs.parsing import parse_answer_tag
from rlcli.errors import UsageError

FULL_SCORE = 1.0 - 1e-6  # verifiers return floats; a rounding hair below 1.0 is still a full score


class ReasoningGymEnv:
    def __init__(
        self, dataset: str, system_prompt: str, config: dict[str, Any], strict_format: bool, substring_credit: bool
    ):
        self.dataset, self.system_prompt, self.config = dataset, system_prompt, config
        self.strict_format, self.substring_credit = strict_format, substring_credit
        self.entry: dict[str, Any] | None = None

    def reset(self, seed: int) -> tuple[list[dict[str, str]], dict[str, Any]]:
        self.data = reasoning_gym.create_dataset(self.dataset, seed=seed, size=1, **self.config)
        self.entry = self.data[0]
        messages = [
            {"role": "system", "content": self.system_prompt},
            {"role": "user", "content": self.entry["question"]},
        ]
        task = {
            "dataset": self.dataset,
            "question": self.entry["question"],
            "answer": self.entry["answer"],
            "metadata": self.entry.get("metadata", {}),
        }
        return messages, {"task": task}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        tagged = parse_answer_tag(action)
        if tagged is None and self.strict_format:
            feedback = (
                "Score 0: no <answer>...</answer> tags found, and only a tagged answer is scored. "
                "Put the final answer alone inside <answer></answer>."
            )
            info = {"success": False, "score": 0.0, "tagged": False, "format_error": "no <answer> tags"}
            return self._with_expected(feedback), 0.0, True, False, info
        score = self._score(tagged if tagged is not None else action.strip())
        success = score >= FULL_SCORE
        feedback = "Correct." if success else self._with_expected(f"Score {score:.2f}.")
        if tagged is None:
            feedback += " (No <answer>...</answer> tags found; the whole reply was scored.)"
        return feedback, score, True, False, {"success": success, "score": score, "tagged": tagged is not None}

    def _score(self, answer: str) -> float:
        if not self.substring_credit and type(self.data).score_answer is ProceduralDataset.score_answer:
            # The generic verifier's only partial credit is for containing the reference answer.
            return 1.0 if answer == self._current()["answer"] else 0.0
        try:
            return float(self.data.score_answer(answer, self._current()))
        except Exception:  # some verifiers raise on malformed answers: that is a wrong answer, not a crash
            return 0.0

    def _with_expected(self, feedback: str) -> str:
        answer = self._current()["answer"]
        if answer is None:
            return feedback
        return f"{feedback} The expected answer was: {answer}"

    def _current(self) -> dict[str, Any]:
        """The task that reset() drew."""
        if self.entry is None:
            raise RuntimeError("call reset() before step()")
        return self.entry

    def expert_action(self) -> str:
        if self.entry is None:
            raise RuntimeError("call reset() before expert_action()")
        if self.entry["answer"] is None:
            raise UsageError(f"reasoning_gym:{self.dataset} has no single reference answer, so no expert.")
        return f"<answer>{self.entry['answer']}</answer>"


def make_env(
    name: str, system_prompt: str = "default", strict_format: bool = True, substring_credit: bool = False, **config: Any
) -> ReasoningGymEnv:
    if name not in DATASETS:
        close = difflib.get_close_matches(name, DATASETS, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else f" Known: {', '.join(sorted(DATASETS))}."
        raise UsageError(f"reasoning_gym has no dataset {name!r}.{hint}")
    for option, value in (("strict_format", strict_format), ("substring_credit", substring_credit)):
        if not isinstance(value, bool):
            raise UsageError(f"env.kwargs.{option}: expected true or false, got {value!r}.")
    for reserved in ("seed", "size"):
        if reserved in config:
            raise UsageError(
                f"env.kwargs.{reserved} is set by the reasoning_gym adapter (one task per seed); remove it."
            )
    _, config_cls = DATASETS[name]
    try:
        config_obj = config_cls(seed=0, size=1, **config)
        if hasattr(config_obj, "validate"):
            config_obj.validate()
    except (TypeError, ValueError, AssertionError) as exc:
        raise UsageError(f"env.kwargs do not fit reasoning_gym:{name} ({config_cls.__name__}): {exc}") from None
    prompt = SYSTEM_PROMPTS.get(system_prompt, system_prompt)
    return ReasoningGymEnv(name, prompt, config, strict_format, substring_credit)
