"""Model-based rewards: an LLM judge that writes a score, and a reward model that computes one.

Both load a local model folder once, when the recipe's rewards are built, on the device they are
given (the recipe's model.device); torch and transformers are imported only then, so importing this
module stays cheap.

The judge generates through the same seam as rollouts (generation/sampler.py's Sampler: token-id prompts
in, sampled ids out, a seed per episode), with the HF engine: greedy, batched, and correct on any
device. Not with vLLM: an in-process vLLM engine is one per process, and the policy's holds it.
"""

from __future__ import annotations

import string
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


@validate_call
def judge(
    *,
    model: str,
    rubric: str = DEFAULT_RUBRIC,
    max_new_tokens: PositiveInt = 8,
    scale: PositiveFloat = 10.0,
    batch_size: PositiveInt = 8,
    device: str = "auto",
) -> Scorer:
    try:
        fields = {name for _, name, _, _ in string.Formatter().parse(rubric) if name is not None}
    except ValueError as exc:
        raise UsageError(f"kwargs.rubric: {exc} (write a literal brace as {{{{ or }}}}).") from None
    if any(not name.isidentifier() for name in fields):
        raise UsageError("kwargs.rubric: placeholders must be names such as {prompt}, {completion} or a task field.")
    lm, tokenizer = _load_model(model, "AutoModelForCausalLM", device)
    return Judge(lm, tokenizer, rubric, fields, max_new_tokens, scale, batch_size)


class Judge:
    """An LLM judge: greedy-decodes a score for each episode; unparseable replies score 0.0 and are
    recorded in `failures`, as are requests cut to fit the model."""

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
        self.failures: dict[int, str] = {}
        limit = input_limit(tokenizer, lm.config)
        # The reply needs positions too; a model too short for even that gets the whole limit.
        self.max_prompt_tokens = None if limit is None else max(limit - max_new_tokens, 1)

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
