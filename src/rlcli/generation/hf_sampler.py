"""Batched token sampling with a KV cache, returning the sampled ids and their logprobs.

A small decode loop instead of `model.generate`: it records the logprob of each sampled token
without keeping a [batch, vocab] tensor per step, gives every row its own random generator (an
episode's samples do not depend on which other episodes share its batch), and stops as soon as
every row is finished.

It runs on any device. Generators live on the model's device, the sampled tokens and their logprobs
stay there, and the loop reads from the device once per step (the step's tokens, to check eos, stop
strings and budgets) plus once at the end (the logprobs): on a GPU each read waits for the queued
work, so reading per row and per token would serialise the loop.

Multi-turn episodes keep their KV cache between turns (`TurnCache`): a turn's prompt is the previous
prompt plus the sampled tokens plus the env's feedback, so only those new tokens are prefilled.
Re-prefilling the whole conversation every turn made prefill most of a multi-turn rollout's time.

A vision-language model's prompts come with their images (models/vision.py): the images whose tokens
a prefill feeds go to that forward as pixels; decode steps feed text tokens only. Qwen2-VL's family
places image tokens at 3-D positions (M-RoPE), computed at the prefill (vision.mrope_positions); its
sampled tokens are text, whose position is their index plus the row's shift, kept per row.

`HfSampler` is this decode loop behind the `Sampler` protocol (sampler.py); `vllm_engine.VllmSampler`
is the other one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from rlcli.generation.sampler import Sample, SamplingConfig
from rlcli.models import vision

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from rlcli.models.loading import PolicyModel


class HfSampler:
    """The Sampler over `sample_batch`: a generator per episode, and the chunk's KV cache across turns."""

    def __init__(self, model: PolicyModel, tokenizer: PreTrainedTokenizerBase, config: SamplingConfig) -> None:
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.processor = vision.processor_of(tokenizer)  # a vision-language model's; None for text
        self.generators: list[torch.Generator] = []
        self.turn_cache = TurnCache()

    def start(self, seeds: list[int]) -> None:
        self.model.eval()  # the trainer switches it to train mode between rollouts
        self.generators = [make_generator(self.model, seed) for seed in seeds]
        self.turn_cache = TurnCache()

    def sample(
        self,
        rows: list[int],
        prompts: list[list[int]],
        budgets: list[int],
        images: list[list[vision.ImageRef]] | None = None,
    ) -> list[Sample]:
        """images: a vision-language model's, those of each prompt in the order of their tokens."""
        self.turn_cache.align(rows)
        generators = [self.generators[row] for row in rows]
        return sample_batch(
            self.model,
            self.tokenizer,
            prompts,
            generators,
            self.config,
            budgets,
            self.turn_cache,
            images=images,
            processor=self.processor,
        )


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


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def make_generator(model: torch.nn.Module, seed: int) -> torch.Generator:
    """An episode's own random stream, on the model's device (a CUDA draw needs a CUDA generator)."""
    return torch.Generator(device=model_device(model)).manual_seed(seed)


def _draw(probs: torch.Tensor, generators: list[torch.Generator], live: list[bool]) -> torch.Tensor:
    """One token per row of probs, drawn with that row's generator; rows not live leave theirs untouched.

    argmax(p / E) with E ~ Exp(1) picks token i with probability p_i. It is how torch.multinomial draws
    one sample, so the tokens are the same for the same generator state, but multinomial also reads
    its input back to check it: two host syncs per row per step.
    """
    clocks = torch.ones_like(probs)
    for row, generator in enumerate(generators):
        if live[row]:
            clocks[row].exponential_(generator=generator)
    return (probs / clocks).argmax(-1)


@dataclass
class TurnCache:
    """A batch's KV cache kept from one turn to the next.

    Row i holds the tokens `ids[i]`, at the cache columns where `attention[i]` is 1 (the other
    columns are padding). `keys` names the rows (the caller's episodes) so that rows whose episode
    ended can be dropped before the next turn.
    """

    kv: Any = None  # transformers' Cache (DynamicCache): its rows are selected in place
    attention: torch.Tensor | None = None
    ids: list[list[int]] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)
    images: list[int] = field(default_factory=list)  # per row, how many of its prompt's images it holds
    # per row, position - index of its next token: 0 but after images with 3-D positions (M-RoPE)
    shifts: list[int] = field(default_factory=list)

    def align(self, keys: list[int]) -> None:
        """Keep the rows of `keys`, in that order; a key the cache has not seen empties it."""
        if self.kv is not None and keys != self.keys:
            assert self.attention is not None  # set together with kv
            if set(keys) <= set(self.keys):
                rows = [self.keys.index(k) for k in keys]
                self.kv.batch_select_indices(torch.tensor(rows, device=self.attention.device))
                self.attention = self.attention[rows]
                self.ids = [self.ids[r] for r in rows]
                self.images = [self.images[r] for r in rows]
                self.shifts = [self.shifts[r] for r in rows]
            else:
                self.kv, self.attention, self.ids, self.images, self.shifts = None, None, [], [], []
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
    model: PolicyModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[list[int]],
    generators: list[torch.Generator],
    cfg: SamplingConfig,
    max_new_tokens: list[int] | None = None,
    turn_cache: TurnCache | None = None,
    *,
    images: list[list[vision.ImageRef]] | None = None,
    processor: Any = None,
) -> list[Sample]:
    """Continue each prompt by up to its own token budget; one forward per step for the batch.

    With a `turn_cache` from the previous turn, only the tokens each prompt adds are prefilled;
    the cache is then left holding this turn, ready for the next.
    images (with the vision-language model's processor): each prompt's images, in token order.
    """
    batch = len(prompts)
    budgets = max_new_tokens or [cfg.max_new_tokens] * batch
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    images = images or [[] for _ in prompts]
    state = _prefill(model, prompts, images, turn_cache, processor, pad_id)
    slots = vision.slot_token_ids(model.config) if processor is not None else []
    unwritable = torch.tensor(slots, dtype=torch.long, device=model_device(model)) if slots else None
    ids, logps, finished = _decode(model, tokenizer, state, generators, cfg, budgets, pad_id, unwritable)
    if turn_cache is not None:
        # Every row's last sampled token ended it and was never fed: the cache holds the rest.
        turn_cache.kv, turn_cache.attention = state.cache, state.attention
        turn_cache.ids = [prompts[i] + ids[i][:-1] for i in range(batch)]
        turn_cache.images = [len(imgs) for imgs in images]
        turn_cache.shifts = state.shifts
    return [Sample(ids[i], logps[i], finished[i]) for i in range(batch)]


@dataclass
class _Decoding:
    """The batch between steps: the KV cache, the last position's logits, the attention mask, each
    row's next position and its position shift (how far an image's rope positions moved its text)."""

    cache: Any
    logits: torch.Tensor
    attention: torch.Tensor
    next_pos: torch.Tensor
    shifts: list[int]


def _prefill(
    model: PolicyModel,
    prompts: list[list[int]],
    images: list[list[vision.ImageRef]],
    turn_cache: TurnCache | None,
    processor: Any,
    pad_id: int,
) -> _Decoding:
    """One forward over what the rows do not hold yet: each distinct prompt whole (its copies share
    it), or, with the turn cache, the tokens each prompt adds to the last turn."""
    device = model_device(model)
    batch = len(prompts)
    fresh = turn_cache.new_tokens(prompts) if turn_cache is not None else None
    copies = None  # for each row, the prefilled row it copies (a group's episodes share their first prompt)
    if fresh is None:
        # Same ids with other pixels (one instruction over two screenshots) are two prompts.
        first: dict[tuple, int] = {}
        keys = [(tuple(p), tuple(ref.sha256 for ref in imgs)) for p, imgs in zip(prompts, images)]
        copies = [first.setdefault(key, len(first)) for key in keys]
        fresh = [list(p) for p, _ in first]
        fresh_images = [images[keys.index(key)] for key in first]
        cache, cached_len, shifts = None, [0] * len(fresh), [0] * len(fresh)
        cached_attention = torch.zeros((len(fresh), 0), dtype=torch.long, device=device)
    else:
        assert turn_cache is not None and turn_cache.attention is not None  # fresh came from its rows
        cache, cached_attention, cached_len = (turn_cache.kv, turn_cache.attention, [len(c) for c in turn_cache.ids])
        fresh_images = [imgs[held:] for imgs, held in zip(images, turn_cache.images)]
        shifts = list(turn_cache.shifts)
    pixels = vision.pixel_inputs(processor, [ref.image for imgs in fresh_images for ref in imgs], model)
    width = max(len(p) for p in fresh)
    input_ids = torch.full((len(fresh), width), pad_id, dtype=torch.long)
    new_attention = torch.zeros((len(fresh), width), dtype=torch.long)
    for i, p in enumerate(fresh):  # left padding keeps every row's next token in the last column
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        new_attention[i, width - len(p) :] = 1
    starts = torch.tensor(cached_len) + torch.tensor(shifts)  # the position of each row's first new token
    positions = starts[:, None] + (new_attention.cumsum(-1) - 1).clamp(min=0)
    if "image_grid_thw" in pixels and vision.uses_mrope(model):
        positions = _mrope_rows(model, processor, fresh, fresh_images, pixels["image_grid_thw"], positions, shifts)
    attention = torch.cat([cached_attention, new_attention.to(device)], dim=-1)
    input_ids, positions = input_ids.to(device), positions.to(device)

    # Only the last position's logits are needed; all of them would be a [batch, width, vocab] tensor
    # (hundreds of MB with a 49k-token vocabulary) and a fifth of the prefill's compute.
    out = model(
        input_ids=input_ids,
        attention_mask=attention,
        position_ids=positions,
        past_key_values=cache,
        use_cache=True,
        logits_to_keep=1,
        **pixels,
    )
    cache, logits = out.past_key_values, out.logits[:, -1, :]
    if len(fresh) < batch:  # each distinct prompt was prefilled once: give every row its copy
        assert copies is not None  # fewer rows prefilled than prompts: only on a full prefill
        rows = torch.tensor(copies, device=device)
        cache.batch_select_indices(rows)
        logits, attention = logits[rows], attention[rows]
        shifts = [shifts[c] for c in copies]
    # Sampled tokens are text: each one's position is its index plus the row's shift.
    next_pos = torch.tensor([[len(p) + shift] for p, shift in zip(prompts, shifts)], device=device)
    return _Decoding(cache, logits, attention, next_pos, shifts)


def _decode(
    model: PolicyModel,
    tokenizer: PreTrainedTokenizerBase,
    state: _Decoding,
    generators: list[torch.Generator],
    cfg: SamplingConfig,
    budgets: list[int],
    pad_id: int,
    unwritable: torch.Tensor | None,
) -> tuple[list[list[int]], list[list[float]], list[bool]]:
    """Sample every row until it ends (EOS, a stop string) or spends its budget; each row's tokens, their
    logprobs and whether it ended by itself. `state` is left holding the last step's cache and mask."""
    batch, device = len(budgets), model_device(model)
    eos_ids = _eos_ids(model, tokenizer)
    logits = state.logits
    ids: list[list[int]] = [[] for _ in range(batch)]
    step_logprobs = []  # per step, every row's logprob of its token; read back once, at the end
    done = [False] * batch
    done_rows = torch.zeros(batch, dtype=torch.bool, device=device)  # `done`, kept on the device too
    finished = [False] * batch
    for _ in range(max(budgets)):
        if unwritable is not None:  # image slots: never in a reply (vision.slot_token_ids)
            logits = logits.index_fill(-1, unwritable, float("-inf"))
        scores = logits.float() / cfg.logprob_temperature
        logprobs_all = torch.log_softmax(scores, dim=-1)
        if cfg.temperature > 0:
            filtered = 0 < cfg.top_k < scores.shape[-1] or cfg.top_p < 1.0
            # Unfiltered, the sampling distribution is the logprobs': no second pass over the vocabulary.
            probs = _filter_logits(scores, cfg.top_k, cfg.top_p).softmax(-1) if filtered else logprobs_all.exp()
            chosen = _draw(probs, generators, [not d for d in done])
        else:
            chosen = logits.argmax(-1)
        step_logprobs.append(logprobs_all.gather(-1, chosen[:, None])[:, 0])
        for i, tok in enumerate(chosen.tolist()):  # the step's one read from the device
            if done[i]:
                continue
            ids[i].append(tok)
            if tok in eos_ids or _hits_stop(tokenizer, ids[i], cfg.stop):
                finished[i] = True
            elif len(ids[i]) < budgets[i]:
                continue
            done[i] = True
            done_rows[i].fill_(True)  # the value goes to the kernel as an argument: no copy, no wait
        if all(done):
            break
        # A finished row is fed padding that no later token attends to, so its cache stays clean.
        step_ids = chosen.masked_fill(done_rows, pad_id)[:, None]
        state.attention = torch.cat([state.attention, (~done_rows).to(state.attention.dtype)[:, None]], dim=-1)
        out = model(
            input_ids=step_ids,
            attention_mask=state.attention,
            position_ids=state.next_pos,
            past_key_values=state.cache,
            use_cache=True,
        )
        state.cache, logits = out.past_key_values, out.logits[:, -1, :]
        state.next_pos = state.next_pos + 1
    # A row's tokens are sampled at consecutive steps from the first, so its logprobs are a prefix.
    logprobs = torch.stack(step_logprobs, dim=1).tolist()
    return ids, [row[: len(ids[i])] for i, row in enumerate(logprobs)], finished


def _mrope_rows(
    model: PolicyModel,
    processor: Any,
    fresh: list[list[int]],
    fresh_images: list[list[vision.ImageRef]],
    grids: torch.Tensor,
    positions: torch.Tensor,
    shifts: list[int],
) -> torch.Tensor:
    """[3, rows, width] positions of a prefill on an M-RoPE model: `positions` (1-D, left-padded)
    for rows without new images, vision.mrope_positions moved to where each row's new tokens start
    for the others, whose `shifts` it updates in place."""
    grids = grids.cpu()  # one read per prefill; get_rope_index walks the grids on the host
    out = positions[None].repeat(3, 1, 1)
    width, used = positions.shape[1], 0
    for i, (ids, imgs) in enumerate(zip(fresh, fresh_images)):
        if not imgs:
            continue
        row, shift = vision.mrope_positions(model, processor, ids, grids[used : used + len(imgs)])
        used += len(imgs)
        out[:, i, width - len(ids) :] = row + positions[i, width - len(ids)]
        shifts[i] += shift
    return out


def _eos_ids(model: PolicyModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def _hits_stop(tokenizer: PreTrainedTokenizerBase, ids: list[int], stops: list[str]) -> bool:
    if not stops:
        return False
    tail = tokenizer.decode(ids[-16:], skip_special_tokens=False)
    return any(s in tail for s in stops)
