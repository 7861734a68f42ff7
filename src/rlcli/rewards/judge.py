"""Model-based rewards: an LLM judge that writes a score, a group judge that scores a group's episodes
against each other, and a reward model that computes a score.

A local model folder is loaded once, when the recipe's rewards are built, on the device they are
given (the recipe's model.device); torch and transformers are imported only then, so importing this
module stays cheap.

A local judge generates through the same seam as rollouts (generation/sampler.py's Sampler: token-id
prompts in, sampled ids out, a seed per episode), with the HF engine: greedy, batched, and correct on
any device. Not with vLLM: an in-process vLLM engine is one per process, and the policy's holds it.
With `base_url`, a judge is any OpenAI-compatible API instead (a hosted model, a vLLM server, or
`rlcli serve`), called with the `openai` package, `batch_size` requests at a time, at temperature 0.

The group judge follows ART's RULER: the judge reads all the episodes of one task together (a GRPO
group) and scores each relative to the others, which a judge does more consistently than scoring each
alone; GRPO's advantages only use the differences within a group anyway.
"""

from __future__ import annotations

import json
import os
import re
import string
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, cast

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, validate_call

from rlcli.envs.parsing import find_numbers
from rlcli.errors import UsageError
from rlcli.generation.sampler import Sampler, SamplingConfig
from rlcli.generation.seeds import derive_seed
from rlcli.rewards.episodes import EpisodeDict, Scorer, transcript

if TYPE_CHECKING:
    from transformers import BatchEncoding, PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

DEFAULT_RUBRIC = """Rate the response to the request below from 0 (wrong or useless) to {scale} (fully correct).

Request:
{prompt}

Response:
{completion}

Reply with the number only."""

GROUP_RUBRIC = """Several attempts at the same task follow. Compare them with each other and score each one \
from 0 (worst) to {scale} (best): a better attempt gets a higher score.

Task:
{prompt}

{trajectories}

Reply with one line per attempt, in the form "<attempt number>: <score>", and nothing else."""


@validate_call
def judge(
    *,
    model: str,
    rubric: str = DEFAULT_RUBRIC,
    max_new_tokens: PositiveInt = 8,
    scale: PositiveFloat = 10.0,
    batch_size: PositiveInt = 8,
    device: str = "auto",
    base_url: str | None = None,
    api_key_env: str | None = "OPENAI_API_KEY",
) -> Scorer:
    return _rubric_judge(model, rubric, max_new_tokens, scale, batch_size, device, base_url, api_key_env)


@validate_call
def judge_group(
    *,
    model: str,
    rubric: str = GROUP_RUBRIC,
    max_new_tokens: PositiveInt = 64,
    scale: PositiveFloat = 10.0,
    batch_size: PositiveInt = 8,
    device: str = "auto",
    base_url: str | None = None,
    api_key_env: str | None = "OPENAI_API_KEY",
) -> Scorer:
    return GroupJudge(_rubric_judge(model, rubric, max_new_tokens, scale, batch_size, device, base_url, api_key_env))


def _rubric_judge(
    model: str,
    rubric: str,
    max_new_tokens: int,
    scale: float,
    batch_size: int,
    device: str,
    base_url: str | None,
    api_key_env: str | None,
) -> RubricJudge:
    """The judge the kwargs describe: the API at base_url, or else the local model folder `model`."""
    fields = _rubric_fields(rubric)
    if base_url is not None:
        return ApiJudge(base_url, model, _api_key(api_key_env), rubric, fields, max_new_tokens, scale, batch_size)
    lm, tokenizer = _load_model(model, "AutoModelForCausalLM", device)
    return Judge(lm, tokenizer, rubric, fields, max_new_tokens, scale, batch_size)


def _rubric_fields(rubric: str) -> set[str]:
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(rubric) if name is not None}
    except ValueError as exc:
        raise UsageError(f"kwargs.rubric: {exc} (write a literal brace as {{{{ or }}}}).") from None
    if any(not name.isidentifier() for name in fields):
        raise UsageError("kwargs.rubric: placeholders must be names such as {prompt}, {completion} or a task field.")
    return fields


def _api_key(variable: str | None) -> str:
    """The API key from the environment variable `variable` (kwargs.api_key_env): never from the recipe,
    which is stored in the run database and shared. None: a server that takes no key."""
    if variable is None:
        return "unused"  # the openai client insists on some key
    key = os.environ.get(variable)
    if not key:
        raise UsageError(
            f"kwargs.api_key_env: the environment variable {variable} is not set; set it to the API's key (any "
            "value for a server that takes none, such as rlcli serve), or set api_key_env: null."
        )
    return key


class RubricJudge:
    """What a judge does whatever model replies: fill the rubric in per episode, ask in batches, read a
    score; unparseable replies score 0.0 and are recorded in `failures`, as are requests cut to fit the
    model. `generate` (one reply per request) is the local model's or the API's."""

    rubric: str
    fields: set[str]
    scale: float
    batch_size: int
    failures: dict[int, str]

    def generate(self, requests: list[str], episode_ids: list[int]) -> list[str]:
        raise NotImplementedError

    def __call__(self, episodes: list[EpisodeDict]) -> list[float]:
        self.failures = {}
        requests = [self.request(ep) for ep in episodes]
        replies = []
        for start in range(0, len(requests), self.batch_size):
            batch = episodes[start : start + self.batch_size]
            replies += self.generate(requests[start : start + self.batch_size], [ep["id"] for ep in batch])
        scores = []
        for ep, reply in zip(episodes, replies):
            try:
                scores.append(parse_score(reply, self.scale))
            except ValueError as exc:
                self.failures[ep["id"]] = "; ".join(filter(None, [self.failures.get(ep["id"]), str(exc)]))
                scores.append(0.0)
        return scores

    def request(self, episode: EpisodeDict) -> str:
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


class Judge(RubricJudge):
    """A judge on a local model: greedy-decodes a reply for each request."""

    def __init__(
        self,
        lm: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        rubric: str,
        fields: set[str],
        max_new_tokens: int,
        scale: float,
        batch_size: int,
    ):
        from rlcli.generation.hf_sampler import HfSampler  # imports torch: only when a judge is built

        self.lm, self.tokenizer, self.rubric, self.fields = lm, tokenizer, rubric, fields
        self.max_new_tokens, self.scale, self.batch_size = max_new_tokens, scale, batch_size
        # Greedy: a score must not depend on a draw. (A vLLM judge would need a second process: see above.)
        self.sampler: Sampler = HfSampler(lm, tokenizer, SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens))
        self.failures = {}
        limit = input_limit(tokenizer, lm.config)
        # The reply needs positions too; a model too short for even that gets the whole limit.
        self.max_prompt_tokens = None if limit is None else max(limit - max_new_tokens, 1)

    def generate(self, requests: list[str], episode_ids: list[int]) -> list[str]:
        """The judge's reply to each request, decoded; a request is one episode's filled-in rubric."""
        texts = [
            _render(self.tokenizer, [{"role": "user", "content": r}], add_generation_prompt=True) for r in requests
        ]
        prompts = _token_rows(self.tokenizer, texts, self.max_prompt_tokens, episode_ids, self.failures)
        # Greedy decoding draws nothing, but the seam gives every episode its own stream all the same.
        self.sampler.start([derive_seed("judge", episode_id) for episode_id in episode_ids])
        samples = self.sampler.sample(list(range(len(prompts))), prompts, [self.max_new_tokens] * len(prompts))
        return self.tokenizer.batch_decode([sample.ids for sample in samples], skip_special_tokens=True)


class ApiJudge(RubricJudge):
    """A judge behind an OpenAI-compatible API: one chat completion per request, a batch's requests at
    once (a server batches them), at temperature 0. A failed call (after the client's own retries) fails
    the labelling, naming the reward: a judge that cannot be reached must not score zeros."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str,
        rubric: str,
        fields: set[str],
        max_new_tokens: int,
        scale: float,
        batch_size: int,
    ):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key)
        self.model, self.rubric, self.fields = model, rubric, fields
        self.max_new_tokens, self.scale, self.batch_size = max_new_tokens, scale, batch_size
        self.failures = {}

    def generate(self, requests: list[str], episode_ids: list[int]) -> list[str]:
        def ask(request: str) -> str:
            reply = self.client.chat.completions.create(
                model=self.model,
                messages=[{"role": "user", "content": request}],
                temperature=0.0,
                max_tokens=self.max_new_tokens,
            )
            return reply.choices[0].message.content or ""

        with ThreadPoolExecutor(max_workers=max(len(requests), 1)) as pool:
            return list(pool.map(ask, requests))


class GroupJudge:
    """Scores the episodes of each task (a group: same task fields) against each other, one judge request
    per group; an episode whose score the reply lacks or gives out of range scores 0.0, in `failures`."""

    def __init__(self, replier: RubricJudge):
        self.replier = replier
        self.failures: dict[int, str] = {}

    def __call__(self, episodes: list[EpisodeDict]) -> list[float]:
        self.failures = {}
        groups: dict[str, list[int]] = {}  # task -> indices into episodes, in order
        for i, ep in enumerate(episodes):
            groups.setdefault(json.dumps(ep["task"], sort_keys=True, default=str), []).append(i)
        members = list(groups.values())
        requests = [self.request([episodes[i] for i in group]) for group in members]
        leaders = [episodes[group[0]]["id"] for group in members]
        replier = self.replier
        replier.failures = {}
        replies: list[str] = []
        for start in range(0, len(requests), replier.batch_size):
            end = start + replier.batch_size
            replies += replier.generate(requests[start:end], leaders[start:end])
        scores = [0.0] * len(episodes)
        for group, leader, reply in zip(members, leaders, replies):
            found = parse_group_scores(reply, len(group), replier.scale)
            for number, i in enumerate(group, start=1):
                value = found.get(number, f"no score for attempt {number} in the judge's reply {reply!r}")
                problem = value if isinstance(value, str) else None
                scores[i] = value if isinstance(value, float) else 0.0
                # The group's request cut to fit the model is noted under its first episode: told to all.
                note = "; ".join(filter(None, [replier.failures.get(leader), problem]))
                if note:
                    self.failures[episodes[i]["id"]] = note
        return scores

    def request(self, group: list[EpisodeDict]) -> str:
        """The rubric filled in for one group: its shared prompt, then each episode's turns, numbered."""
        first = group[0]
        attempts = [
            f"Attempt {n}:\n{transcript(ep['messages'][len(ep['prompt']) :])}" for n, ep in enumerate(group, start=1)
        ]
        values = {
            **first["task"],
            "prompt": transcript(first["prompt"]),
            "trajectories": "\n\n".join(attempts),
            "count": len(group),
            "scale": f"{self.replier.scale:g}",
        }
        missing = sorted(self.replier.fields - set(values))
        if missing:
            raise ValueError(
                f"the rubric names {', '.join(missing)}, which episode {first['id']}'s task does not have "
                f"(it has: {', '.join(first['task']) or 'none'})"
            )
        return self.replier.rubric.format(**values)


GROUP_LINE = re.compile(r"^\W*(?:attempt\s*)?#?(\d+)\W*?[:=\-]\s*(.+)$", flags=re.I | re.M)


def parse_group_scores(text: str, count: int, scale: float) -> dict[int, float | str]:
    """Attempt number -> its score divided by scale, from lines "<number>: <score>"; where an attempt's
    line has no number in [0, scale], the sentence saying why instead."""
    found: dict[int, float | str] = {}
    for match in GROUP_LINE.finditer(text):
        number = int(match.group(1))
        if 1 <= number <= count and number not in found:
            try:
                found[number] = parse_score(match.group(2), scale)
            except ValueError as exc:
                found[number] = f"attempt {number}: {exc}"
    return found


def parse_score(text: str, scale: float) -> float:
    """A judge's score: the first number in its reply divided by scale.

    Raises ValueError, saying why, when the reply has no number or the first is outside [0, scale].
    """
    numbers = find_numbers(text)
    if not numbers:
        raise ValueError(f"no number in the judge's reply {text!r}")
    value = float(numbers[0])
    if not 0 <= value <= scale:
        raise ValueError(f"score {value:g} is outside [0, {scale:g}] in the judge's reply {text!r}")
    return value / scale


@validate_call
def reward_model(
    *, model: str, label: NonNegativeInt | None = None, batch_size: PositiveInt = 8, device: str = "auto"
) -> Scorer:
    net, tokenizer = _load_model(model, "AutoModelForSequenceClassification", device)
    num_labels = net.config.num_labels
    if num_labels is None:
        raise UsageError(f"{model} does not say how many labels it has (num_labels in its config.json).")
    if label is None and num_labels != 1:
        raise UsageError(f"{model} has {num_labels} labels; set kwargs.label to the index of the one to score.")
    if label is not None and label >= num_labels:
        raise UsageError(f"kwargs.label is {label} but {model} has only {num_labels} labels.")
    # The model reads its score at each row's last real token, which it finds through the pad id.
    net.config.pad_token_id = tokenizer.pad_token_id
    tokenizer.padding_side = "right"
    return RewardModel(net, tokenizer, label or 0, batch_size)


class RewardModel:
    """A sequence classifier's logit as the reward; conversations cut to fit it are recorded in `failures`."""

    def __init__(self, net: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, label: int, batch_size: int):
        self.net, self.tokenizer, self.label, self.batch_size = net, tokenizer, label, batch_size
        self.max_tokens = input_limit(tokenizer, net.config)
        self.failures: dict[int, str] = {}

    def __call__(self, episodes: list[EpisodeDict]) -> list[float]:
        import torch

        self.failures = {}
        texts = [_render(self.tokenizer, ep["messages"], add_generation_prompt=False) for ep in episodes]
        values = []
        for start in range(0, len(texts), self.batch_size):
            ids = [ep["id"] for ep in episodes[start : start + self.batch_size]]
            texts_in_batch = texts[start : start + self.batch_size]
            inputs = _tokenize(self.tokenizer, texts_in_batch, self.max_tokens, ids, self.failures).to(self.net.device)
            with torch.inference_mode():
                values += self.net(**inputs).logits[:, self.label].float().tolist()
        return values


def _load_model(model: str, auto_class: str, device: str) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A model and its tokenizer from a local folder, on device (as model.device reads it), in eval mode."""
    path = Path(model)
    if not path.is_dir():
        raise UsageError(f"kwargs.model {model!r} is not a local model folder.")
    import transformers

    from rlcli.models.loading import resolve_device

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        net = getattr(transformers, auto_class).from_pretrained(path)
    except Exception as exc:  # any failure to load is a bad model folder, whatever transformers raises
        raise UsageError(f"cannot load {path} as {auto_class}: {type(exc).__name__}: {exc}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token  # batches need padding; eos is the usual stand-in
    net.to(resolve_device(device)).eval()
    return net, tokenizer


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict], add_generation_prompt: bool) -> str:
    if tokenizer.chat_template is None:
        return transcript(messages)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    return cast(str, text)  # tokenize=False: the text


def input_limit(tokenizer: PreTrainedTokenizerBase, config: PretrainedConfig) -> int | None:
    """The most tokens the model reads at once: the smaller of the tokenizer's model_max_length and
    the config's max_position_embeddings, leaving out either one when it is unset (transformers puts
    a huge placeholder in model_max_length when the tokenizer does not know)."""
    limits = [tokenizer.model_max_length, getattr(config, "max_position_embeddings", None)]
    known = [n for n in limits if isinstance(n, int) and 0 < n < 1_000_000_000]
    return min(known) if known else None


def _token_rows(
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    max_tokens: int | None,
    episode_ids: list[int],
    notes: dict[int, str],
) -> list[list[int]]:
    """The texts' token ids, each row cut from the left to max_tokens: the end of an episode (the
    answer, the judge's question) matters most. Each cut is noted under its episode id."""
    # A chat template writes its own special tokens; plain transcripts get the tokenizer's usual ones.
    rows = tokenizer(texts, add_special_tokens=tokenizer.chat_template is None)["input_ids"]
    if max_tokens is not None:
        for i, (row, episode_id) in enumerate(zip(rows, episode_ids)):
            if len(row) > max_tokens:
                rows[i] = row[-max_tokens:]
                notes[episode_id] = f"input cut from the left to fit the model: {max_tokens} tokens kept of {len(row)}"
    return rows


def _tokenize(
    tokenizer: PreTrainedTokenizerBase,
    texts: list[str],
    max_tokens: int | None,
    episode_ids: list[int],
    notes: dict[int, str],
) -> BatchEncoding:
    """_token_rows as a padded batch of tensors."""
    rows = _token_rows(tokenizer, texts, max_tokens, episode_ids, notes)
    return tokenizer.pad({"input_ids": rows}, return_tensors="pt")
