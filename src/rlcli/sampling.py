"""Batched token sampling with a KV cache, returning the sampled ids and their logprobs.

A small decode loop instead of `model.generate`: it records the logprob of each sampled token
without keeping a [batch, vocab] tensor per step, gives every row its own random generator (an
episode's samples do not depend on which other episodes share its batch), and stops as soon as
every row is finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop: list[str] = field(default_factory=list)

    @property
    def logprob_temperature(self) -> float:
        """The temperature under which logprobs are recorded (and recomputed in training)."""
        return self.temperature if self.temperature > 0 else 1.0


@dataclass
class Sample:
    ids: list[int]
    logprobs: list[float]
    finished: bool  # ended on an eos token or a stop string (not on the token cap)


def _filter_logits(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    if top_k > 0 and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1, None]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True, dim=-1)
        cum = sorted_scores.softmax(-1).cumsum(-1)
        # Drop tokens once the mass before them already exceeds top_p; always keep the first.
        drop = (cum - sorted_scores.softmax(-1)) > top_p
        sorted_scores = sorted_scores.masked_fill(drop, float("-inf"))
        scores = torch.full_like(scores, float("-inf")).scatter(-1, order, sorted_scores)
    return scores


@torch.no_grad()
def sample_batch(
    model,
    tokenizer,
    prompts: list[list[int]],
    generators: list[torch.Generator],
    cfg: SamplingConfig,
    max_new_tokens: list[int] | None = None,
) -> list[Sample]:
    """Continue each prompt by up to its own token budget; one forward per step for the batch."""
    device = next(model.parameters()).device
    batch = len(prompts)
    budgets = max_new_tokens or [cfg.max_new_tokens] * batch
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = _eos_ids(model, tokenizer)
    width = max(len(p) for p in prompts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding keeps every row's next token in the last column
        input_ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        attention[i, width - len(p):] = 1
    input_ids, attention = input_ids.to(device), attention.to(device)
    positions = (attention.cumsum(-1) - 1).clamp(min=0)

    # Only the last position's logits are needed; all of them would be a [batch, width, vocab] tensor
    # (hundreds of MB with a 49k-token vocabulary) and a fifth of the prefill's compute.
    out = model(input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
                logits_to_keep=1)
    cache, logits = out.past_key_values, out.logits[:, -1, :]
    next_pos = positions[:, -1:] + 1

    ids: list[list[int]] = [[] for _ in range(batch)]
    logps: list[list[float]] = [[] for _ in range(batch)]
    done = [False] * batch
    finished = [False] * batch
    for step in range(max(budgets)):
        scores = logits.float() / cfg.logprob_temperature
        logprobs = torch.log_softmax(scores, dim=-1)
        if cfg.temperature > 0:
            probs = _filter_logits(scores, cfg.top_k, cfg.top_p).softmax(-1)
            chosen = [
                int(torch.multinomial(probs[i], 1, generator=generators[i])) if not done[i] else pad_id
                for i in range(batch)
            ]
        else:
            chosen = logits.argmax(-1).tolist()
        for i, tok in enumerate(chosen):
            if done[i]:
                continue
            ids[i].append(tok)
            logps[i].append(float(logprobs[i, tok]))
            if tok in eos_ids or _hits_stop(tokenizer, ids[i], cfg.stop):
                done[i] = finished[i] = True
            elif len(ids[i]) >= budgets[i]:
                done[i] = True
        if all(done):
            break
        step_ids = torch.tensor([[t if not done[i] else pad_id] for i, t in enumerate(chosen)], device=device)
        attention = torch.cat([attention, torch.ones((batch, 1), dtype=attention.dtype, device=device)], dim=-1)
        out = model(
            input_ids=step_ids, attention_mask=attention, position_ids=next_pos, past_key_values=cache, use_cache=True
        )
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_pos = next_pos + 1
    return [Sample(ids[i], logps[i], finished[i]) for i in range(batch)]


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def _hits_stop(tokenizer, ids: list[int], stops: list[str]) -> bool:
    if not stops:
        return False
    tail = tokenizer.decode(ids[-16:], skip_special_tokens=False)
    return any(s in tail for s in stops)


@torch.no_grad()
def sequence_logprobs(model, ids: list[int], start: int, temperature: float = 1.0) -> torch.Tensor:
    """Logprobs of ids[start:] given what precedes them, for checking recorded logprobs."""
    device = next(model.parameters()).device
    inp = torch.tensor([ids], device=device)
    logits = model(input_ids=inp).logits[0, start - 1 : len(ids) - 1].float() / temperature
    target = inp[0, start:]
    return torch.log_softmax(logits, -1).gather(-1, target[:, None])[:, 0]
