"""Batched token sampling with a KV cache, returning the sampled ids and their logprobs.

A small decode loop instead of `model.generate`: it records the logprob of each sampled token
without keeping a [batch, vocab] tensor per step, gives every row its own random generator (an
episode's samples do not depend on which other episodes share its batch), and stops as soon as
every row is finished.

Multi-turn episodes keep their KV cache between turns (`TurnCache`): a turn's prompt is the previous
prompt plus the sampled tokens plus the env's feedback, so only those new tokens are prefilled.
Re-prefilling the whole conversation every turn made prefill most of a multi-turn rollout's time.
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


@dataclass
class TurnCache:
    """A batch's KV cache kept from one turn to the next.

    Row i holds the tokens `ids[i]`, at the cache columns where `attention[i]` is 1 (the other
    columns are padding). `keys` names the rows (the caller's episodes) so that rows whose episode
    ended can be dropped before the next turn.
    """

    kv: object = None
    attention: torch.Tensor | None = None
    ids: list[list[int]] = field(default_factory=list)
    keys: list = field(default_factory=list)

    def align(self, keys: list) -> None:
        """Keep the rows of `keys`, in that order; a key the cache has not seen empties it."""
        if self.kv is not None and keys != self.keys:
            if set(keys) <= set(self.keys):
                rows = [self.keys.index(k) for k in keys]
                self.kv.batch_select_indices(torch.tensor(rows, device=self.attention.device))
                self.attention = self.attention[rows]
                self.ids = [self.ids[r] for r in rows]
            else:
                self.kv, self.attention, self.ids = None, None, []
        self.keys = list(keys)

    def new_tokens(self, prompts: list[list[int]]) -> list[list[int]] | None:
        """What each prompt adds to its cached row; None when a prompt does not extend its row
        (a chat template that rewrote earlier text): then the whole prompt is prefilled again."""
        if self.kv is None or len(prompts) != len(self.ids):
            return None
        if any(len(p) <= len(c) or p[: len(c)] != c for p, c in zip(prompts, self.ids)):
            return None
        return [p[len(c) :] for p, c in zip(prompts, self.ids)]


@torch.no_grad()
def sample_batch(
    model,
    tokenizer,
    prompts: list[list[int]],
    generators: list[torch.Generator],
    cfg: SamplingConfig,
    max_new_tokens: list[int] | None = None,
    turn_cache: TurnCache | None = None,
) -> list[Sample]:
    """Continue each prompt by up to its own token budget; one forward per step for the batch.

    With a `turn_cache` from the previous turn, only the tokens each prompt adds are prefilled;
    the cache is then left holding this turn, ready for the next.
    """
    device = next(model.parameters()).device
    batch = len(prompts)
    budgets = max_new_tokens or [cfg.max_new_tokens] * batch
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = _eos_ids(model, tokenizer)
    fresh = turn_cache.new_tokens(prompts) if turn_cache is not None else None
    if fresh is None:
        fresh, cache, cached_attention, cached_len = (
            prompts,
            None,
            torch.zeros((batch, 0), dtype=torch.long),
            [0] * batch,
        )
    else:
        cache, cached_attention, cached_len = (
            turn_cache.kv,
            turn_cache.attention.cpu(),
            [len(c) for c in turn_cache.ids],
        )
    width = max(len(p) for p in fresh)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    new_attention = torch.zeros((batch, width), dtype=torch.long)
    for i, p in enumerate(fresh):  # left padding keeps every row's next token in the last column
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        new_attention[i, width - len(p) :] = 1
    positions = torch.tensor(cached_len)[:, None] + (new_attention.cumsum(-1) - 1).clamp(min=0)
    attention = torch.cat([cached_attention, new_attention], dim=-1)
    input_ids, attention, positions = input_ids.to(device), attention.to(device), positions.to(device)

    # Only the last position's logits are needed; all of them would be a [batch, width, vocab] tensor
    # (hundreds of MB with a 49k-token vocabulary) and a fifth of the prefill's compute.
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
    )
    cache, logits = out.past_key_values, out.logits[:, -1, :]
    next_pos = positions[:, -1:] + 1

    ids: list[list[int]] = [[] for _ in range(batch)]
    logps: list[list[float]] = [[] for _ in range(batch)]
    done = [False] * batch
    finished = [False] * batch
    for _ in range(max(budgets)):
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
        # A finished row is fed padding that no later token attends to, so its cache stays clean.
        step_ids = torch.tensor([[t if not done[i] else pad_id] for i, t in enumerate(chosen)], device=device)
        live = torch.tensor([[0 if d else 1] for d in done], dtype=attention.dtype, device=device)
        attention = torch.cat([attention, live], dim=-1)
        out = model(
            input_ids=step_ids, attention_mask=attention, position_ids=next_pos, past_key_values=cache, use_cache=True
        )
        cache, logits = out.past_key_values, out.logits[:, -1, :]
        next_pos = next_pos + 1
    if turn_cache is not None:
        # Every row's last sampled token ended it and was never fed: the cache holds the rest.
        turn_cache.kv, turn_cache.attention = cache, attention
        turn_cache.ids = [prompts[i] + ids[i][:-1] for i in range(batch)]
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
