"""Reward functions and labelling: score finished episodes, one component per recipe reward, plus a total.

Every reward is called once per batch with all the episodes, the shape TRL uses, so a judge or a
reward model batches its forward passes. User functions get TRL's arguments (see docs/rewards.md),
so reward functions written for TRL work unchanged.

Importing this module stays cheap: torch and transformers load only when a recipe asks for a model.
"""

from __future__ import annotations

import difflib
import hashlib
import importlib
import importlib.util
import inspect
import math
import re
import reprlib
import string
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from pydantic import NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt, ValidationError, validate_call

from rlcli.errors import RlcliError, UsageError
from rlcli.recipe import RewardSpec

Episode = dict[str, Any]
Scorer = Callable[[list[Episode]], Any]

# Keyword arguments rlcli itself passes to user functions; a recipe's kwargs may not reuse them.
TRL_ARGUMENTS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric", "episodes")


@dataclass
class RewardFn:
    """One resolved reward component: call it with a batch of episodes, get one finite float per episode."""

    component: str
    fn: str
    weight: float
    scorer: Scorer

    @property
    def label(self) -> str:
        return _label(self.component, self.fn)

    @property
    def failures(self) -> dict[int, str]:
        """Episode id -> why the last call could not score that episode (it was scored 0.0 instead).

        Only the judge records failures (replies without a usable score); other rewards fail loudly.
        """
        return getattr(self.scorer, "failures", {})

    def __call__(self, episodes: list[Episode]) -> list[float]:
        try:
            values = self.scorer(episodes)
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

    def _finite(self, value: Any, episode: Episode) -> float:
        # None, strings and NaN are errors, not "no reward": a silent hole in the total would skew every
        # advantage in the group. (TRL reads None as "not applicable"; here that is a bug to fix.)
        number = None
        if value is not None and not isinstance(value, (str, bytes)):
            try:
                number = float(value)
            except (TypeError, ValueError):
                pass
        if number is None or not math.isfinite(number):
            raise RlcliError(
                f"Reward {self.label} returned {reprlib.repr(value)} for episode {episode['id']}; "
                "expected a finite number (None, strings, NaN and inf are errors)."
            )
        return number


def build_reward_fns(specs: list[RewardSpec], root: Path | None = None) -> list[RewardFn]:
    """Resolve every reward of a recipe once: import user code, load models, check kwargs.

    User files (path.py:function) and modules (module:function) are found relative to root, or to the
    working directory when root is None. Anything wrong is a UsageError naming the reward.
    """
    base = Path(root) if root is not None else Path.cwd()
    fns = []
    for spec in specs:
        label = _label(spec.component, spec.fn)
        if spec.component == "total":
            raise UsageError(f"Reward {label}: the name total is kept for the weighted sum; give it another name:.")
        try:
            scorer = _resolve(spec, base)
        except UsageError as exc:
            raise UsageError(f"Reward {label}: {exc}") from exc.__cause__
        fns.append(RewardFn(spec.component, spec.fn, spec.weight, scorer))
    return fns


def label_episodes(fns: list[RewardFn], episodes: list[Episode]) -> list[dict[str, float]]:
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


# --- resolving a spec ----------------------------------------------------------


def _resolve(spec: RewardSpec, base: Path) -> Scorer:
    if spec.fn in BUILTINS:
        factory = BUILTINS[spec.fn]
        try:
            return factory(**spec.kwargs)
        except ValidationError as exc:
            raise UsageError(_explain(exc, factory)) from None
    if ":" not in spec.fn:
        close = difflib.get_close_matches(spec.fn, BUILTINS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UsageError(
            f"unknown reward function{hint}; use one of {', '.join(BUILTINS)}, "
            "or your own as module:function or path.py:function."
        )
    return _user_function(spec, base)


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


def _user_function(spec: RewardSpec, base: Path) -> Scorer:
    target, _, name = spec.fn.rpartition(":")
    module = _load_file(base / target) if target.endswith(".py") else _import_module(target, base)
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

    def score(episodes: list[Episode]) -> Any:
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


def _task_columns(episodes: list[Episode]) -> dict[str, list[Any]]:
    """Task fields as TRL's dataset columns: one list per field, None where an episode's task lacks it."""
    fields = dict.fromkeys(key for ep in episodes for key in ep["task"])
    return {key: [ep["task"].get(key) for ep in episodes] for key in fields}


def _completion(episode: Episode, conversational: bool) -> Any:
    # TRL's conversational completions are the messages after the prompt (several for tool use).
    return episode["messages"][len(episode["prompt"]) :] if conversational else episode["completion"]


def _ignore(*args: Any, **kwargs: Any) -> None:
    """Stands in for TRL's log_extra/log_metric so functions that log still run; labels are stored, logs are not."""


def _load_file(path: Path) -> ModuleType:
    if not path.is_file():
        raise UsageError(f"file {path} does not exist.")
    # Named after the full path, so two rewards.py files in different folders do not replace each other.
    digest = hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]
    name = f"rlcli_reward_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # dataclasses and pickle look a module up by name
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise UsageError(f"loading {path} failed: {type(exc).__name__}: {exc}") from exc
    return module


def _import_module(target: str, base: Path) -> ModuleType:
    # A console script does not put the working directory on sys.path, yet a project's own reward
    # modules should import. Appended, so a local file never shadows an installed package.
    if str(base) not in sys.path:
        sys.path.append(str(base))
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise UsageError(f"cannot import module {target}: {type(exc).__name__}: {exc}") from exc


def _label(component: str, fn: str) -> str:
    return repr(component) if component == fn else f"{component!r} ({fn})"


def _ids(episodes: list[Episode]) -> str:
    ids = [str(ep["id"]) for ep in episodes]
    if len(ids) == 1:
        return f"episode {ids[0]}"
    shown = ", ".join(ids[:5])
    return f"episodes {shown}" + (f", ... ({len(ids)} in all)" if len(ids) > 5 else "")


# --- parsing answers -------------------------------------------------------------

ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# Thousands separators allowed; a minus sign right after a digit is a dash ("3-5" is 3 and 5).
NUMBER = re.compile(r"(?<![\d.])-?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)")


def parse_answer(text: str, parse: str) -> str | None:
    """The answer in a completion: the last <answer>...</answer>, the last number, or the whole text.

    None when there is no answer to find.
    """
    if parse == "answer_tag":
        tags = ANSWER_TAG.findall(text)
        return tags[-1] if tags else None
    if parse == "last_number":
        numbers = NUMBER.findall(text)
        return numbers[-1].replace(",", "") if numbers else None
    return text


def normalise(text: str) -> str:
    """Case and spacing do not count: 'Paris ' matches 'paris'."""
    return " ".join(text.split()).casefold()


def parse_score(text: str, scale: float) -> float:
    """A judge's score: the first number in its reply divided by scale.

    Raises ValueError, saying why, when the reply has no number or the first is outside [0, scale].
    """
    match = NUMBER.search(text)
    if match is None:
        raise ValueError(f"no number in the judge's reply {text!r}")
    value = float(match.group().replace(",", ""))
    if not 0 <= value <= scale:
        raise ValueError(f"score {value:g} is outside [0, {scale:g}] in the judge's reply {text!r}")
    return value / scale


def _task_value(episode: Episode, field: str) -> Any:
    task = episode["task"]
    if field not in task:
        raise ValueError(f"episode {episode['id']}'s task has no field {field!r} (it has: {', '.join(task) or 'none'})")
    return task[field]


# --- built-in rewards ---------------------------------------------------------------
# Each factory takes the spec's kwargs (validated by pydantic) and returns a scorer: episodes -> values.


@validate_call
def _env_return() -> Scorer:
    return lambda episodes: [ep["env_return"] for ep in episodes]


@validate_call
def _exact_match(
    *, field: str = "answer", parse: Literal["answer_tag", "last_number", "strip"] = "answer_tag"
) -> Scorer:
    def score(episodes: list[Episode]) -> list[float]:
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
    def score(episodes: list[Episode]) -> list[float]:
        values = []
        for ep in episodes:
            expected = _task_value(ep, field)
            try:
                expected = float(str(expected).replace(",", ""))
            except ValueError:
                raise ValueError(f"episode {ep['id']}'s task field {field!r} is {expected!r}, not a number") from None
            answer = parse_answer(ep["completion"], parse)
            numbers = NUMBER.findall(answer or "")  # answer_tag: the last number inside the tag
            matched = bool(numbers) and abs(float(numbers[-1].replace(",", "")) - expected) <= tol
            values.append(1.0 if matched else 0.0)
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

    def score(episodes: list[Episode]) -> list[float]:
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

    def score(episodes: list[Episode]) -> list[float]:
        return [max(-1.0, (free - ep["num_tokens"]) / cache) if ep["num_tokens"] > free else 0.0 for ep in episodes]

    return score


@validate_call
def _tool_budget(*, budget: NonNegativeInt, penalty: NonNegativeFloat = 1.0) -> Scorer:
    def score(episodes: list[Episode]) -> list[float]:
        return [penalty * (budget - ep["tool_calls"]) if ep["tool_calls"] > budget else 0.0 for ep in episodes]

    return score


DEFAULT_RUBRIC = """Rate the response to the request below from 0 (wrong or useless) to {scale} (fully correct).

Request:
{prompt}

Response:
{completion}

Reply with the number only."""


@validate_call
def _judge(
    *,
    model: str,
    rubric: str = DEFAULT_RUBRIC,
    max_new_tokens: PositiveInt = 8,
    scale: PositiveFloat = 10.0,
    batch_size: PositiveInt = 8,
) -> Scorer:
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(rubric) if name is not None}
    except ValueError as exc:
        raise UsageError(f"kwargs.rubric: {exc} (write a literal brace as {{{{ or }}}}).") from None
    if any(not name.isidentifier() for name in fields):
        raise UsageError("kwargs.rubric: placeholders must be names such as {prompt}, {completion} or a task field.")
    lm, tokenizer = _load_model(model, "AutoModelForCausalLM")
    tokenizer.padding_side = "left"  # generation continues from the right end of every row
    return Judge(lm, tokenizer, rubric, fields, max_new_tokens, scale, batch_size)


class Judge:
    """An LLM judge: greedy-decodes a score for each episode; unparseable replies score 0.0 and are recorded."""

    def __init__(
        self, lm, tokenizer, rubric: str, fields: set[str], max_new_tokens: int, scale: float, batch_size: int
    ):
        self.lm, self.tokenizer, self.rubric, self.fields = lm, tokenizer, rubric, fields
        self.max_new_tokens, self.scale, self.batch_size = max_new_tokens, scale, batch_size
        self.failures: dict[int, str] = {}

    def __call__(self, episodes: list[Episode]) -> list[float]:
        self.failures = {}
        requests = [self.request(ep) for ep in episodes]
        replies = []
        for start in range(0, len(requests), self.batch_size):
            replies += self.generate(requests[start : start + self.batch_size])
        scores = []
        for ep, reply in zip(episodes, replies):
            try:
                scores.append(parse_score(reply, self.scale))
            except ValueError as exc:
                self.failures[ep["id"]] = str(exc)
                scores.append(0.0)
        return scores

    def request(self, episode: Episode) -> str:
        """The rubric filled in for one episode."""
        values = {
            **episode["task"],
            "prompt": transcript(episode["prompt"]),
            "completion": episode["completion"],
            "scale": f"{self.scale:g}",
        }
        missing = sorted(self.fields - set(values))
        if missing:
            raise ValueError(
                f"the rubric names {', '.join(missing)}, which episode {episode['id']}'s task does not have "
                f"(it has: {', '.join(episode['task']) or 'none'})"
            )
        return self.rubric.format(**values)

    def generate(self, requests: list[str]) -> list[str]:
        import torch

        texts = [render(self.tokenizer, [{"role": "user", "content": r}], add_generation_prompt=True) for r in requests]
        inputs = _tokenize(self.tokenizer, texts).to(self.lm.device)
        with torch.inference_mode():
            output = self.lm.generate(
                **inputs, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.pad_token_id
            )
        return self.tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


@validate_call
def _reward_model(*, model: str, label: NonNegativeInt | None = None, batch_size: PositiveInt = 8) -> Scorer:
    import torch

    net, tokenizer = _load_model(model, "AutoModelForSequenceClassification")
    num_labels = net.config.num_labels
    if label is None and num_labels != 1:
        raise UsageError(f"{model} has {num_labels} labels; set kwargs.label to the index of the one to score.")
    if label is not None and label >= num_labels:
        raise UsageError(f"kwargs.label is {label} but {model} has only {num_labels} labels.")
    # The model reads its score at each row's last real token, which it finds through the pad id.
    net.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"

    def score(episodes: list[Episode]) -> list[float]:
        texts = [render(tokenizer, ep["messages"], add_generation_prompt=False) for ep in episodes]
        values = []
        for start in range(0, len(texts), batch_size):
            inputs = _tokenize(tokenizer, texts[start : start + batch_size]).to(net.device)
            with torch.inference_mode():
                values += net(**inputs).logits[:, label or 0].float().tolist()
        return values

    return score


BUILTINS: dict[str, Callable[..., Scorer]] = {
    "env_return": _env_return,
    "exact_match": _exact_match,
    "numeric_match": _numeric_match,
    "format": _format,
    "length_penalty": _length_penalty,
    "tool_budget": _tool_budget,
    "judge": _judge,
    "reward_model": _reward_model,
}


# --- models ---------------------------------------------------------------------------


def _load_model(model: str, auto_class: str):
    """A model and its tokenizer from a local folder, on the GPU when there is one, in eval mode."""
    path = Path(model)
    if not path.is_dir():
        raise UsageError(f"kwargs.model {model!r} is not a local model folder.")
    import torch
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        net = getattr(transformers, auto_class).from_pretrained(path)
    except Exception as exc:  # any failure to load is a bad model folder, whatever transformers raises
        raise UsageError(f"cannot load {path} as {auto_class}: {type(exc).__name__}: {exc}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # batches need padding; eos is the usual stand-in
    net.to("cuda" if torch.cuda.is_available() else "cpu").eval()
    return net, tokenizer


def transcript(messages: list[dict]) -> str:
    """Messages as plain 'role: text' lines, for rubrics and for tokenizers without a chat template."""
    return "\n".join(f"{m.get('role')}: {message_text(m)}" for m in messages)


def message_text(message: dict) -> str:
    content = message.get("content")
    if isinstance(content, list):  # multimodal content parts: keep the text ones
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return content or ""


def render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    if tokenizer.chat_template is None:
        return transcript(messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _tokenize(tokenizer, texts: list[str]):
    # A chat template writes its own special tokens; plain transcripts get the tokenizer's usual ones.
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=tokenizer.chat_template is None)
