"""Model-based rewards: an LLM judge that writes a score, and a reward model that computes one.

Both load a local model folder once, when the recipe's rewards are built; torch and transformers
are imported only then, so importing this module stays cheap.
"""

from __future__ import annotations

import string
from pathlib import Path

from pydantic import NonNegativeInt, PositiveFloat, PositiveInt, validate_call

from rlcli.envs.parsing import find_numbers
from rlcli.errors import UsageError
from rlcli.rewards.episodes import EpisodeDict, Scorer, transcript

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

    def __call__(self, episodes: list[EpisodeDict]) -> list[float]:
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

    def generate(self, requests: list[str]) -> list[str]:
        import torch

        texts = [
            _render(self.tokenizer, [{"role": "user", "content": r}], add_generation_prompt=True) for r in requests
        ]
        inputs = _tokenize(self.tokenizer, texts).to(self.lm.device)
        with torch.inference_mode():
            output = self.lm.generate(
                **inputs, max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=self.tokenizer.pad_token_id
            )
        return self.tokenizer.batch_decode(output[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


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
def reward_model(*, model: str, label: NonNegativeInt | None = None, batch_size: PositiveInt = 8) -> Scorer:
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

    def score(episodes: list[EpisodeDict]) -> list[float]:
        texts = [_render(tokenizer, ep["messages"], add_generation_prompt=False) for ep in episodes]
        values = []
        for start in range(0, len(texts), batch_size):
            inputs = _tokenize(tokenizer, texts[start : start + batch_size]).to(net.device)
            with torch.inference_mode():
                values += net(**inputs).logits[:, label or 0].float().tolist()
        return values

    return score


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


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool) -> str:
    if tokenizer.chat_template is None:
        return transcript(messages)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def _tokenize(tokenizer, texts: list[str]):
    # A chat template writes its own special tokens; plain transcripts get the tokenizer's usual ones.
    return tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=tokenizer.chat_template is None)
