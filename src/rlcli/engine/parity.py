"""Whether two samplers draw from the same policy: the statistics of the engine-parity check.

The HF sampler (generation.hf_sampler.HfSampler) and vLLM (generation.vllm_engine.VllmSampler) are two implementations of one
policy. Given many samples of each for one prompt, these say whether they differ:

- the first token's distribution: a chi-square test of the two samples' counts against each other
  (homogeneity) and of each against the trainer's exact probabilities (goodness of fit);
- each sample's sequence logprob under the trainer's model (an HF forward, at the temperature the
  trainer recomputes logprobs with): the two engines' means with a z-test of their difference. A
  sampler that is too sharp or too flat, that stops at other tokens, or that samples another model,
  moves this mean;
- how far each engine's recorded logprobs are from that recomputation (what GRPO's ratio sees).

tests/models/test_engine_parity.py runs it on the tiny model, bench/engine_parity.py on SmolLM2.
"""

from __future__ import annotations

import copy
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rlcli.generation.sampler import Sample

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlcli.models.loading import PolicyModel

# A chi-square cell needs an expected count of about 5 for the statistic to follow its distribution:
# rarer tokens are pooled into one cell.
MIN_EXPECTED = 5.0


def first_prompt_ids(
    tokenizer: PreTrainedTokenizerBase, env_name: str, env_kwargs: dict | None = None, seed: int = 0
) -> list[int]:
    """An env's first prompt as the rollout gives it to either engine (TurnPlayer._prompt_ids):
    its first observation through the chat template with the generation prompt, then tokenised."""
    from rlcli.envs.loading import load_env

    messages, _ = load_env(env_name, env_kwargs)().reset(seed)
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


@dataclass
class ChiSquare:
    stat: float
    df: int
    p: float


def chi_square_p(stat: float, df: int) -> float:
    """P(X >= stat) for X ~ chi-square(df): the regularised upper incomplete gamma Q(df/2, stat/2)."""
    if df <= 0:
        return 1.0
    return torch.special.gammaincc(
        torch.tensor(df / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64)
    ).item()


def first_tokens(samples: Sequence[Sample]) -> Counter:
    return Counter(s.ids[0] for s in samples if s.ids)


def chi_square_same(a: Counter, b: Counter) -> ChiSquare:
    """Two samples of tokens against each other (a 2 x cells contingency table): are they drawn
    from one distribution? Tokens whose expected count is under MIN_EXPECTED in either sample are
    pooled into one cell."""
    n_a, n_b = sum(a.values()), sum(b.values())
    total = n_a + n_b
    kept, pooled = [], [0, 0]
    for token in sorted(set(a) | set(b)):
        both = a[token] + b[token]
        if min(n_a, n_b) * both / total >= MIN_EXPECTED:
            kept.append((a[token], b[token]))
        else:
            pooled[0] += a[token]
            pooled[1] += b[token]
    if sum(pooled):
        kept.append((pooled[0], pooled[1]))
    stat = 0.0
    for count_a, count_b in kept:
        column = count_a + count_b
        for count, n in ((count_a, n_a), (count_b, n_b)):
            expected = n * column / total
            stat += (count - expected) ** 2 / expected
    df = len(kept) - 1
    return ChiSquare(stat, df, chi_square_p(stat, df))


def chi_square_fit(counts: Counter, probs: torch.Tensor) -> ChiSquare:
    """A sample of tokens against the distribution `probs` (over the vocabulary): is it drawn from
    it? Tokens whose expected count is under MIN_EXPECTED are pooled into one cell."""
    n = sum(counts.values())
    expected = probs.double() * n
    observed = torch.zeros_like(expected)
    for token, count in counts.items():
        observed[token] = count
    big = expected >= MIN_EXPECTED
    cells_expected = torch.cat([expected[big], expected[~big].sum()[None]])
    cells_observed = torch.cat([observed[big], observed[~big].sum()[None]])
    if cells_expected[-1] < MIN_EXPECTED:  # a tail too small for a cell of its own joins the smallest one
        smallest = int(cells_expected[:-1].argmin())
        cells_expected[smallest] += cells_expected[-1]
        cells_observed[smallest] += cells_observed[-1]
        cells_expected, cells_observed = cells_expected[:-1], cells_observed[:-1]
    stat = (((cells_observed - cells_expected) ** 2) / cells_expected).sum().item()
    df = len(cells_expected) - 1
    return ChiSquare(stat, df, chi_square_p(stat, df))


@torch.no_grad()
def next_token_probs(model: PolicyModel, prompt: list[int], temperature: float) -> torch.Tensor:
    """The trainer's distribution of the first sampled token: softmax(logits / T) after the prompt."""
    device = next(model.parameters()).device
    logits = model(input_ids=torch.tensor([prompt], device=device), logits_to_keep=1).logits[0, -1].float()
    return torch.softmax(logits / temperature, dim=-1).cpu()


@torch.no_grad()
def recomputed_logprobs(
    model: PolicyModel, prompt: list[int], samples: Sequence[Sample], temperature: float, batch_size: int = 256
) -> list[list[float]]:
    """Each sample's token logprobs as the trainer recomputes them: log_softmax(logits / T) of an HF
    forward over prompt + ids. The prompt is run once and its KV cache shared by every completion,
    and identical completions (a peaked policy repeats itself) are scored once."""
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
    prompt_cache = out.past_key_values
    first = torch.log_softmax(out.logits[0, -1].float() / temperature, dim=-1).cpu()
    unique = sorted({tuple(s.ids) for s in samples if s.ids}, key=len)
    scored: dict[tuple[int, ...], list[float]] = {(): []}
    for start in range(0, len(unique), batch_size):
        chunk = unique[start : start + batch_size]
        width = max(len(ids) for ids in chunk)
        input_ids = torch.zeros((len(chunk), width), dtype=torch.long)
        attention = torch.ones((len(chunk), len(prompt) + width), dtype=torch.long)
        for row, ids in enumerate(chunk):  # right padding, which no real token attends to
            input_ids[row, : len(ids)] = torch.tensor(ids)
            attention[row, len(prompt) + len(ids) :] = 0
        cache = copy.deepcopy(prompt_cache)
        cache.batch_repeat_interleave(len(chunk))
        positions = torch.arange(len(prompt), len(prompt) + width)[None].expand(len(chunk), -1)
        logits = model(
            input_ids=input_ids.to(device),
            attention_mask=attention.to(device),
            position_ids=positions.to(device),
            past_key_values=cache,
        ).logits.float()
        # A completion's first token follows the prompt; each later one, the token before it.
        later = torch.log_softmax(logits[:, :-1] / temperature, dim=-1).gather(-1, input_ids[:, 1:, None].to(device))
        later = later[..., 0].cpu()
        for row, ids in enumerate(chunk):
            scored[ids] = [first[ids[0]].item(), *later[row, : len(ids) - 1].tolist()]
    return [scored[tuple(s.ids)] for s in samples]


@dataclass
class LogprobSummary:
    """Sequence logprobs (sums over a sample's tokens) of one engine's samples under the trainer's model."""

    mean: float
    ci_low: float
    ci_high: float
    sd: float
    n: int
    max_gap: float  # the largest |recorded - recomputed| token logprob
    mean_tokens: float


def summarise(samples: Sequence[Sample], recomputed: Sequence[Sequence[float]], z: float = 1.96) -> LogprobSummary:
    sums = [sum(lps) for lps in recomputed]
    n = len(sums)
    mean = sum(sums) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in sums) / (n - 1))
    half = z * sd / math.sqrt(n)
    gap = max(
        (abs(r - c) for s, lps in zip(samples, recomputed) for r, c in zip(s.logprobs, lps)),
        default=0.0,
    )
    return LogprobSummary(mean, mean - half, mean + half, sd, n, gap, sum(len(s.ids) for s in samples) / n)


def mean_difference_z(a: LogprobSummary, b: LogprobSummary) -> float:
    """(a.mean - b.mean) in standard errors of the difference (independent samples)."""
    se = math.sqrt(a.sd**2 / a.n + b.sd**2 / b.n)
    return (a.mean - b.mean) / se if se > 0 else 0.0
